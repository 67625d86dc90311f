"""Block accounting and isolation: finished, cancelled and failed requests all give blocks back."""

from __future__ import annotations

import asyncio

import pytest

from worker.engine.async_engine import AsyncEngine
from worker.engine.errors import QueueFullError
from worker.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def drain(engine):
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_mixed_finished_cancelled_and_failed_requests_return_every_block(make_engine, prompt_ids, hf_reference):
    engine = make_engine(num_kv_blocks=40)
    total = engine.stats().kv_blocks_total
    ids = [engine.add_request(p, GREEDY) for p in prompt_ids[:6]]
    engine.step()
    engine.step()
    cancelled = engine.abort_request(ids[1])
    assert cancelled.finish_reason == "abort" and cancelled.finished
    assert engine.abort_request("no-such-request") is None

    # One step fails (a fault injected into the model runner): its batch fails, the engine lives.
    original = engine.runner.run
    calls = {"n": 0}

    def flaky(batch, *rest):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return original(batch, *rest)

    engine.runner.run = flaky
    outs = engine.step()
    assert outs and all(o.finish_reason == "error" and "injected fault" in o.error for o in outs)
    engine.check_integrity()
    assert engine.stats().kv_blocks_free == total
    # Later requests are untouched by what happened before.
    later = engine.add_request(prompt_ids[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    finals = drain(engine)
    assert finals[later].finish_reason == "length"
    engine.check_integrity()
    assert engine.stats().kv_blocks_free == total and engine.stats().kv_blocks_used == 0


def test_a_bad_request_does_not_change_another_requests_output(make_engine, prompt_ids, hf_reference):
    engine = make_engine()
    good = engine.add_request(prompt_ids[5], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    engine.step()
    with pytest.raises(Exception):
        engine.add_request([], GREEDY)
    with pytest.raises(Exception):
        engine.add_request(prompt_ids[1], SamplingParams(top_p=7))
    toks = []
    while engine.has_unfinished():
        for out in engine.step():
            toks += out.new_token_ids
    # the first step's token came before the loop
    assert len(toks) == 15 and toks == hf_reference[5][1:]


def test_async_engine_abort_on_close_and_queue_limit(make_engine, prompt_ids):
    engine = make_engine(max_queued_requests=2)
    aeng = AsyncEngine(engine)
    aeng.start()

    async def scenario():
        long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        g1 = aeng.generate("a", prompt_token_ids=prompt_ids[0], params=long)
        g2 = aeng.generate("b", prompt_token_ids=prompt_ids[1], params=long)
        first = await g1.__anext__()
        await g2.__anext__()
        assert first.new_token_ids
        with pytest.raises(QueueFullError):
            await aeng.generate("c", prompt_token_ids=prompt_ids[2], params=long).__anext__()
        await g1.aclose()  # the client leaves: the request is aborted, its blocks freed
        await g2.aclose()
        for _ in range(200):
            s = aeng.stats()
            if s.running == 0 and s.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.02)
        s = aeng.stats()
        assert s.running == 0 and s.waiting == 0 and s.kv_blocks_free == s.kv_blocks_total
        out = [o async for o in aeng.generate("d", prompt_token_ids=prompt_ids[3], params=GREEDY)]
        assert out[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in out) == 8

    try:
        asyncio.run(scenario())
    finally:
        aeng.shutdown()
    engine.check_integrity()


def test_freeze_gc_moves_start_up_objects_out_of_the_collector(make_engine, prompt_ids):
    """EngineConfig.freeze_gc (on for CUDA, where a full collection mid-run stalls the device):
    after start-up the model and pool sit in the permanent generation, and the engine still runs."""
    import gc

    from worker.engine.config import EngineConfig
    from worker.engine.sampling_params import SamplingParams

    assert EngineConfig(device="cpu").freeze_gc is False
    assert EngineConfig(device="cuda").freeze_gc is True
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        engine = make_engine(freeze_gc=True)
        frozen = gc.get_freeze_count()
        assert frozen > 1000, frozen  # the model's modules and parameters, at least
        out = engine.generate([prompt_ids[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out[0]) == 4
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
