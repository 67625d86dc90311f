"""How the router's fronts relay a worker's stream (router/coalesce.py), gRPC and HTTP alike, with
fake workers (tests/router/fake_worker.py) so that only the relay is measured: a client that reads
slowly gets fewer, larger messages that add up to the whole answer; one that keeps up gets the
tokens as they come; 32 streams at once all come out whole; a client that leaves cancels the
worker's call, also while the relay is holding back for it."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest

from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from router.coalesce import DEFAULT_LIMIT
from router.grpc_api import RouterServer
from router.http_api import create_app, http_port, serve_http, stop_http
from contracts.memory_state import MemoryPrefixIndex, MemoryRegistry
from router.router import Router
from contracts.state import WorkerInfo

from .fake_worker import FakeWorker, token_text
from .loop_thread import LoopThread

WIDE = 1000  # bytes of text a token of "fake-wide": flow-control windows fill within tens of tokens
SLOW_S = 0.005  # "fake-slow" sends a token every 5 ms: slower than any client here
# Every worker, by the model name it serves: (text bytes a token, seconds between tokens).
WORKERS = {"fake": (0, 0.0), "fake-wide": (WIDE, 0.0), "fake-slow": (0, SLOW_S)}
# Socket buffers of a client on a slow link. Left to themselves, the kernel's buffers on loopback
# grow to megabytes and take a whole answer off the router's hands before the client reads any.
LINK_BUFFER = 64 * 1024


@dataclass
class Stack:
    loop: LoopThread
    workers: dict[str, FakeWorker]
    router: Router
    grpc_address: str
    base_url: str

    def cancelled(self, model: str) -> int:
        return self.workers[model].servicer.cancelled

    def wait_for_cancel(self, model: str, before: int, within_s: float = 5.0) -> float:
        """Seconds until the worker of ``model`` saw one more call cancelled."""
        start = time.monotonic()
        while self.cancelled(model) == before:
            assert time.monotonic() - start < within_s, f"the {model} worker's call was not cancelled"
            time.sleep(0.01)
        return time.monotonic() - start


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    workers = {model: FakeWorker(pad, interval) for model, (pad, interval) in WORKERS.items()}
    loop = LoopThread()

    async def start():
        registry = MemoryRegistry()
        infos = [WorkerInfo(worker_id=model, epoch="e1", address=w.address, model=model,
                            model_source="smollm2-135m", capacity=64) for model, w in workers.items()]
        for info in infos:
            await registry.register(info, ttl_s=3600)
        router = Router(registry, MemoryPrefixIndex())
        await router.tokenizers.of(infos[0])  # loaded now, not inside a test's timing
        server = RouterServer(router, "127.0.0.1", 0)
        await server.start()
        http, task = await serve_http(create_app(router), "127.0.0.1", 0)
        # Connections accepted from now on inherit the listening socket's send buffer.
        http.servers[0].sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LINK_BUFFER)
        return router, server, http, task

    router, server, http, task = loop.run(start())
    try:
        yield Stack(loop, workers, router, server.address, f"http://127.0.0.1:{http_port(http)}")
    finally:
        loop.run(stop_http(http, task))
        loop.run(server.stop(0))
        loop.run(router.close())
        loop.close()
        for w in workers.values():
            w.close()


def request(model: str, n: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=model, sampling=pb.SamplingParams(max_tokens=n))
    req.token_ids.ids[:] = [1, 2, 3]
    return req


def answer_text(model: str, n: int) -> str:
    return "".join(token_text(i, WORKERS[model][0]) for i in range(n))


def completion(model: str, n: int, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": [1, 2, 3], "max_tokens": n, "stream": True, **fields}


def grpc_channel(stack: Stack, slow_link: bool = False) -> grpc.Channel:
    # Without BDP probing the stream's window stays at HTTP/2's 64 KB, as on a slow link.
    return grpc.insecure_channel(stack.grpc_address, options=[("grpc.http2.bdp_probe", 0)] if slow_link else [])


def http_client(slow_link: bool = False) -> httpx.Client:
    options = [(socket.SOL_SOCKET, socket.SO_RCVBUF, LINK_BUFFER)] if slow_link else []
    return httpx.Client(transport=httpx.HTTPTransport(socket_options=options), timeout=60)


def read_grpc(stack: Stack, model: str, n: int, *, wait_s: float = 0.0, per_message_s: float = 0.0,
              slow_link: bool = False, channel: grpc.Channel | None = None) -> list[pb.GenerateResponse]:
    """The messages of one Generate through the router, read after ``wait_s``, ``per_message_s`` apart."""
    own = channel is None
    channel = grpc_channel(stack, slow_link) if own else channel
    try:
        call = pb_grpc.KVCascadeStub(channel).Generate(request(model, n), timeout=60)
        time.sleep(wait_s)
        messages = []
        for msg in call:
            messages.append(msg)
            time.sleep(per_message_s)
        return messages
    finally:
        if own:
            channel.close()


def read_sse(stack: Stack, model: str, n: int, *, wait_s: float = 0.0, per_event_s: float = 0.0,
             slow_link: bool = False, **fields: Any) -> list[dict[str, Any]]:
    """The chunks of one streamed completion (up to [DONE]), read like ``read_grpc``'s messages."""
    events = []
    with http_client(slow_link) as client, client.stream("POST", f"{stack.base_url}/v1/completions",
                                                          json=completion(model, n, **fields)) as response:
        assert response.status_code == 200, response.read()
        time.sleep(wait_s)
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                time.sleep(per_event_s)
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def sse_tokens(chunk: dict[str, Any]) -> list[int]:
    """The fake worker's token ids, back from a chunk's text (" t0_ t1_" -> [0, 1])."""
    return [int(t.rstrip("_")) for t in chunk["choices"][0]["text"].split(" t")[1:]]


