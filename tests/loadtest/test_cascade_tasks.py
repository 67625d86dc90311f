"""The tasks workload and what a cascade says it computed: the scenario's task file checked up
front, one session per task, answers scored, tier_usage parsed from gRPC and HTTP, accuracy and
tier tokens in the summary and the table; end to end against loadtest/fake_server.py."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from loadtest.tasks import load_tasks
from loadtest import fake_server, report
from loadtest.clients import GrpcClient, HttpClient, Target, tier_tokens
from loadtest.metrics import RequestRecord
from loadtest.runner import RunResult, run
from loadtest.scenario import REPO_ROOT, Scenario, ScenarioError, load_scenario, scenario_from_dict
from loadtest.workload import sessions
from protos import kvcascade_pb2 as pb

# The fake server answers " tok tok tok tok" to everything: the echo tasks come out right, the sum wrong.
TASKS = [
    {"id": "echo-1", "kind": "echo", "prompt": "Say tok.", "answer": "tok", "scorer": "contains"},
    {"id": "echo-2", "kind": "echo", "prompt": "Say tok twice please.", "answer": "tok tok", "scorer": "contains"},
    {"id": "add-1", "kind": "add", "prompt": "What is 2 + 2?", "answer": "4", "scorer": "numeric"},
]
BUNDLED_TASKS = "deploy/cascade_tasks.jsonl"


def write_tasks(path: Path, tasks: list[dict] = TASKS) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def tasks_scenario(file: str | Path, **data) -> Scenario:
    return scenario_from_dict({"max_requests": 100, "max_duration_s": 30, "api": "chat",
                               "sampling": {"max_tokens": 4, "ignore_eos": False},
                               "arrival": {"kind": "closed", "concurrency": 2},
                               "workload": {"kind": "tasks", "file": str(file)}, **data})


# --- the scenario ---------------------------------------------------------------------------------


def test_a_task_file_is_loaded_when_the_scenario_is(tmp_path: Path) -> None:
    s = tasks_scenario(write_tasks(tmp_path / "t.jsonl"))
    assert [t.id for t in s.workload.tasks()] == ["echo-1", "echo-2", "add-1"]
    assert s.to_dict()["workload"] == {"kind": "tasks", "file": str(tmp_path / "t.jsonl"), "output_tokens": None}


def test_a_relative_file_is_looked_up_here_then_in_the_repository(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert len(tasks_scenario(BUNDLED_TASKS).workload.tasks()) == len(load_tasks(REPO_ROOT / BUNDLED_TASKS))
    (tmp_path / "deploy").mkdir()
    write_tasks(tmp_path / BUNDLED_TASKS)
    assert len(tasks_scenario(BUNDLED_TASKS).workload.tasks()) == len(TASKS)  # the current directory's first


@pytest.mark.parametrize("workload, message", [
    ({"kind": "tasks"}, "workload.file: required"),
    ({"kind": "tasks", "file": "no/such/tasks.jsonl"},
     "workload.file: cannot read 'no/such/tasks.jsonl': No such file or directory (looked in the current directory"),
    ({"kind": "tasks", "file": BUNDLED_TASKS, "output_tokens": [8, 2]}, "workload.output_tokens: needs 0 <= min"),
    ({"kind": "tasks", "file": BUNDLED_TASKS, "prompts": ["hi"]}, "workload.prompts: unknown key of workload kind"),
])  # fmt: skip
def test_bad_tasks_workloads_name_the_key(workload: dict, message: str) -> None:
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict({"workload": workload})
    assert message in str(err.value)


def test_a_bad_task_file_says_where(tmp_path: Path) -> None:
    bad = write_tasks(tmp_path / "bad.jsonl", [TASKS[0], {**TASKS[2], "scorer": "fuzzy"}])
    path = tmp_path / "s.yaml"
    path.write_text(f"workload: {{kind: tasks, file: {bad}}}\n")
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    assert str(err.value).startswith(f"{path}: workload.file: {bad}:2: scorer: 'fuzzy' is not one of")


# --- the workload --------------------------------------------------------------------------------------


def test_one_session_per_task_tagged_by_kind(tmp_path: Path) -> None:
    s = tasks_scenario(write_tasks(tmp_path / "t.jsonl"))
    got = list(sessions(s))
    assert sorted(x.task.id for x in got) == ["add-1", "echo-1", "echo-2"] and [x.id for x in got] == [0, 1, 2]
    for x in got:
        assert x.users == [x.task.prompt] and x.tag == x.task.kind and x.max_tokens == [4] and x.system is None
    ranged = tasks_scenario(tmp_path / "t.jsonl", workload={"kind": "tasks", "file": str(tmp_path / "t.jsonl"),
                                                            "output_tokens": [2, 3]})
    assert all(2 <= x.max_tokens[0] <= 3 for x in sessions(ranged))


def test_the_order_is_shuffled_by_seed() -> None:
    def ids(seed: int) -> list[str]:
        return [x.task.id for x in sessions(tasks_scenario(BUNDLED_TASKS, seed=seed))]

    in_file = [t.id for t in load_tasks(REPO_ROOT / BUNDLED_TASKS)]
    assert ids(3) == ids(3) and sorted(ids(3)) == sorted(in_file)
    assert ids(3) != in_file and ids(3) != ids(4)


# --- the clients' parsing ---------------------------------------------------------------------------------

USAGE = [
    {"tier": "small", "model": "s", "role": "trial", "prompt_tokens": 30, "cached_tokens": 16, "completion_tokens": 8},
    {"tier": "large", "model": "l", "role": "judge", "prompt_tokens": 38, "cached_tokens": 0, "completion_tokens": 0},
    {"tier": "large", "model": "l", "role": "answer", "prompt_tokens": 30, "cached_tokens": 30,
     "completion_tokens": 5},
]
COMPUTED = {"small": {"trial": 30 - 16 + 8}, "large": {"judge": 38, "answer": 5}}


def test_tier_tokens_are_prompt_less_cached_plus_completion() -> None:
    assert tier_tokens(USAGE) == COMPUTED
    assert tier_tokens(USAGE + [{**USAGE[1], "prompt_tokens": 2}]) == {**COMPUTED, "large": {"judge": 40, "answer": 5}}
    assert tier_tokens([]) is None


def new_record() -> RequestRecord:
    return RequestRecord(index=0, session=0, turn=0, tag="", start_s=0.0)


async def _grpc_last(msg: pb.GenerateResponse, proto_has_tier_usage: bool = True) -> RequestRecord:
    """What the gRPC client makes of ``msg`` as a stream's last message."""
    client = GrpcClient("127.0.0.1:1", Scenario())
    client.has_tier_usage = proto_has_tier_usage
    rec = new_record()
    client._last(msg, rec)
    await client.aclose()
    return rec


