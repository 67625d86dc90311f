"""The harness against a real stack: ``kvcascade serve`` (worker + router, gRPC and HTTP) as a
subprocess on free loopback ports, over both protocols, on runs whose answers are known."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from deploy.local import free_port
from kvcascade.cli import main as kvcascade_main
from loadtest.clients import Target, parse_target
from loadtest.metrics import CUT_OFF, summarize
from loadtest.runner import RunResult, run
from loadtest.scenario import Slo, scenario_from_dict
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Serve:
    grpc: Target
    http: Target

    def idle_within(self, seconds: float) -> bool:
        """Whether the server soon runs no request: cancelled ones are freed, not left generating."""
        deadline = time.monotonic() + seconds
        with grpc.insecure_channel(self.grpc.address) as ch:
            stub = pb_grpc.KVCascadeStub(ch)
            while stub.Stats(pb.StatsRequest(), timeout=5).running:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)
        return True


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    port, http_port = free_port(), free_port()
    log = open(Path(tempfile.gettempdir()) / f"kvcascade-loadtest-serve-{port}.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcascade", "serve", "--port", str(port), "--http-port", str(http_port),
         "--kv-cache-memory", "64MiB"],
        cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1"), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"kvcascade serve exited: {Path(log.name).read_text()[-3000:]}"
            assert time.monotonic() < deadline, "kvcascade serve not ready in 180 s"
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield Serve(parse_target(f"grpc=grpc://127.0.0.1:{port}"), parse_target(f"http=http://127.0.0.1:{http_port}"))
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def scenario(**data):
    return scenario_from_dict({"max_requests": 20, "max_duration_s": 60, "sampling": {"max_tokens": 4},
                               "arrival": {"kind": "closed", "concurrency": 1}, **data})


def go(s, target: Target) -> RunResult:
    return asyncio.run(run(s, target, progress=None))


def long_prompt() -> str:
    """A prompt no earlier request sent (so nothing of it is cached yet), several KV blocks long."""
    words = " ".join(f"item {i} costs {i * 7 % 23} euros;" for i in range(40))
    return f"Inventory {uuid.uuid4().hex}: {words} the total is"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_repeated_prompt_hits_the_cache_after_the_first(serve: Serve, protocol: str) -> None:
    generous, impossible = Slo(ttft_s=60, tpot_s=60, e2e_s=60), Slo(ttft_s=1e-6)
    slo = generous if protocol == "grpc" else impossible
    s = scenario(api="completion", workload={"kind": "fixed", "prompts": [long_prompt()], "repeat": 3},
                 slo={"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2e_s": slo.e2e_s})
    result = go(s, getattr(serve, protocol))
    recs = result.records
    assert [r.status for r in recs] == ["ok"] * 3, [r.error for r in recs]
    assert recs[0].cached_tokens == 0
    assert all(r.cached_tokens > 0 for r in recs[1:])
    assert all(r.prompt_tokens == recs[0].prompt_tokens > 100 for r in recs)
    assert all(r.output_tokens == 4 and r.ttft_s is not None and r.ttft_s <= r.e2e_s for r in recs)

    summary = result.summary()
    assert summary["stopped_by"] == "workload"
    assert summary["requests"] == {"sent": 3, "ok": 3, "errors": 0, "cut_off": 0}
    assert summary["tokens"]["cached"] == sum(r.cached_tokens for r in recs)
    assert summary["tokens"]["requests_with_cache_hits"] == 2
    assert summary["goodput"]["fraction"] == (1.0 if slo is generous else 0.0)
    assert summarize(recs, generous, result.duration_s)["goodput"]["fraction"] == 1.0
    assert summarize(recs, impossible, result.duration_s)["goodput"]["fraction"] == 0.0
    assert summary["tiers"] is None and summary["escalation_rate"] is None  # no cascade yet: n/a
    # The router names the worker and its own TTFT on both protocols (HTTP: extension fields of the last chunk).
    assert len(summary["workers"]) == 1 and list(summary["workers"].values()) == [1.0]
    assert all(0 < r.server_ttft_s <= r.ttft_s for r in recs)


def test_multi_turn_sessions_carry_the_real_answers(serve: Serve) -> None:
    s = scenario(workload={"kind": "multi_turn", "sessions": 2, "turns": 2, "system_words": 30, "user_words": 6},
                 arrival={"kind": "poisson", "rate": 20.0})
    recs = go(s, serve.http).records
    assert len(recs) == 4 and all(r.ok for r in recs), [r.error for r in recs]
    by = {(r.session, r.turn): r for r in recs}
    for session in (0, 1):
        one, two = by[session, 0], by[session, 1]
        assert two.start_s >= one.start_s + one.e2e_s  # the next turn waits for the answer
        # The second prompt holds the first one, its 4-token answer and a new question.
        assert two.prompt_tokens > one.prompt_tokens + one.output_tokens
        assert two.cached_tokens >= 16  # at least one full block of the conversation so far


def test_compare_from_the_command_line(serve: Serve, tmp_path: Path, capsys) -> None:
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump({
        "name": "tiny-mix", "seed": 5, "max_requests": 3, "max_duration_s": 60, "sampling": {"max_tokens": 4},
        "arrival": {"kind": "burst", "size": 3, "interval_s": 1},
        "workload": {"kind": "cascade_mix", "hard_fraction": 0.5, "easy_output_tokens": 2, "hard_output_tokens": 4},
        "slo": {"ttft_s": 60, "tpot_s": 60}}))
    out = tmp_path / "out"
    rc = kvcascade_main(["loadtest", "compare", "--scenario", str(path), "--target", f"g=grpc://{serve.grpc.address}",
                         "--target", f"h={serve.http.address}/v1", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "[g] |" in captured.err and "[h] |" in captured.err  # the progress lines
    lines = captured.out.splitlines()
    header = next(line for line in lines if line.split() == ["g", "h"])
    assert header and any(line.startswith("tier mix") and line.split()[-2:] == ["n/a", "n/a"] for line in lines)
    assert any(line.startswith("sent / ok / errors / cut off") for line in lines)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scenario"]["name"] == "tiny-mix" and set(summary["runs"]) == {"g", "h"}
    for name in ("g", "h"):
        run_ = summary["runs"][name]
        assert run_["requests"] == {"sent": 3, "ok": 3, "errors": 0, "cut_off": 0}
        assert sum(t["sent"] for t in run_["tags"].values()) == 3
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["tag"] for r in rows} <= {"easy", "hard"}
    for png in ("latency_cdf.png", "throughput.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize("protocol, status", [("grpc", "UNAVAILABLE"), ("http", "connection_error")])
def test_a_target_that_does_not_listen_gives_errors_not_a_hang(protocol: str, status: str) -> None:
    s = scenario(protocol=protocol, max_requests=6, arrival={"kind": "closed", "concurrency": 2},
                 workload={"kind": "random", "prompt_words": 8})
    t0 = time.monotonic()
    result = go(s, parse_target(f"127.0.0.1:{free_port()}", protocol))
    assert time.monotonic() - t0 < 15
    summary = result.summary()
    assert summary["requests"] == {"sent": 6, "ok": 0, "errors": 6, "cut_off": 0}
    assert summary["errors_by_status"] == {status: 6}
    assert summary["goodput"]["fraction"] == 0 and summary["ttft_s"]["n"] == 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_time_bound_stops_a_run(serve: Serve, protocol: str) -> None:
    s = scenario(max_requests=1000, max_duration_s=1.5, sampling={"max_tokens": 512},
                 arrival={"kind": "closed", "concurrency": 2}, workload={"kind": "random", "prompt_words": 8})
    t0 = time.monotonic()
    result = go(s, getattr(serve, protocol))
    assert time.monotonic() - t0 < 4
    summary = result.summary()
    assert summary["stopped_by"] == "max_duration_s" and 1.5 <= result.duration_s < 4
    # 512 tokens take longer than the bound: what is in flight then is cut off (both users' requests,
    # unless one finished first: a CI run on a loaded box once saw one of the two end before it)
    statuses = [r.status for r in result.records]
    assert summary["requests"]["sent"] < 1000 and summary["requests"]["cut_off"] >= 1, statuses
    assert summary["requests"]["errors"] == 0, statuses
    assert all(r.status == CUT_OFF and r.e2e_s is None for r in result.records if not r.ok)
    assert serve.idle_within(10)  # the cut-off requests were cancelled on the server too


def test_a_slow_request_times_out_and_is_cancelled(serve: Serve) -> None:
    s = scenario(max_requests=1, request_timeout_s=0.5, sampling={"max_tokens": 512},
                 workload={"kind": "random", "prompt_words": 8})
    (rec,) = go(s, serve.grpc).records
    assert rec.status == "timeout" and rec.e2e_s is None
    assert serve.idle_within(10)
