"""Scenario 4: 40 concurrent streams through the router, half of whose clients leave after the first
chunk (a cancelled gRPC call, or an HTTP connection closed after the first SSE event), three rounds.
After each round every worker is idle within a few seconds (no KV block leaked, nothing running)
and the streams that stayed finished whole."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from protos import kvcascade_pb2_grpc as pb_grpc

from .fleet import completion_body, completion_request, rounds

pytestmark = pytest.mark.slow

STREAMS = 40  # a quarter each: gRPC leaves, HTTP leaves, gRPC stays, HTTP stays
ROUNDS = 3
LEAVER_TOKENS = 2000  # a leaked request would still be running (and holding blocks) at the check
STAYER_TOKENS = 64
IDLE_WITHIN_S = 5


def _grpc(stub, i: int, leave: bool) -> int:
    """Tokens received: a leaver cancels its call after the first message."""
    request = completion_request(f"Stream {i}: tell me about tents", LEAVER_TOKENS if leave else STAYER_TOKENS)
    call = stub.Generate(request, timeout=120)
    tokens = 0
    for msg in call:
        tokens += len(msg.token_ids)
        if leave:
            call.cancel()
            break
    return tokens


def _http(client: httpx.Client, i: int, leave: bool) -> int:
    """Tokens received (from the usage chunk); a leaver closes the connection after the first event."""
    body = completion_body(f"Stream {i}: tell me about boots", LEAVER_TOKENS if leave else STAYER_TOKENS,
                           stream=True, stream_options={"include_usage": True})
    tokens, done = 0, False
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if leave:
                return -1  # leaving the block closes the response mid-body, so the connection
            if line == "data: [DONE]":
                done = True
            elif (usage := json.loads(line[6:]).get("usage")) is not None:
                tokens = usage["completion_tokens"]
    return tokens if done else -2


def test_clients_leaving_mid_stream_leak_no_kv_block(fleet, soak_s):
    with grpc.insecure_channel(fleet.router.address) as channel:
        stub = pb_grpc.KVCascadeStub(channel)
        for n in rounds(soak_s, minimum=ROUNDS):
            _round(fleet, stub, n)
    assert not fleet.crashed(), fleet.crashed()


def _round(fleet, stub, n: int) -> None:
    start = threading.Barrier(STREAMS)

    def one(i: int) -> tuple[str, bool, int]:
        via, leave = ("grpc", "http")[i % 2], i % 4 < 2
        with httpx.Client(base_url=fleet.router.url, timeout=120) as client:
            start.wait(30)
            return via, leave, _grpc(stub, i, leave) if via == "grpc" else _http(client, i, leave)

    with ThreadPoolExecutor(STREAMS) as pool:
        results = list(pool.map(one, range(STREAMS)))
    idle = fleet.wait_idle(IDLE_WITHIN_S)
    stayers = [r for r in results if not r[1]]
    print(f"\n[disconnects {n}] {STREAMS} streams, {STREAMS - len(stayers)} left after their first chunk; "
          f"{sum(t == STAYER_TOKENS for _, _, t in stayers)}/{len(stayers)} stayers whole; workers idle "
          f"{'never' if idle is None else f'{idle:.2f}s'} after the round: {fleet.usage()}")
    assert idle is not None, f"KV blocks leaked: {fleet.usage()}"
    assert [t for _, _, t in stayers] == [STAYER_TOKENS] * len(stayers), stayers
