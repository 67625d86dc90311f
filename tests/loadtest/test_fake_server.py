"""The fake server's ``interval_ms``: a stream paced like engine steps, over gRPC and HTTP, so a
benchmark sets the offered rate with the number of streams (benchmarks/router_capacity.py)."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx

from loadtest import fake_server
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc


async def _timed_streams(interval_ms: float) -> tuple[float, float]:
    """Seconds one 10-token stream takes over gRPC, then over HTTP."""
    server, http, port, http_port = await fake_server.start(interval_ms=interval_ms)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = pb.GenerateRequest(text="a b c", sampling=pb.SamplingParams(max_tokens=10))
            t0 = time.perf_counter()
            tokens = [len(m.token_ids) async for m in pb_grpc.KVCascadeStub(channel).Generate(request)]
            grpc_s = time.perf_counter() - t0
        assert tokens == [1] * 10
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as client:
            t0 = time.perf_counter()
            body = {"prompt": "a b c", "max_tokens": 10, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                events = [line async for line in resp.aiter_lines() if line.startswith("data:")]
            http_s = time.perf_counter() - t0
        assert len(events) == 10 + 3  # 10 tokens, the finish, usage, [DONE]
        return grpc_s, http_s
    finally:
        await server.stop(None)
        http.close()
        await http.wait_closed()


def test_interval_paces_a_stream() -> None:
    grpc_s, http_s = asyncio.run(_timed_streams(20.0))
    # 10 steps, so 9 pauses of 20 ms between them, on both protocols.
    assert 0.18 <= grpc_s < 1.0, grpc_s
    assert 0.18 <= http_s < 1.0, http_s


def test_no_interval_streams_at_once() -> None:
    grpc_s, http_s = asyncio.run(_timed_streams(0.0))
    assert grpc_s < 0.15 and http_s < 0.15, (grpc_s, http_s)
