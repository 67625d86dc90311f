"""The engine core in its own process behind EngineCoreClient: the same tokens as the in-process
engine (and so as transformers), stop strings and text done by the front end, cancellation that
frees blocks in the core, overload refused at the door, and a core that dies ending every stream."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deploy.local import WorkerProcess
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from tests.conftest import MAX_NEW, PROMPTS
from worker.engine.config import EngineConfig
from worker.core.client import EngineCoreClient
from worker.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from worker.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def core(smollm2):
    # quantization none: the GGUF dequantized, as transformers and the in-process reference read it
    client = EngineCoreClient(EngineConfig(model="smollm2-135m", quantization="none", max_queued_requests=40),
                              tokenizer=smollm2.tokenizer)
    client.start(timeout_s=300)
    yield client
    client.shutdown()
    assert client.proc.returncode == 0  # a clean exit when told to


async def _collect(client, **kwargs):
    outs = [out async for out in client.generate(**kwargs)]
    return outs


def _wait_idle(client, within_s: float = 20.0):
    deadline = time.monotonic() + within_s
    while True:
        s = client.stats()
        if s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def test_concurrent_requests_match_transformers_token_for_token(core, prompt_ids, hf_reference):
    async def run():
        return await asyncio.gather(*(_collect(core, prompt_token_ids=p, params=GREEDY) for p in prompt_ids))

    results = asyncio.run(run())
    for outs, ref in zip(results, hf_reference):
        assert [t for o in outs for t in o.new_token_ids] == ref
        last = outs[-1]
        assert last.finished and last.finish_reason == "length"
        assert last.usage.completion_tokens == MAX_NEW and last.ttft_s > 0
    _wait_idle(core)


def test_text_and_stop_strings_equal_the_in_process_engine(core, make_engine, smollm2):
    """Detokenization moved out of the step loop must not change a character of what clients get."""
    engine = make_engine()
    cases = [
        dict(messages=[{"role": "user", "content": PROMPTS[0]}], params=SamplingParams(max_tokens=24, temperature=0)),
        dict(prompt="1, 2, 3, 4, 5,", params=SamplingParams(max_tokens=40, temperature=0, stop=[" 9", "11"])),
        dict(prompt="def fibonacci(n):", params=SamplingParams(max_tokens=30, temperature=0, stop=["return"],
                                                                  logprobs=2)),
        dict(prompt="Once upon a time", params=SamplingParams(max_tokens=20, temperature=0.8, seed=7)),
    ]
    for case in cases:
        ids = engine.tokenize(prompt=case.get("prompt"), messages=case.get("messages"))
        rid = engine.add_request(ids, case["params"])
        want_text, want_ids, want_lps, final = "", [], [], None
        while engine.has_unfinished():
            for out in engine.step():
                want_text += out.text_delta
                want_ids += out.new_token_ids
                want_lps += out.logprobs or []
                final = out if out.finished else final
        outs = asyncio.run(_collect(core, request_id=rid, **case))
        assert "".join(o.text_delta for o in outs) == want_text
        assert [t for o in outs for t in o.new_token_ids] == want_ids
        assert outs[-1].finish_reason == final.finish_reason
        assert outs[-1].usage.completion_tokens == final.usage.completion_tokens
        if case["params"].logprobs is not None:
            got = [lp for o in outs for lp in o.logprobs]
            assert len(got) == len(want_lps) > 0
            assert [lp.token_id for lp in got] == [w.token_id for w in want_lps]
            assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in w.top] for w in want_lps]
            assert all(abs(lp.logprob - w.logprob) < 1e-5 for lp, w in zip(got, want_lps))
    assert "9" not in asyncio.run(_collect(core, **cases[1]))[-1].text_delta
    _wait_idle(core)  # requests a stop string ended were aborted in the core: their blocks are free


def test_leaving_a_stream_frees_its_blocks_in_the_core(core):
    async def run():
        long = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
        streams = [core.generate(prompt_token_ids=[i + 1] * 40, params=long) for i in range(6)]
        for s in streams:
            await anext(s)  # every request is running and holds blocks
        assert core.stats().kv_blocks_used > 0 or core.stats().running > 0
        for s in streams:
            await s.aclose()

    asyncio.run(run())
    stats = _wait_idle(core)
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_bad_input_and_overload_are_refused_at_the_door(core):
    async def run():
        with pytest.raises(InvalidRequestError, match="temperature"):
            await anext(core.generate(prompt="hi", params=SamplingParams(temperature=-1)))
        with pytest.raises(InvalidRequestError, match="token ids"):
            await anext(core.generate(prompt_token_ids=[10**7], params=GREEDY))
        long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        streams = [core.generate(prompt_token_ids=[5, 6, 7], params=long) for _ in range(40)]
        await asyncio.gather(*(anext(s) for s in streams))
        with pytest.raises(QueueFullError):
            await anext(core.generate(prompt_token_ids=[5, 6, 7], params=long))
        for s in streams:
            await s.aclose()
        # Afterwards a request runs as if nothing happened.
        outs = await _collect(core, prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=4, temperature=0))
        assert outs[-1].finished and outs[-1].usage.completion_tokens == 4

    asyncio.run(run())
    _wait_idle(core)


def test_a_core_that_fails_to_start_says_why():
    client = EngineCoreClient(EngineConfig(model="dummy:tiny", kv_cache_bytes=16))
    with pytest.raises(RuntimeError, match="ValueError: kv_cache_bytes=16 holds no KV block"):
        client.start(timeout_s=300)
    assert client.proc.poll() is not None


@pytest.mark.slow
def test_a_dead_core_ends_every_stream_with_unavailable_and_the_worker_exits():
    worker = WorkerProcess("core-death", None, "--model", "dummy:tiny").start()
    try:
        core_pid = _child(worker.proc.pid, "worker.core.process")

        def long(i):
            req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=900, temperature=0, ignore_eos=True))
            req.token_ids.ids[:] = [i + 1] * 8
            with grpc.insecure_channel(worker.address) as ch:
                try:
                    return sum(len(m.token_ids) for m in pb_grpc.KVCascadeStub(ch).Generate(req, timeout=60))
                except grpc.RpcError as err:
                    return err.code()

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(long, i) for i in range(8)]
            time.sleep(1.0)
            os.kill(core_pid, signal.SIGKILL)
            results = [f.result(timeout=30) for f in futures]  # none hangs
        assert all(r == grpc.StatusCode.UNAVAILABLE for r in results), results
        assert worker.proc.wait(15) == 70  # the watchdog's: its supervisor restarts it
    finally:
        worker.kill()


def test_a_dead_core_fails_requests_in_process_too():
    client = EngineCoreClient(EngineConfig(model="dummy:tiny"))
    client.start(timeout_s=300)
    try:
        async def run():
            stream = client.generate(prompt_token_ids=[1, 2, 3],
                                     params=SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
            await anext(stream)
            client.proc.kill()
            with pytest.raises(EngineDeadError, match="exited"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await anext(client.generate(prompt_token_ids=[1], params=GREEDY))

        asyncio.run(run())
        assert not client.is_healthy()
    finally:
        client.shutdown()


def _child(pid: int, module: str) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid and module in open(f"/proc/{entry}/cmdline", "rb").read().decode().split("\0"):
                return int(entry)
        except (OSError, ValueError):
            continue
    raise AssertionError(f"no child of {pid} runs {module}")
