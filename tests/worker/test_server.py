"""The worker gRPC server end to end: a real engine, a real grpc.aio server, a real client over loopback.

The server and engine live on an event loop in a background thread; the tests use the blocking
grpc client, as an outside caller would.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from worker.engine.async_engine import AsyncEngine
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.server import SERVICE_NAME, InProcessStub, WorkerServer, serve

T = TypeVar("T")
PROMPT = "The capital of France is"
# Long enough that a request which is not aborted would still be running when the test looks.
LONG = pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


class _LoopThread:
    """An asyncio loop in a daemon thread, so blocking tests can drive async code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="server-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@dataclass
class Served:
    loop: _LoopThread
    engine: AsyncEngine
    server: WorkerServer
    channel: grpc.Channel
    stub: pb_grpc.KVCascadeStub

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=10)


def _serve(config: EngineConfig, reuse: LLMEngine) -> Iterator[Served]:
    """Serve a new engine of ``config`` built on ``reuse``'s loaded model and tokenizer (loading takes seconds)."""
    loop = _LoopThread()

    async def start() -> tuple[AsyncEngine, WorkerServer]:
        engine = AsyncEngine(LLMEngine(config, tokenizer=reuse.tokenizer, model=reuse.model))
        engine.start()
        return engine, await serve(engine, "127.0.0.1", 0)

    engine, server = loop.run(start())
    channel = grpc.insecure_channel(server.address)
    try:
        yield Served(loop, engine, server, channel, pb_grpc.KVCascadeStub(channel))
    finally:
        channel.close()
        loop.run(server.stop(0))
        engine.shutdown()
        loop.close()


# smollm2 (tests/conftest.py): the session's loaded SmolLM2, shared with the engine tests.
@pytest.fixture(scope="module")
def served(smollm2: LLMEngine) -> Iterator[Served]:
    yield from _serve(EngineConfig(model="smollm2-135m"), reuse=smollm2)


@pytest.fixture(scope="module")
def served_small_queue(smollm2: LLMEngine) -> Iterator[Served]:
    config = EngineConfig(model="smollm2-135m", max_num_seqs=1, max_queued_requests=1, num_kv_blocks=64)
    yield from _serve(config, reuse=smollm2)


def _generate(served: Served, **fields: Any) -> list[pb.GenerateResponse]:
    return list(served.stub.Generate(pb.GenerateRequest(**fields), timeout=120))


def _wait_until_idle(served: Served, within_s: float) -> pb.StatsResponse:
    """Poll Stats until no request runs and every KV block is free again (cached blocks count as free)."""
    deadline = time.monotonic() + within_s
    while True:
        stats = served.stats()
        idle = stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0
        if idle and stats.kv_blocks_free == stats.kv_blocks_total:
            return stats
        assert time.monotonic() < deadline, f"engine still busy after {within_s}s: {stats}"
        time.sleep(0.05)


# --- the happy path ---------------------------------------------------------------------------


def test_generate_streams_tokens_text_and_usage(served: Served) -> None:
    sampling = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    responses = _generate(served, request_id="req-1", text=PROMPT, sampling=sampling)

    *updates, last = responses
    assert all(not r.finish_reason for r in updates), "only the last message carries a finish reason"
    assert last.finish_reason == "length"
    assert all(r.request_id == "req-1" for r in responses)
    token_ids = [t for r in responses for t in r.token_ids]
    assert len(token_ids) == 6
    assert last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens == len(served.engine.tokenizer.encode(PROMPT))
    assert 0 <= last.usage.cached_tokens < last.usage.prompt_tokens
    assert last.ttft_s > 0
    text = "".join(r.text for r in responses)
    assert text and text == served.engine.tokenizer.decode(token_ids, skip_special_tokens=True)


def test_request_id_is_made_when_empty(served: Served) -> None:
    responses = _generate(served, text=PROMPT, sampling=pb.SamplingParams(max_tokens=1))
    assert responses[-1].request_id


def test_greedy_over_grpc_equals_the_engine_directly(served: Served) -> None:
    prompt = "Once upon a time, in a small village,"
    responses = _generate(served, text=prompt, sampling=pb.SamplingParams(max_tokens=8, temperature=0.0))
    over_grpc = [t for r in responses for t in r.token_ids]

    async def direct() -> list[int]:
        params = SamplingParams(max_tokens=8, temperature=0.0)
        outputs = served.engine.generate("direct", prompt=prompt, params=params)
        return [t async for out in outputs for t in out.new_token_ids]

    assert over_grpc == served.loop.run(direct())