# --- clients that lag -----------------------------------------------------------------------------


def test_a_slow_grpc_client_gets_fewer_larger_messages_that_add_up_to_the_answer(stack: Stack) -> None:
    n = 1000
    msgs = read_grpc(stack, "fake-wide", n, wait_s=0.3, per_message_s=0.001, slow_link=True)
    assert [t for m in msgs for t in m.token_ids] == list(range(n))
    assert "".join(m.text for m in msgs) == answer_text("fake-wide", n)
    # Relayed one for one it would be 1000 messages; the first tens fill the window, then each
    # write takes all that piled up meanwhile (at most the relay's buffer).
    sizes = [len(m.token_ids) for m in msgs]
    assert len(msgs) < n / 2 and 1 < max(sizes) <= DEFAULT_LIMIT, sizes
    assert [m.finish_reason for m in msgs[:-1]] == [""] * (len(msgs) - 1)
    last = msgs[-1]
    assert (last.finish_reason, last.usage.completion_tokens, last.worker_id) == ("length", n, "fake-wide")
    assert last.ttft_s > 0 and last.route_reason


def test_a_slow_sse_client_gets_fewer_larger_events_that_add_up_to_the_answer(stack: Stack) -> None:
    n = 1000
    chunks = read_sse(stack, "fake-wide", n, wait_s=0.3, per_event_s=0.001, slow_link=True,
                      stream_options={"include_usage": True})
    *text_chunks, usage = chunks
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == answer_text("fake-wide", n)
    assert len(text_chunks) < n / 2, len(text_chunks)
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in text_chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in text_chunks]
    assert finishes == [None] * (len(text_chunks) - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == n


@pytest.mark.parametrize("front", ["grpc", "http"])
def test_a_client_that_keeps_up_gets_the_tokens_as_they_come(stack: Stack, front: str) -> None:
    n = 40
    if front == "grpc":
        per_message = [list(m.token_ids) for m in read_grpc(stack, "fake-slow", n)]
    else:
        per_message = [sse_tokens(c) for c in read_sse(stack, "fake-slow", n)]
    assert [t for tokens in per_message for t in tokens] == list(range(n))
    # The worker is the slow one here: nothing waits to be merged but what a hiccup held up.
    assert len(per_message) > n / 2, per_message


@pytest.mark.parametrize("front", ["grpc", "http"])
def test_32_streams_at_once_all_come_out_whole(stack: Stack, front: str) -> None:
    n = 300
    models = ["fake", "fake-wide"] * 16
    with grpc_channel(stack) as channel, concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        if front == "grpc":
            def one(model: str) -> tuple[list[int], str]:
                msgs = read_grpc(stack, model, n, channel=channel)
                assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == n
                return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)
        else:
            def one(model: str) -> tuple[list[int], str]:
                chunks = read_sse(stack, model, n)
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                return [t for c in chunks for t in sse_tokens(c)], "".join(c["choices"][0]["text"] for c in chunks)

        results = list(pool.map(one, models))
    for model, (tokens, text) in zip(models, results):
        assert tokens == list(range(n)) and text == answer_text(model, n), model


# --- clients that leave -------------------------------------------------------------------------


def leave_mid_stream(stack: Stack, front: str, model: str, read: int, wait_s: float) -> None:
    """Open an endless stream of ``model``, read ``read`` messages, wait ``wait_s``, and leave."""
    if front == "grpc":
        with grpc_channel(stack, slow_link=True) as channel:
            call = pb_grpc.KVCascadeStub(channel).Generate(request(model, 100_000), timeout=60)
            for _ in range(read):
                assert next(call).token_ids
            time.sleep(wait_s)
            call.cancel()
        return
    with http_client(slow_link=True) as client, client.stream(
            "POST", f"{stack.base_url}/v1/completions", json=completion(model, 100_000)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(read):
            assert next(line for line in lines if line.startswith("data: "))
        time.sleep(wait_s)


@pytest.mark.parametrize("front", ["grpc", "http"])
@pytest.mark.parametrize("client", ["reading", "stalled"])
def test_a_client_that_leaves_cancels_the_worker_call(stack: Stack, front: str, client: str) -> None:
    # reading: it leaves between two tokens; stalled: it never read, the relay's buffer is full and
    # it has stopped reading the worker, which waits on flow control.
    model, read, wait_s = ("fake-slow", 3, 0.0) if client == "reading" else ("fake-wide", 0, 0.5)
    before = stack.cancelled(model)
    cancelled = stack.router.metrics.registry.get_sample_value("kvcascade_requests_total",
                                                                {"status": "cancelled"}) or 0.0
    leave_mid_stream(stack, front, model, read, wait_s)
    assert stack.wait_for_cancel(model, before) < 2.0
    assert stack.router.metrics.registry.get_sample_value("kvcascade_requests_total",
                                                          {"status": "cancelled"}) == cancelled + 1