def test_grpc_last_message_carries_tier_usage() -> None:
    msg = pb.GenerateResponse(finish_reason="stop", tier="large", escalated=True,
                              tier_usage=[pb.TierUsage(**u) for u in USAGE])
    rec = asyncio.run(_grpc_last(msg))
    assert (rec.tier, rec.escalated, rec.tier_tokens) == ("large", True, COMPUTED)
    assert asyncio.run(_grpc_last(msg, proto_has_tier_usage=False)).tier_tokens is None  # an older proto
    assert asyncio.run(_grpc_last(pb.GenerateResponse(finish_reason="stop"))).tier_tokens is None  # no cascade


def test_http_chunks_carry_tier_usage_on_the_last() -> None:
    rec = new_record()
    HttpClient._extensions({"tier": "large", "escalated": True, "choices": []}, rec)
    assert (rec.tier, rec.escalated, rec.tier_tokens) == ("large", True, None)
    HttpClient._extensions({"tier": "large", "escalated": True, "tier_usage": USAGE, "judge_score": -0.4}, rec)
    assert rec.tier_tokens == COMPUTED
    HttpClient._extensions({"choices": [], "usage": {"prompt_tokens": 30}}, rec)  # the usage chunk after it
    assert rec.tier_tokens == COMPUTED


# --- end to end -----------------------------------------------------------------------------------------


async def _run_against_fake(s: Scenario, cascade: bool) -> dict[str, RunResult]:
    server, http, port, http_port = await fake_server.start(cascade=cascade)
    try:
        return {"g": await run(s, Target("g", "grpc", f"127.0.0.1:{port}")),
                "h": await run(s, Target("h", "http", f"http://127.0.0.1:{http_port}"))}
    finally:
        await server.stop(None)
        http.close()
        await http.wait_closed()


