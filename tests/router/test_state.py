"""The registry and prefix index contract (contracts/state.py), one suite over both implementations:
in memory and on a real redis-server. Redis-only tests at the end: round trips, key layout,
key prefixes, and Redis going away and coming back."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time

import pytest
import redis

from contracts.memory_state import MemoryPrefixIndex, MemoryRegistry
from contracts.redis_state import RedisPrefixIndex, RedisRegistry
from contracts.state import CacheEvent, StateUnavailable, WorkerInfo, WorkerLoad
from contracts.stores import connect_state

MODEL = "smollm2-135m"


class State:
    """A deployment's registry and index (``url`` None: in memory); ``open`` makes more, under
    other key prefixes, on the same Redis. ``aclose`` is awaited by conftest after the test."""

    def __init__(self, url: str | None):
        self.url = url
        self._opened = []
        self.registry, self.index = self.open()

    def open(self, key_prefix: str = "kvc:"):
        registry, index = connect_state(self.url, key_prefix)
        self._opened.append(registry)
        return registry, index

    async def aclose(self) -> None:
        for registry in self._opened:
            await registry.aclose()


@pytest.fixture(params=["memory", "redis"])
def state(request) -> State:
    return State(None if request.param == "memory" else request.getfixturevalue("redis_url"))


@pytest.fixture
def redis_state(redis_url) -> State:
    return State(redis_url)


def worker(worker_id: str, epoch: str = "e1", model: str = MODEL, **kw) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, epoch=epoch, address=f"10.0.0.1:{5000 + len(worker_id)}", model=model,
                      tp_size=2, capacity=64, block_size=16, **kw)


def hashes(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def stored(*hs: int) -> list[CacheEvent]:
    return [CacheEvent("stored", h) for h in hs]


# ---- registry ----------------------------------------------------------------------------------

async def test_register_round_trips_every_field_and_filters_by_model(state):
    load = WorkerLoad(running=3, waiting=1, kv_blocks_free=100, kv_blocks_total=512, queued_tokens=700,
                      spec_drafted_tokens=90, spec_accepted_tokens=40, spec_verifications=30)
    b_info = worker("b", load=load, model_source="/models/smollm2.gguf")
    await state.registry.register(b_info, ttl_s=5)
    await state.registry.register(worker("a", model="other"), ttl_s=5)
    live = await state.registry.live_workers()
    assert [w.worker_id for w in live] == ["a", "b"]
    b = live[1]
    assert dataclasses.replace(b, last_seen=0) == dataclasses.replace(b_info, last_seen=0)
    assert abs(b.last_seen - time.time()) < 5
    assert [w.worker_id for w in await state.registry.live_workers(MODEL)] == ["b"]
    assert await state.registry.live_workers("nobody-serves-this") == []
    b.load.running = 99  # a copy: changes nothing stored
    assert (await state.registry.live_workers(MODEL))[0].load.running == 3


async def test_worker_without_heartbeat_expires(state):
    await state.registry.register(worker("w"), ttl_s=0.3)
    assert len(await state.registry.live_workers()) == 1
    await asyncio.sleep(0.6)
    assert await state.registry.live_workers() == []
    assert await state.registry.heartbeat("w", "e1", WorkerLoad(), ttl_s=5) is False  # must register again
    assert await state.registry.live_workers() == []


async def test_heartbeat_refreshes_ttl_and_load(state):
    await state.registry.register(worker("w"), ttl_s=0.5)
    first_seen = (await state.registry.live_workers())[0].last_seen
    for running in range(6):  # 0.6 s in all, past the first TTL
        await asyncio.sleep(0.1)
        assert await state.registry.heartbeat("w", "e1", WorkerLoad(running=running), ttl_s=0.5) is True
    (w,) = await state.registry.live_workers()
    assert w.load == WorkerLoad(running=5) and w.last_seen > first_seen
    await asyncio.sleep(0.8)
    assert await state.registry.live_workers() == []


async def test_old_epoch_cannot_clobber_a_new_one(state):
    await state.registry.register(worker("w", epoch="old"), ttl_s=5)
    await state.registry.register(worker("w", epoch="new", load=WorkerLoad(running=1)), ttl_s=5)
    assert await state.registry.heartbeat("w", "old", WorkerLoad(running=42), ttl_s=5) is False
    await state.registry.deregister("w", "old")
    (w,) = await state.registry.live_workers()
    assert (w.epoch, w.load.running) == ("new", 1)
    await state.registry.deregister("w", "new")  # a clean shutdown leaves at once
    assert await state.registry.live_workers() == []
    await state.registry.deregister("never-registered", "e1")  # harmless


# ---- prefix index ------------------------------------------------------------------------------

async def test_stored_evicted_cleared(state):
    idx, hs = state.index, hashes(4)
    await idx.apply("w", "e1", MODEL, stored(*hs))
    assert await idx.match(MODEL, hs, {"w": "e1"}) == {"w": 4}
    assert await idx.indexed_workers() == {"w"}
    await idx.apply("w", "e1", MODEL, [CacheEvent("evicted", hs[2])])
    assert await idx.match(MODEL, hs, {"w": "e1"}) == {"w": 2}
    await idx.apply("w", "e1", MODEL, [CacheEvent("evicted", hashes(1, seed=9)[0])])  # absent: no-op
    await idx.apply("w", "e1", MODEL, [CacheEvent("cleared")])
    assert await idx.match(MODEL, hs, {"w": "e1"}) == {"w": 0}
    assert await idx.indexed_workers() == set()


async def test_events_apply_in_order(state):
    a, b = hashes(2)
    await state.index.apply("w", "e1", MODEL, [*stored(a), CacheEvent("cleared"), *stored(b),
                                               CacheEvent("evicted", b), *stored(b)])
    assert await state.index.match(MODEL, [a], {"w": "e1"}) == {"w": 0}
    assert await state.index.match(MODEL, [b], {"w": "e1"}) == {"w": 1}


async def test_bad_batch_is_rejected_whole(state):
    a, b = hashes(2)
    for bad in (CacheEvent("forgotten", b), CacheEvent("stored", None), CacheEvent("stored", 2**64),
                CacheEvent("evicted", -1)):
        with pytest.raises(ValueError):
            await state.index.apply("w", "e1", MODEL, [*stored(a), bad])
    assert await state.index.match(MODEL, [a], {"w": "e1"}) == {"w": 0}
    assert await state.index.indexed_workers() == set()


async def test_match_counts_leading_blocks_only(state):
    idx, hs = state.index, hashes(4)
    await idx.apply("gap", "e1", MODEL, stored(hs[0], hs[1], hs[3]))
    await idx.apply("all", "e2", MODEL, stored(*hs))
    await idx.apply("tail", "e3", MODEL, stored(*hs[1:]))
    workers = {"tail": "e3", "gap": "e1", "none": "e9", "all": "e2"}
    result = await idx.match(MODEL, hs, workers)
    assert result == {"tail": 0, "gap": 2, "none": 0, "all": 4}
    assert list(result) == list(workers)  # every asked worker, in the order asked
    assert await idx.match(MODEL, hs[:1], workers) == {"tail": 0, "gap": 1, "none": 0, "all": 1}
    assert await idx.match(MODEL, [], workers) == dict.fromkeys(workers, 0)
    assert await idx.match(MODEL, hs, {}) == {}
    assert await idx.match("other-model", hs, workers) == dict.fromkeys(workers, 0)


async def test_entries_of_another_epoch_never_match(state):
    idx, hs = state.index, hashes(3)
    await idx.apply("w", "old", MODEL, stored(*hs))
    assert await idx.match(MODEL, hs, {"w": "new"}) == {"w": 0}
    await idx.apply("w", "new", MODEL, [CacheEvent("evicted", hs[0])])  # not the entry's epoch: kept
    assert await idx.match(MODEL, hs, {"w": "old"}) == {"w": 3}
    await idx.apply("w", "new", MODEL, stored(hs[0]))  # re-stored by the new epoch
    assert await idx.match(MODEL, hs, {"w": "new"}) == {"w": 1}
    assert await idx.match(MODEL, hs, {"w": "old"}) == {"w": 0}
    await idx.apply("w", "old", MODEL, [CacheEvent("evicted", hs[0])])  # a late event of the old epoch
    assert await idx.match(MODEL, hs, {"w": "new"}) == {"w": 1}


async def test_hashes_keep_all_64_bits(state):
    # Neighbours near 2**64 are the same number as a double: a hash passed as a Lua number would match both.
    top = 2**64 - 1
    await state.index.apply("w", "e1", MODEL, stored(top, 0, 2**63))
    assert await state.index.match(MODEL, [top, 0, 2**63], {"w": "e1"}) == {"w": 3}
    assert await state.index.match(MODEL, [top - 1], {"w": "e1"}) == {"w": 0}
    assert await state.index.match(MODEL, [top, 0, 2**63 + 1], {"w": "e1"}) == {"w": 2}


async def test_drop_worker_removes_only_that_worker(state):
    idx, hs = state.index, hashes(3)
    await idx.apply("dead", "e1", MODEL, stored(*hs))
    await idx.apply("dead", "e2", "other-model", stored(*hs))
    await idx.apply("alive", "e1", MODEL, stored(*hs))
    assert await idx.indexed_workers() == {"dead", "alive"}
    await idx.drop_worker("dead")
    assert await idx.match(MODEL, hs, {"dead": "e1", "alive": "e1"}) == {"dead": 0, "alive": 3}
    assert await idx.match("other-model", hs, {"dead": "e2"}) == {"dead": 0}
    assert await idx.indexed_workers() == {"alive"}
    await idx.drop_worker("never-seen")


async def test_throughput_sanity(state):
    """Not a timed assertion: prints rates (pytest -s) and checks the answers stay right at size."""
    prompts = [hashes(64, seed) for seed in range(8)]
    t0 = time.perf_counter()
    for w in range(4):
        for p in prompts[w % 2::2]:  # even workers hold the even prompts
            for i in range(0, 64, 16):
                await state.index.apply(f"w{w}", "e1", MODEL, stored(*p[i:i + 16]))
    t1 = time.perf_counter()
    workers = {f"w{w}": "e1" for w in range(4)}
    for _ in range(25):
        for p in prompts:
            await state.index.match(MODEL, p, workers)
    t2 = time.perf_counter()
    print(f"\n{type(state.index).__name__}: apply {4 * 4 * 4 / (t1 - t0):.0f} batches/s, "
          f"match {25 * len(prompts) / (t2 - t1):.0f}/s (64 blocks, 4 workers)")
    assert await state.index.match(MODEL, prompts[0], workers) == {"w0": 64, "w1": 0, "w2": 64, "w3": 0}


def test_connect_state_picks_the_implementation(redis_url):
    assert tuple(map(type, connect_state(None))) == (MemoryRegistry, MemoryPrefixIndex)
    assert tuple(map(type, connect_state(redis_url))) == (RedisRegistry, RedisPrefixIndex)


# ---- Redis only --------------------------------------------------------------------------------

def command_calls(probe: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stats["calls"] for name, stats in probe.info("commandstats").items()}


async def test_match_is_one_round_trip(redis_state, monkeypatch):
    idx, hs = redis_state.index, hashes(32)
    await idx.apply("w1", "e1", MODEL, stored(*hs))
    await idx.apply("w2", "e1", MODEL, stored(*hs[:8]))
    workers = {"w1": "e1", "w2": "e1", "w3": "e1"}
    await idx.match(MODEL, hs, workers)  # the connection is made and the script loaded

    sends = 0
    real_send = redis.asyncio.connection.AbstractConnection.send_packed_command

    async def counting_send(self, *args, **kwargs):
        nonlocal sends
        sends += 1
        return await real_send(self, *args, **kwargs)

    monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", counting_send)
    with redis.Redis.from_url(redis_state.url) as probe:  # one connection: its handshake comes before
        before = command_calls(probe)
        assert await idx.match(MODEL, hs, workers) == {"w1": 32, "w2": 8, "w3": 0}
        after = command_calls(probe)
    assert sends == 1
    delta = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert delta.pop("evalsha") == 1 and "eval" not in delta
    # What is left ran inside the script: one HMGET per block while a worker still matched.
    assert delta.pop("info") == 1 and delta == {"hmget": 32}


async def test_key_layout(redis_state):
    r = redis.Redis.from_url(redis_state.url, decode_responses=True)
    await redis_state.registry.register(worker("w"), ttl_s=0.3)
    await redis_state.index.apply("w", "e1", MODEL, stored(7, 2**64 - 1))
    assert set(r.keys("*")) == {"kvc:worker:w", "kvc:workers", f"kvc:idx:{MODEL}:7",
                                f"kvc:idx:{MODEL}:{2**64 - 1}", "kvc:held:w", "kvc:indexed"}
    assert r.hget(f"kvc:idx:{MODEL}:7", "w") == "e1"
    assert 0 < r.pttl("kvc:worker:w") <= 300
    await asyncio.sleep(0.5)
    assert await redis_state.registry.live_workers() == []
    assert not r.exists("kvc:workers")  # the expired id left the set too
    r.close()


async def test_key_prefixes_separate_deployments(redis_state):
    hs = hashes(3)
    a_registry, a_index = redis_state.open("a:")
    b_registry, b_index = redis_state.open("b:")
    await a_registry.register(worker("w"), ttl_s=5)
    await a_index.apply("w", "e1", MODEL, stored(*hs))
    assert await b_registry.live_workers() == [] and await b_index.indexed_workers() == set()
    assert await b_index.match(MODEL, hs, {"w": "e1"}) == {"w": 0}
    await b_index.drop_worker("w")
    await b_registry.deregister("w", "e1")
    assert await a_index.match(MODEL, hs, {"w": "e1"}) == {"w": 3}
    assert [w.worker_id for w in await a_registry.live_workers()] == ["w"]


async def assert_unavailable_fast(state: State, n_calls: int = 4) -> None:
    calls = [lambda: state.index.match(MODEL, hashes(4), {"w": "e1"}),
             lambda: state.registry.register(worker("w"), ttl_s=5), lambda: state.registry.live_workers(),
             lambda: state.index.apply("w", "e1", MODEL, stored(1))]
    for call in calls[:n_calls]:
        t0 = time.monotonic()
        with pytest.raises(StateUnavailable) as err:
            await call()
        # the cause kept: redis-py's error, or the store's deadline (a stalled Redis)
        assert isinstance(err.value, ConnectionError)
        assert isinstance(err.value.__cause__, (redis.RedisError, TimeoutError)), err.value.__cause__
        assert time.monotonic() - t0 < 2


async def test_redis_stopped_then_restarted(restartable_redis):
    state = State(restartable_redis.url)
    try:
        await state.registry.register(worker("w"), ttl_s=5)
        await state.index.apply("w", "e1", MODEL, stored(1, 2))
        restartable_redis.stop()
        await assert_unavailable_fast(state)
        restartable_redis.start()  # same port, empty (no persistence), scripts unknown
        await state.registry.register(worker("w"), ttl_s=5)
        await state.index.apply("w", "e1", MODEL, stored(1, 2))
        assert await state.index.match(MODEL, [1, 2], {"w": "e1"}) == {"w": 2}
        assert [w.worker_id for w in await state.registry.live_workers()] == ["w"]
    finally:
        await state.aclose()


async def test_stalled_redis_times_out(restartable_redis):
    state = State(restartable_redis.url)
    try:
        await state.index.apply("w", "e1", MODEL, stored(1))
        os.kill(restartable_redis.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            await assert_unavailable_fast(state, n_calls=2)  # each waits out the 1 s timeout
        finally:
            os.kill(restartable_redis.proc.pid, signal.SIGCONT)
        assert await state.index.match(MODEL, [1], {"w": "e1"}) == {"w": 1}
    finally:
        await state.aclose()


async def test_a_cancelled_call_is_cancelled(redis_state):
    """Cancelling a task inside any store call ends the task, wherever the cancel lands. With
    redis-py's socket_timeout, Python 3.11's asyncio.wait_for lost 2 of 3 such cancels (the send
    had completed), and a worker's publisher.stop() once waited forever in CI."""
    info = worker("w")
    await redis_state.registry.register(info, ttl_s=5)
    calls = [lambda: redis_state.index.apply("w", "e1", MODEL, stored(*hashes(4))),
             lambda: redis_state.registry.heartbeat("w", info.epoch, info.load, 5),
             lambda: redis_state.index.match(MODEL, hashes(4), {"w": "e1"}),
             lambda: redis_state.registry.register(info, ttl_s=5),
             lambda: redis_state.registry.live_workers(),
             lambda: redis_state.index.indexed_workers()]

    async def forever():
        while True:
            for call in calls:
                await call()

    rng = random.Random(0)
    lost = 0
    for _ in range(200):
        task = asyncio.create_task(forever())
        await asyncio.sleep(rng.random() * 0.003)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        if not done:  # the cancel was swallowed and the loop runs on
            lost += 1
            while not task.done():
                task.cancel()
                await asyncio.sleep(0.01)
        assert task.done()
    assert lost == 0, f"{lost} of 200 cancels lost"
    assert await redis_state.index.match(MODEL, hashes(4), {"w": "e1"}) == {"w": 4}  # the client still works