def test_token_ids_and_chat_prompts(served: Served) -> None:
    ids = served.engine.tokenizer.encode(PROMPT)
    by_ids = _generate(served, token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=4, temperature=0))
    by_text = _generate(served, text=PROMPT, sampling=pb.SamplingParams(max_tokens=4, temperature=0))
    assert [t for r in by_ids for t in r.token_ids] == [t for r in by_text for t in r.token_ids]

    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Say hello.")])
    last = _generate(served, messages=chat, sampling=pb.SamplingParams(max_tokens=4, temperature=0))[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.usage.prompt_tokens > len(served.engine.tokenizer.encode("Say hello."))  # the template


def test_logprobs_with_top_alternatives(served: Served) -> None:
    sampling = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    responses = _generate(served, text=PROMPT, sampling=sampling)
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert len(logprobs) == sum(len(r.token_ids) for r in responses) == 4
    for r in responses:
        assert [lp.token_id for lp in r.logprobs] == list(r.token_ids)
    for lp in logprobs:
        assert lp.logprob <= 0
        assert len(lp.top) == 3
        top = [t.logprob for t in lp.top]
        assert top == sorted(top, reverse=True)
        assert lp.top[0].token_id == lp.token_id  # greedy picks the most likely token
        assert lp.top[0].logprob == pytest.approx(lp.logprob, abs=1e-4)


def test_logprobs_zero_gives_the_chosen_token_only(served: Served) -> None:
    sampling = pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=0)
    logprobs = [lp for r in _generate(served, text=PROMPT, sampling=sampling) for lp in r.logprobs]
    assert len(logprobs) == 2 and all(not lp.top for lp in logprobs)


def test_stats(served: Served) -> None:
    stats = _wait_until_idle(served, within_s=10)
    assert stats.model == served.engine.model_id
    assert stats.block_size == 16
    assert stats.kv_blocks_total > 0
    assert stats.prefix_hits <= stats.prefix_queries
    assert 0.0 <= stats.prefix_hit_rate <= 1.0


# --- errors -----------------------------------------------------------------------------------


def _long_prompt(served: Served) -> dict[str, Any]:
    token = served.engine.tokenizer.encode("hello")[0]
    return {"token_ids": pb.TokenIds(ids=[token] * (served.engine.max_model_len + 1))}