def test_a_tasks_run_against_a_cascade_scores_answers_and_counts_tier_tokens(tmp_path: Path) -> None:
    s = tasks_scenario(write_tasks(tmp_path / "t.jsonl"))
    results = asyncio.run(_run_against_fake(s, cascade=True))
    task_of = {x.id: x.task for x in sessions(s)}
    for result in results.values():
        assert result.stopped_by == "workload" and len(result.records) == len(TASKS)
        assert all(r.ok for r in result.records), [r.error for r in result.records]
        for r in result.records:
            task = task_of[r.session]
            assert r.tag == task.kind and r.correct is (task.kind == "echo"), (task, r)
            assert r.tier == "small" and r.escalated is False
            computed = len(task.prompt.split()) + 4  # the fake's prompt tokens (one a word) and its 4-token answer
            assert r.tier_tokens == {"small": {"answer": computed}, "large": {"judge": computed}}
        summary = result.summary()
        assert summary["accuracy"] == pytest.approx(2 / 3)
        assert summary["tags"]["echo"]["accuracy"] == 1.0 and summary["tags"]["add"]["accuracy"] == 0.0
        total = sum(len(t["prompt"].split()) + 4 for t in TASKS)
        assert summary["cascade_tokens"] == {"small": {"answer": total, "total": total},
                                             "large": {"judge": total, "total": total}}
    table = report.table(s, {name: r.summary() for name, r in results.items()})
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert rows["accuracy"].split()[-2:] == ["66.7%", "66.7%"]
    assert rows["tier tokens"].endswith(f"small {total}, large {total} (judge {total})")
    assert rows["tag add"].count("accuracy 0%") == 2 and rows["tag echo"].count("accuracy 100%") == 2


def test_without_a_cascade_the_tier_tokens_are_na_and_accuracy_is_still_scored(tmp_path: Path) -> None:
    s = tasks_scenario(write_tasks(tmp_path / "t.jsonl"))
    results = asyncio.run(_run_against_fake(s, cascade=False))
    for result in results.values():
        assert all(r.tier_tokens is None and r.tier is None for r in result.records)
        summary = result.summary()
        assert summary["cascade_tokens"] is None and summary["accuracy"] == pytest.approx(2 / 3)
    rows = {line.split("  ")[0]: line for line in report.table(s, {n: r.summary() for n, r in results.items()})
            .splitlines()}
    assert rows["tier tokens"].split()[-2:] == ["n/a", "n/a"]


# --- the table --------------------------------------------------------------------------------------------


def _summary(records: list[RequestRecord]) -> dict:
    return RunResult(Target("t", "grpc", "127.0.0.1:1"), Scenario(), records, 1.0, "workload").summary()


def test_the_table_shows_accuracy_and_tier_tokens_side_by_side() -> None:
    def rec(i: int, **kw) -> RequestRecord:
        return RequestRecord(index=i, session=i, turn=0, tag="", start_s=0.0, ttft_s=0.1, e2e_s=0.2, **kw)

    cascade = [rec(0, correct=True, tier_tokens={"small": {"answer": 12_000}, "large": {"judge": 2_000}}),
               rec(1, correct=False, tier_tokens={"small": {"trial": 300}, "large": {"answer": 2_100}}),
               rec(2, correct=True)]
    plain = [rec(0), rec(1)]
    table = report.table(Scenario(), {"cascade": _summary(cascade), "plain": _summary(plain)})
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert rows["accuracy"].split()[-2:] == ["66.7%", "n/a"]
    assert rows["tier tokens"].split("  ")[-1].strip() == "n/a"
    assert "small 12.3k (trial 300), large 4.1k (judge 2.0k)" in rows["tier tokens"]


def test_a_burst_run_ends_when_its_requests_are_done_not_an_interval_later(tmp_path: Path) -> None:
    s = scenario_from_dict({"name": "bursts", "max_requests": 8, "max_duration_s": 60,
                            "arrival": {"kind": "burst", "size": 4, "interval_s": 1.0},
                            "workload": {"kind": "random", "prompt_words": [2, 4], "output_tokens": [1, 2]}})
    started = time.perf_counter()
    results = asyncio.run(_run_against_fake(s, cascade=False))
    elapsed = time.perf_counter() - started
    for result in results.values():
        assert result.stopped_by == "max_requests" and len(result.records) == 8 and all(r.ok for r in result.records)
    # Two runs of two bursts one second apart: about 2 s; waiting out the next burst would be 4 s.
    assert elapsed < 3.5, elapsed
