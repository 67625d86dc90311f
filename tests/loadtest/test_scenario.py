"""Scenario files: every key checked and named when wrong; workloads and arrivals reproducible by
seed; target addresses. No server needed."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from kvcascade.cli import main as kvcascade_main
from loadtest.clients import Target, parse_target
from loadtest.runner import arrival_gaps
from loadtest.scenario import SCENARIO_DIR, ScenarioError, load_scenario, scenario_from_dict
from loadtest.workload import sessions

BUNDLED = sorted(SCENARIO_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", BUNDLED, ids=[p.stem for p in BUNDLED])
def test_bundled_scenarios_load(path: Path) -> None:
    s = load_scenario(path)
    assert s.name == path.stem and s.max_requests <= 100 and s.max_duration_s <= 120  # laptop-sized
    assert load_scenario(path.stem) == s  # by name too
    assert len(list(itertools.islice(sessions(s), 50))) > 0


def test_the_workloads_are_bundled() -> None:
    kinds = {load_scenario(p).workload.kind for p in BUNDLED}
    assert {"shared_prefix", "multi_turn", "random", "cascade_mix", "tasks"} <= kinds


@pytest.mark.parametrize("data, message", [
    ({"max_requsts": 3}, "max_requsts: unknown key (did you mean 'max_requests'?)"),
    ({"workload": {"kind": "shared_prefix", "prefix_wrds": 3}}, "workload.prefix_wrds: unknown key"),
    ({"workload": {"kind": "random", "sessions": 3}}, "workload.sessions: unknown key of workload kind 'random'"),
    ({"workload": {"kind": "chatty"}}, "workload.kind: must be one of"),
    ({"sampling": {"temprature": 0.5}}, "sampling.temprature: unknown key (did you mean 'temperature'?)"),
    ({"sampling": {"max_tokens": "16"}}, "sampling.max_tokens: expected an integer, got '16'"),
    ({"arrival": {"kind": "poisson"}}, "arrival.rate: required for arrival kind 'poisson'"),
    ({"arrival": {"kind": "closed", "concurrency": 2, "rate": 1}}, "arrival.rate: not used by arrival kind"),
    ({"arrival": {"kind": "burst", "size": 0, "interval_s": 1}}, "arrival.size: must be > 0"),
    ({"slo": {"ttft_s": 0}}, "slo.ttft_s: must be > 0"),
    ({"slo": 1}, "slo: expected a mapping"),
    ({"workload": {"kind": "random", "prompt_words": [9, 3]}}, "workload.prompt_words: needs 0 <= min <= max"),
    ({"workload": {"kind": "cascade_mix", "hard_fraction": 1.5}}, "workload.hard_fraction: must be in [0, 1]"),
    ({"max_duration_s": -1}, "max_duration_s: must be > 0"),
    ({"protocol": "ftp"}, "protocol: must be grpc or http"),
])  # fmt: skip
def test_bad_scenarios_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(data)
    assert message in str(err.value)


def test_a_bad_file_is_refused_by_the_cli_naming_file_and_key(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("max_requests: 3\narrival: {kind: closed, concurency: 2}\n")
    assert kvcascade_main(["loadtest", "--scenario", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "arrival.concurency: unknown key (did you mean 'concurrency'?)" in err
    assert not (tmp_path / "out").exists()
    assert kvcascade_main(["loadtest", "--scenario", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read scenario" in capsys.readouterr().err


def first(scenario, n: int):
    return [(s.system, s.users, s.max_tokens, s.tag) for s in itertools.islice(sessions(scenario), n)]


@pytest.mark.parametrize("name", ["shared-prefix-chat", "multi-turn", "random-lengths", "cascade-mix", "cascade-tasks"])
def test_workloads_repeat_by_seed(name: str) -> None:
    s = load_scenario(name)
    assert first(s, 20) == first(s, 20)
    assert first(s, 20) != first(scenario_from_dict({**s.to_dict(), "seed": s.seed + 1}), 20)


def test_shared_prefix_is_prefixes_times_users() -> None:
    s = scenario_from_dict({"workload": {"kind": "shared_prefix", "prefixes": 3, "users_per_prefix": 4,
                                         "prefix_words": 50}})
    all_sessions = list(sessions(s))
    assert len(all_sessions) == 12
    systems = [x.system for x in all_sessions]
    assert len(set(systems)) == 3 and all(systems.count(p) == 4 for p in set(systems))
    assert all(45 <= len(p.split()) <= 55 for p in set(systems))
    assert len({x.users[0] for x in all_sessions}) == 12


def test_multi_turn_carries_the_answers() -> None:
    s = scenario_from_dict({"workload": {"kind": "multi_turn", "sessions": 1, "turns": 3, "system_words": 10}})
    session = next(sessions(s))
    first_turn = session.request(0)
    assert [m["role"] for m in first_turn.messages] == ["system", "user"]
    session.answered(0, "ANSWER ONE")
    second = session.request(1)
    assert second.messages[:2] == first_turn.messages
    assert second.messages[2] == {"role": "assistant", "content": "ANSWER ONE"}
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "user"]
    assert second.as_text().endswith("Assistant:") and "Assistant: ANSWER ONE\n" in second.as_text()


def test_cascade_mix_tags_easy_and_hard() -> None:
    s = scenario_from_dict({"workload": {"kind": "cascade_mix", "hard_fraction": 0.25,
                                         "easy_output_tokens": 4, "hard_output_tokens": 64}})
    mix = list(itertools.islice(sessions(s), 400))
    hard = [x for x in mix if x.tag == "hard"]
    assert {x.tag for x in mix} == {"easy", "hard"}
    assert 0.18 < len(hard) / len(mix) < 0.32
    assert all(x.max_tokens == [64] for x in hard) and all(x.max_tokens == [4] for x in mix if x.tag == "easy")


def test_arrivals() -> None:
    poisson = scenario_from_dict({"arrival": {"kind": "poisson", "rate": 4.0}})
    gaps = list(itertools.islice(arrival_gaps(poisson), 4001))
    assert gaps[0] == 0 and statistics.mean(gaps[1:]) == pytest.approx(0.25, rel=0.06)
    assert gaps == list(itertools.islice(arrival_gaps(poisson), 4001))  # seeded
    burst = scenario_from_dict({"arrival": {"kind": "burst", "size": 3, "interval_s": 2}})
    assert list(itertools.islice(arrival_gaps(burst), 7)) == [0, 0, 0, 2, 0, 0, 2]


@pytest.mark.parametrize("spec, default, expected", [
    ("grpc://127.0.0.1:50051", None, Target("127.0.0.1:50051", "grpc", "127.0.0.1:50051")),
    ("http://127.0.0.1:8000/v1/", None, Target("127.0.0.1:8000/v1", "http", "http://127.0.0.1:8000")),
    ("a=http://h:8000", "grpc", Target("a", "http", "http://h:8000")),
    ("h:1", "http", Target("h:1", "http", "http://h:1")),
    ("b=h:1", None, Target("b", "grpc", "h:1")),
])  # fmt: skip
def test_targets(spec: str, default: str | None, expected: Target) -> None:
    assert parse_target(spec, default) == expected


def test_bad_targets() -> None:
    with pytest.raises(ValueError, match="unknown scheme 'ftp'"):
        parse_target("ftp://h:1")
    with pytest.raises(ValueError, match="no address"):
        parse_target("grpc://")
