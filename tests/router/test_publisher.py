"""A worker's publisher keeps the prefix index exact: stored and evicted blocks, restarts, resync."""

from __future__ import annotations

import asyncio
import random

import pytest

from protos.block_hash import block_hashes
from contracts.stores import connect_state
from worker.engine.async_engine import AsyncEngine
from worker.engine.sampling_params import SamplingParams
from worker.registration import WorkerPublisher

GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


async def run_one(engine: AsyncEngine, ids: list[int]) -> None:
    async for _ in engine.generate(prompt_token_ids=ids, params=GREEDY):
        pass


async def held_blocks(index, model, ids, workers) -> dict[str, int]:
    return await index.match(model, block_hashes(ids, 16, model), workers)


@pytest.fixture(params=["memory", "redis"])
def state_url(request):
    """None: in-memory state; else a real redis-server on loopback (flushed)."""
    return None if request.param == "memory" else request.getfixturevalue("redis_url")


@pytest.fixture
def small_engine(make_engine):
    # 12 blocks of 16 tokens: three 64-token prompts fill it, a fourth evicts the oldest.
    engine = AsyncEngine(make_engine(num_kv_blocks=12))
    engine.start()
    yield engine
    engine.shutdown()


def test_stored_and_evicted_blocks_reach_the_index(small_engine, state_url):
    async def scenario():
        registry, index = connect_state(state_url, "kvc-pub:")
        pub = WorkerPublisher(small_engine, registry, index, worker_id="w", address="127.0.0.1:1",
                              model_source="smollm2-135m", heartbeat_s=0.1, event_interval_s=0.01)
        await pub.start()
        model = small_engine.model_id
        live = {"w": pub.info.epoch}
        prompts = [[1000 + 100 * k + i for i in range(64)] for k in range(4)]
        await run_one(small_engine, prompts[0])
        await asyncio.sleep(0.1)
        assert (await held_blocks(index, model, prompts[0], live))["w"] == 4
        for p in prompts[1:]:
            await run_one(small_engine, p)
        await asyncio.sleep(0.1)
        # The pool (12 blocks) cannot hold four prompts of 4-5 blocks: the oldest went first, tail
        # first, and the index knows exactly which blocks are left.
        counts = [(await held_blocks(index, model, p, live))["w"] for p in prompts]
        assert counts[-1] == 4 and counts[0] < 4, counts
        engine = small_engine.engine
        for p, n in zip(prompts, counts):
            assert len(engine.block_manager.find_cached_prefix(_seq(p))[0]) == min(n, 3) or n == 4
        # A stale epoch never matches; a restart drops the old entries and publishes a snapshot.
        assert (await held_blocks(index, model, prompts[-1], {"w": "old-epoch"}))["w"] == 0
        await pub.stop()
        assert (await registry.live_workers()) == []
        assert await index.indexed_workers() == set()
        await registry.aclose()

    asyncio.run(scenario())


def test_stop_returns_wherever_it_lands(small_engine, redis_url):
    """stop() ends the publisher promptly whatever the publisher is doing: 100 publishers stopped
    at random points of their loop (mid-call to Redis, most often). In CI, one stop() waited
    forever: the cancel had been swallowed inside a Redis call (contracts/redis_state.py)."""
    async def scenario():
        registry, index = connect_state(redis_url, "kvc-pub:")
        rng = random.Random(0)
        for i in range(100):
            pub = WorkerPublisher(small_engine, registry, index, worker_id=f"w{i}", address="127.0.0.1:1",
                                  model_source="smollm2-135m", heartbeat_s=0.002, event_interval_s=0.001)
            await pub.start()
            await asyncio.sleep(rng.random() * 0.02)
            stopping = asyncio.create_task(pub.stop())
            done, _ = await asyncio.wait({stopping}, timeout=2)
            assert done and pub._task.done(), f"publisher {i}: stop() still waiting after 2 s"
        assert (await registry.live_workers()) == [] and await index.indexed_workers() == set()
        await registry.aclose()

    asyncio.run(scenario())


def test_a_new_publisher_resyncs_what_the_engine_already_caches(small_engine, state_url):
    # Its Redis variant was left out after it hung once in CI: the cancel that Redis calls swallowed
    # (test_stop_returns_wherever_it_lands), fixed in contracts/redis_state.py.
    async def scenario():
        ids = [7] * 40
        await run_one(small_engine, ids)
        registry, index = connect_state(state_url, "kvc-pub:")
        pub = WorkerPublisher(small_engine, registry, index, worker_id="w", address="127.0.0.1:1",
                              model_source="smollm2-135m", heartbeat_s=0.1, event_interval_s=0.01)
        await pub.start()
        await asyncio.sleep(0.1)
        assert (await held_blocks(index, small_engine.model_id, ids, {"w": pub.info.epoch}))["w"] == 2
        [info] = await registry.live_workers()
        assert info.load.kv_blocks_total == 12 and info.model_source == "smollm2-135m"
        await pub.stop()
        await registry.aclose()

    asyncio.run(scenario())


def _seq(ids):
    from worker.engine.sequence import Sequence

    return Sequence("probe", list(ids) + [0], GREEDY)
