"""A run spread over processes: the split of users, rates and bounds, the merged Poisson arrivals,
the merge of known records, and real runs in two processes against a server that only streams
(loadtest/fake_server.py on loopback, in a thread of this process)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvcascade.cli import main as kvcascade_main
from loadtest import fake_server
from loadtest.clients import parse_target
from loadtest.metrics import CUT_OFF, RequestRecord, percentile, summarize
from loadtest.processes import apportion, merge, split
from loadtest.runner import WHOLE, Part, RunResult, arrival_gaps
from loadtest.scenario import Scenario, scenario_from_dict


def scenario(**data) -> Scenario:
    return scenario_from_dict({"max_requests": 100, **data})


def test_apportion_sums_exactly() -> None:
    assert apportion(101, [3, 2]) == [61, 40]
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(2, [1, 1, 1, 1]) == [1, 1, 0, 0]
    rng = random.Random(0)
    for _ in range(200):
        weights = [rng.randint(0, 9) for _ in range(rng.randint(1, 8))]
        weights[0] += 1
        total = rng.randint(0, 1000)
        shares = apportion(total, weights)
        assert sum(shares) == total
        assert all(abs(s - total * w / sum(weights)) < 1 for s, w in zip(shares, weights, strict=True))


def test_split_divides_users_rates_and_bounds() -> None:
    closed = split(scenario(max_requests=101, arrival={"kind": "closed", "concurrency": 5}), 2)
    assert [(s.arrival.concurrency, s.max_requests, p) for s, p in closed] == [(3, 61, Part(0, 2)), (2, 40, Part(1, 2))]
    poisson = split(scenario(max_requests=10, arrival={"kind": "poisson", "rate": 9.0}), 3)
    assert [(s.arrival.rate, s.max_requests) for s, _ in poisson] == [(3.0, 4), (3.0, 3), (3.0, 3)]
    burst = split(scenario(arrival={"kind": "burst", "size": 4, "interval_s": 1.0}), 3)
    assert [(s.arrival.size, s.arrival.interval_s, s.max_requests) for s, _ in burst] == [(2, 1.0, 50), (1, 1.0, 25),
                                                                                           (1, 1.0, 25)]
    # No process without work: one user, or two requests, need no more processes than that.
    (only,) = split(scenario(arrival={"kind": "closed", "concurrency": 1}), 4)
    assert only == (scenario(arrival={"kind": "closed", "concurrency": 1}), Part(0, 1))
    two = split(scenario(max_requests=2, arrival={"kind": "poisson", "rate": 8.0}), 4)
    assert [(s.arrival.rate, s.max_requests, p) for s, p in two] == [(4.0, 1, Part(0, 2)), (4.0, 1, Part(1, 2))]
    s = scenario(arrival={"kind": "poisson", "rate": 2.0})
    assert split(s, 1) == [(s, WHOLE)]


def test_parts_of_a_poisson_run_add_up_to_one_at_the_full_rate() -> None:
    s = scenario(arrival={"kind": "poisson", "rate": 40.0})
    assert list(itertools.islice(arrival_gaps(s, WHOLE), 50)) == list(itertools.islice(arrival_gaps(s), 50))
    horizon, times = 200.0, []
    for part_scenario, part in split(s, 4):
        t, arrivals = 0.0, []
        for gap in arrival_gaps(part_scenario, part):
            t += gap
            if t > horizon:
                break
            arrivals.append(t)
        assert (arrivals[0] == 0.0) == (part.index == 0)  # one arrival at once, not four
        times += arrivals
    times.sort()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) / horizon == pytest.approx(40.0, rel=0.05)
    # Exponential gaps at the full rate: mean 1/rate, standard deviation the same.
    assert statistics.mean(gaps) == pytest.approx(1 / 40, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 40, rel=0.08)


def rec(start: float, e2e: float | None, ttft: float = 0.01, out: int = 4, status: str = "ok") -> RequestRecord:
    return RequestRecord(index=0, session=0, turn=0, tag="", start_s=start, status=status,
                         ttft_s=ttft if e2e is not None else None, e2e_s=e2e, output_tokens=out if e2e else 0)


def part_result(s: Scenario, started_at: float, duration: float, records: list[RequestRecord],
                stopped_by: str = "workload") -> RunResult:
    return RunResult(parse_target("grpc://127.0.0.1:1"), s, records, duration, stopped_by, started_at, [0.5], [0.4])


def test_merge_puts_known_records_on_one_clock() -> None:
    s = scenario(max_requests=7)
    a = part_result(s, 100.0, 2.0, [rec(0.0, 0.5), rec(0.2, 1.0), rec(1.0, 0.1), rec(1.5, None, status=CUT_OFF)],
                    "max_duration_s")
    b = part_result(s, 100.5, 2.5, [rec(0.0, 0.3, ttft=0.05), rec(0.1, None, status="UNAVAILABLE"),
                                    rec(0.6, 2.0, out=10)])
    merged = merge(a.target, s, [a, b])
    assert [r.start_s for r in merged.records] == pytest.approx([0.0, 0.2, 0.5, 0.6, 1.0, 1.1, 1.5])
    assert [r.index for r in merged.records] == list(range(7))
    assert merged.duration_s == pytest.approx(3.0)  # from a's start at 100.0 to b's end at 103.0
    assert merged.stopped_by == "max_duration_s" and merged.started_at == 100.0
    summary = merged.summary()
    assert summary["requests"] == {"sent": 7, "ok": 5, "errors": 1, "cut_off": 1}
    assert summary["harness"] == {"processes": 2, "cpu_s": 1.0, "loop_busy": pytest.approx(0.4 / 3.0)}
    e2e = [0.5, 1.0, 0.1, 0.3, 2.0]
    assert summary["e2e_s"]["p50"] == pytest.approx(percentile(e2e, 50)) == pytest.approx(0.5)
    assert summary["e2e_s"]["p90"] == pytest.approx(percentile(e2e, 90))
    assert summary["ttft_s"]["max"] == pytest.approx(0.05)
    assert summary["throughput"]["requests_per_s"] == pytest.approx(5 / 3.0)
    assert summary["throughput"]["output_tokens_per_s"] == pytest.approx((4 * 4 + 10) / 3.0)
    # The same numbers as one process that had sent all seven would give.
    alone = summarize(merged.records, s.slo, 3.0)
    assert {k: v for k, v in summary.items() if k in alone} == alone

    c = part_result(s, 100.0, 1.0, [rec(0.0, 0.1)] * 3, "max_requests")
    d = part_result(s, 100.0, 1.0, [rec(0.0, 0.1)] * 4, "max_requests")
    assert merge(c.target, s, [c, d]).stopped_by == "max_requests"  # 7 of 7 sent
    assert merge(c.target, s, [c, part_result(s, 100.0, 1.0, [rec(0.0, 0.1)])]).stopped_by == "workload"


def test_bad_process_counts_are_refused(tmp_path: Path, capsys) -> None:
    for value, message in (("0", "must be >= 1, got 0"), ("-2", "must be >= 1, got -2"),
                           ("two", "expected a whole number, got 'two'")):
        with pytest.raises(SystemExit) as exit_:
            kvcascade_main(["loadtest", "--scenario", "multi-turn", "--processes", value, "--out", str(tmp_path)])
        assert exit_.value.code == 2
        assert f"argument --processes: {message}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[int, int]]:
    """A fake server's gRPC and HTTP ports, served from a thread of its own."""
    loop = asyncio.new_event_loop()
    started = asyncio.run_coroutine_threadsafe(fake_server.start(), loop)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, http, port, http_port = started.result(timeout=10)
    yield port, http_port
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=10)
    loop.call_soon_threadsafe(http.close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def write_scenario(path: Path, **data) -> Path:
    path.write_text(yaml.safe_dump({"name": "spread", "seed": 7, "max_duration_s": 60, "api": "completion",
                                    "sampling": {"max_tokens": 8},
                                    "workload": {"kind": "random", "prompt_words": [4, 12]}, **data}))
    return path


def test_a_run_in_two_processes_sends_exactly_max_requests(fake: tuple[int, int], tmp_path: Path, capsys) -> None:
    path = write_scenario(tmp_path / "s.yaml", max_requests=41, arrival={"kind": "closed", "concurrency": 4})
    out = tmp_path / "out"
    rc = kvcascade_main(["loadtest", "--processes", "2", "--scenario", str(path), "--target",
                         f"grpc://127.0.0.1:{fake[0]}", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "41/41 sent, 41 ok, 0 failed" in captured.err  # the one merged progress line
    assert any(line.startswith("harness processes, busiest") and " 2, " in line for line in captured.out.splitlines())
    (run_,) = json.loads((out / "summary.json").read_text())["runs"].values()
    assert run_["requests"] == {"sent": 41, "ok": 41, "errors": 0, "cut_off": 0}
    assert run_["stopped_by"] == "max_requests" and run_["harness"]["processes"] == 2
    assert run_["tokens"]["output"] == 41 * 8 and run_["ttft_s"]["n"] == run_["tpot_s"]["n"] == 41
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(41))
    assert sorted(r["session"] for r in rows) == list(range(41))  # the first 41 sessions, each once
    assert [r["start_s"] for r in rows] == sorted(r["start_s"] for r in rows)
    assert max(r["start_s"] + r["e2e_s"] for r in rows) <= run_["duration_s"] + 1e-6


def test_compare_in_processes_over_both_protocols(fake: tuple[int, int], tmp_path: Path, capsys) -> None:
    path = write_scenario(tmp_path / "s.yaml", max_requests=30, api="chat", arrival={"kind": "poisson", "rate": 300.0})
    out = tmp_path / "out"
    rc = kvcascade_main(["loadtest", "compare", "--processes", "2", "--no-progress", "--scenario", str(path),
                         "--target", f"g=grpc://127.0.0.1:{fake[0]}", "--target", f"h=http://127.0.0.1:{fake[1]}",
                         "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    runs = json.loads((out / "summary.json").read_text())["runs"]
    for name in ("g", "h"):
        assert runs[name]["requests"] == {"sent": 30, "ok": 30, "errors": 0, "cut_off": 0}, runs[name]
        assert runs[name]["harness"]["processes"] == 2 and runs[name]["tokens"]["output"] == 30 * 8
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert sorted(r["session"] for r in rows if r["target"] == "h") == list(range(30))
