"""Scenario 5: ten times what the fleet can serve at once, for 30 s. Two workers of 4 running requests
and 8 admitted each (--max-num-seqs 4 --max-queued-requests 8) get 80 clients that send one request
after another. Every answer is whole or a refusal to come back later (HTTP 429, gRPC
RESOURCE_EXHAUSTED): never a 5xx, never a hang; within 5 s of the load ending a normal request is
answered normally, and the workers are idle."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
import httpx
import pytest

from protos import kvcascade_pb2_grpc as pb_grpc

from .fleet import Fleet, completion_body, completion_request, rounds

pytestmark = pytest.mark.slow

MAX_NUM_SEQS, MAX_QUEUED = 4, 8
CAPACITY = 2 * MAX_NUM_SEQS  # requests the two workers serve at once
CLIENTS = 10 * CAPACITY  # half over HTTP, half over gRPC
LOAD_S = 30
MAX_TOKENS = 32
BACKOFF_S = 0.05  # a refused client waits this long before its next request
ANSWER_BOUND_S = 60  # no request may take longer: a hang
RECOVERY_BOUND_S = 5
# Idle pooled connections are dropped before uvicorn's 5 s keep-alive closes them: at httpx's default (also
# 5 s) a request can go out on a connection the server is closing that instant (ReadError, no answer).
KEEPALIVE_S = 2.0


@pytest.fixture(scope="module")
def small_fleet(tmp_path_factory) -> Fleet:
    fleet = Fleet(tmp_path_factory.mktemp("overload-redis"),
                  worker_flags=("--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED)))
    fleet.start()
    yield fleet
    fleet.stop()


class Tally:
    def __init__(self):
        self.outcomes: Counter = Counter()
        self.bad: list[tuple] = []
        self.slowest = 0.0
        self.retry_after: Counter = Counter()  # 429s with and without a Retry-After header


async def _http_once(client: httpx.AsyncClient, i: int, n: int) -> tuple[str, str]:
    r = await client.post("/v1/completions", json=completion_body(f"Client {i} request {n}: hello", MAX_TOKENS))
    if r.status_code == 200:
        whole = r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        return ("complete" if whole else "partial"), r.text[:200]
    if r.status_code == 429:
        return "429", "retry-after" if "retry-after" in r.headers else "no retry-after"
    return f"http {r.status_code}", r.text[:200]


async def _grpc_once(stub, i: int, n: int) -> tuple[str, str]:
    try:
        msgs = [m async for m in stub.Generate(completion_request(f"Client {i} request {n}: hello", MAX_TOKENS),
                                               timeout=ANSWER_BOUND_S)]
    except grpc.aio.AioRpcError as err:
        return err.code().name, err.details() or ""
    whole = sum(len(m.token_ids) for m in msgs) == MAX_TOKENS and msgs[-1].finish_reason == "length"
    return ("complete" if whole else "partial"), ""


async def _load(fleet: Fleet, tally: Tally) -> float:
    """CLIENTS clients for LOAD_S seconds; returns the time (monotonic) the load stopped starting requests."""
    stop_at = time.monotonic() + LOAD_S
    async with httpx.AsyncClient(base_url=fleet.router.url, timeout=ANSWER_BOUND_S,
                                 limits=httpx.Limits(max_connections=CLIENTS, keepalive_expiry=KEEPALIVE_S)) as http:
        async with grpc.aio.insecure_channel(fleet.router.address) as channel:
            stub = pb_grpc.KVCascadeStub(channel)

            async def client(i: int) -> None:
                n = 0
                while time.monotonic() < stop_at:
                    n += 1
                    start = time.monotonic()
                    try:
                        outcome, detail = await asyncio.wait_for(
                            _http_once(http, i, n) if i % 2 else _grpc_once(stub, i, n), ANSWER_BOUND_S + 5)
                    except (TimeoutError, httpx.TimeoutException):
                        outcome, detail = "hang", ""
                    except httpx.HTTPError as exc:
                        outcome, detail = "transport error", repr(exc)
                    tally.slowest = max(tally.slowest, time.monotonic() - start)
                    tally.outcomes[outcome] += 1
                    if outcome == "429":
                        tally.retry_after[detail] += 1
                    if outcome not in ("complete", "429", "RESOURCE_EXHAUSTED"):
                        tally.bad.append((outcome, detail))
                    if outcome in ("429", "RESOURCE_EXHAUSTED"):
                        await asyncio.sleep(BACKOFF_S)

            recovery = asyncio.create_task(_recovery(fleet, stop_at))
            await asyncio.gather(*(client(i) for i in range(CLIENTS)))
            return await recovery


async def _recovery(fleet: Fleet, stop_at: float) -> float:
    """Seconds from the end of the load until a normal request (in a client of its own) is answered whole."""
    await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
    async with httpx.AsyncClient(base_url=fleet.router.url, timeout=ANSWER_BOUND_S) as client:
        while True:
            r = await client.post("/v1/completions", json=completion_body("A normal request after the storm", 16))
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16:
                return time.monotonic() - stop_at
            assert r.status_code == 429, r.text
            if time.monotonic() - stop_at > 3 * RECOVERY_BOUND_S:
                return time.monotonic() - stop_at
            await asyncio.sleep(0.02)


def test_ten_times_capacity_for_30s_is_served_or_refused_and_recovers_within_5s(small_fleet, soak_s):
    for n in rounds(soak_s):
        tally = Tally()
        recovered = asyncio.run(_load(small_fleet, tally))
        idle = small_fleet.wait_idle(10)
        print(f"\n[overload {n}] {CLIENTS} clients ({CAPACITY} served at once) for {LOAD_S}s: "
              f"{tally.outcomes.total()} requests {dict(tally.outcomes)}; 429s {dict(tally.retry_after)}; "
              f"slowest answer {tally.slowest:.2f}s; a normal request answered {recovered:.2f}s after the load, "
              f"workers idle {idle}s after that")
        assert not tally.bad, Counter(tally.bad).most_common(5)
        assert tally.outcomes["complete"] > 0 and tally.outcomes["429"] + tally.outcomes["RESOURCE_EXHAUSTED"] > 0
        assert tally.slowest < ANSWER_BOUND_S
        assert recovered < RECOVERY_BOUND_S
        assert idle is not None, small_fleet.usage()
    assert not small_fleet.crashed(), small_fleet.crashed()