BAD_REQUESTS = {
    "empty prompt": ({"text": ""}, "prompt"),
    "no prompt": ({}, "prompt"),
    "max_tokens -1": ({"text": PROMPT, "sampling": pb.SamplingParams(max_tokens=-1)}, "sampling.max_tokens"),
    "max_tokens past the context": ({"text": PROMPT, "sampling": pb.SamplingParams(max_tokens=10**6)},
                                    "sampling.max_tokens"),
    "temperature -1": ({"text": PROMPT, "sampling": pb.SamplingParams(temperature=-1)}, "sampling.temperature"),
    "top_p 0": ({"text": PROMPT, "sampling": pb.SamplingParams(top_p=0)}, "sampling.top_p"),
    "top_p 1.5": ({"text": PROMPT, "sampling": pb.SamplingParams(top_p=1.5)}, "sampling.top_p"),
    "top_k -1": ({"text": PROMPT, "sampling": pb.SamplingParams(top_k=-1)}, "sampling.top_k"),
    "logprobs 99": ({"text": PROMPT, "sampling": pb.SamplingParams(logprobs=99)}, "sampling.logprobs"),
    "unknown model": ({"text": PROMPT, "model": "no-such-model"}, "model"),
    "prompt too long": (_long_prompt, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
def test_bad_field_is_invalid_argument_naming_it(served: Served, case: tuple[Any, str]) -> None:
    fields, path = case
    if callable(fields):
        fields = fields(served)
    with pytest.raises(grpc.RpcError) as err:
        _generate(served, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{path}: "), err.value.details()


def test_bytes_that_are_no_request_are_invalid_argument_and_the_server_goes_on(served: Served) -> None:
    """A message that does not decode is the client's fault (grpc.aio alone would say UNKNOWN); a
    prompt past gRPC's default 4 MiB is taken (the router passes on what its fronts take)."""
    for method, request_class in (("Generate", pb.GenerateRequest), ("Stats", pb.StatsRequest)):
        call = (served.channel.unary_stream if method == "Generate" else served.channel.unary_unary)(
            f"/{SERVICE_NAME}/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            out = call(b"\xff" * 20, timeout=30)
            list(out) if method == "Generate" else out
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert err.value.details().startswith(f"the request is not a valid {request_class.DESCRIPTOR.name}")
    big = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2))
    big.token_ids.ids[:] = [100] * 1_400_000  # 4.2 MB as a message; longer than the context
    with pytest.raises(grpc.RpcError) as err:
        list(served.stub.Generate(big, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert _generate(served, text=PROMPT, sampling=pb.SamplingParams(max_tokens=2))[-1].finish_reason


def test_full_queue_is_resource_exhausted(served_small_queue: Served) -> None:
    request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    # The blocking client starts each call at once, so all four reach the server together.
    calls = [served_small_queue.stub.Generate(request, timeout=120) for _ in range(4)]
    codes = []
    for call in calls:
        try:
            list(call)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.append(err.code())
    assert grpc.StatusCode.OK in codes
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    _wait_until_idle(served_small_queue, within_s=10)


# --- cancellation frees the KV cache at once --------------------------------------------------


def test_client_cancel_aborts_and_frees_blocks(served: Served) -> None:
    call = served.stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=LONG), timeout=120)
    next(call)  # the request is running and holds blocks
    assert served.stats().kv_blocks_used > 0
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    _wait_until_idle(served, within_s=3)


def test_deadline_aborts_and_frees_blocks(served: Served) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _ = list(served.stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=LONG), timeout=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_until_idle(served, within_s=3)


# --- the in-process stub (serve's router to its embedded workers) -------------------------------


def _in_process(served: Served, request: pb.GenerateRequest, timeout: float | None = 120,
                stop_after: int | None = None) -> list[pb.GenerateResponse]:
    """A Generate through InProcessStub on the server's loop, read as the router reads a call."""

    async def read() -> list[pb.GenerateResponse]:
        call = InProcessStub(served.server.servicer).Generate(request, timeout=timeout)
        out = []
        try:
            async for msg in call:
                out.append(msg)
                if stop_after is not None and len(out) == stop_after:
                    break
        finally:
            call.cancel()
        return out

    return served.loop.run(read())


def test_in_process_calls_answer_as_grpc_does(served: Served) -> None:
    request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    local, remote = _in_process(served, request), _generate(served, text=PROMPT, sampling=request.sampling)
    assert [t for m in local for t in m.token_ids] == [t for m in remote for t in m.token_ids]
    assert "".join(m.text for m in local) == "".join(m.text for m in remote)
    assert local[-1].finish_reason == "length" and local[-1].usage.completion_tokens == 8


@pytest.mark.parametrize("case", [BAD_REQUESTS[k] for k in ("no prompt", "top_p 0", "unknown model")],
                         ids=["no prompt", "top_p 0", "unknown model"])
def test_in_process_bad_field_is_invalid_argument_naming_it(served: Served, case: tuple[Any, str]) -> None:
    fields, path = case
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _in_process(served, pb.GenerateRequest(**fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{path}: "), err.value.details()


def test_in_process_cancel_and_deadline_free_blocks(served: Served) -> None:
    request = pb.GenerateRequest(text=PROMPT, sampling=LONG)
    assert len(_in_process(served, request, stop_after=2)) == 2  # then the reader leaves and cancels
    _wait_until_idle(served, within_s=3)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _in_process(served, request, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_until_idle(served, within_s=3)


def test_16_in_process_streams_at_once(served: Served) -> None:
    sampling = pb.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> list[int]:
        call = InProcessStub(served.server.servicer).Generate(
            pb.GenerateRequest(text=f"{PROMPT} {i}", sampling=sampling), timeout=120)
        return [t for m in [m async for m in call] for t in m.token_ids]

    async def all_at_once() -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = served.loop.run(all_at_once())
    assert all(len(tokens) == 12 for tokens in results)
    for i in (0, 7):  # the same as each alone over gRPC
        alone = _generate(served, text=f"{PROMPT} {i}", sampling=sampling)
        assert results[i] == [t for m in alone for t in m.token_ids]
    _wait_until_idle(served, within_s=3)


# --- health and reflection --------------------------------------------------------------------


def test_health_says_serving(served: Served) -> None:
    health = health_pb2_grpc.HealthStub(served.channel)
    for service in ("", SERVICE_NAME):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(served: Served) -> None:
    services = ProtoReflectionDescriptorDatabase(served.channel).get_services()
    assert SERVICE_NAME in services
    assert "grpc.health.v1.Health" in services
