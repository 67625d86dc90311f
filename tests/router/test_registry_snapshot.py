"""The router's snapshot of the registry (router/router.py): requests share recent reads, none waits
on Redis while the last read is under ``registry_stale_s`` old, a model the snapshot lacks is read
at once, and a worker marked down stays out across snapshots until it heartbeats again. On a real
redis-server; the registry counts its reads."""

from __future__ import annotations

import asyncio
import time

import pytest

from contracts.redis_state import RedisPrefixIndex, RedisRegistry, redis_client
from contracts.state import WorkerInfo, WorkerLoad
from router.router import Router, RouterConfig

TTL_S = 60.0


class CountingRegistry(RedisRegistry):
    """The Redis registry, counting ``live_workers`` reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads = 0

    async def live_workers(self, model=None):
        self.reads += 1
        return await super().live_workers(model)


class Deployment:
    def __init__(self, url: str, **config):
        client = redis_client(url)
        self.registry, self.index = CountingRegistry(client), RedisPrefixIndex(client)
        self.router = Router(self.registry, self.index, RouterConfig(**config))
        self.registered: list[WorkerInfo] = []

    async def register(self, worker_id: str, model: str = "m", running: int = 0) -> WorkerInfo:
        info = WorkerInfo(worker_id=worker_id, epoch="e1", address="127.0.0.1:1", model=model, model_source=model,
                          capacity=8, load=WorkerLoad(running=running))
        await self.registry.register(info, TTL_S)
        self.registered.append(info)
        return info

    async def aclose(self) -> None:
        for info in self.registered:  # the session's Redis is shared: leave no worker for later tests
            await self.registry.deregister(info.worker_id, info.epoch)
        await self.router.close()
        await self.registry.aclose()


class Deployments:
    """Makes Deployments on the test's Redis; the test hook awaits ``aclose`` after the test."""

    def __init__(self, url: str):
        self.url, self.made = url, []

    def __call__(self, **config) -> Deployment:
        self.made.append(Deployment(self.url, **config))
        return self.made[-1]

    async def aclose(self) -> None:
        for d in self.made:
            await d.aclose()


@pytest.fixture
def deployment(redis_url) -> Deployments:
    return Deployments(redis_url)


async def test_concurrent_requests_share_one_read_and_a_recent_one(deployment):
    d = deployment(registry_max_age_s=0.5, registry_stale_s=5.0)
    await d.register("w1")
    answers = await asyncio.gather(*(d.router.live_workers() for _ in range(64)))
    assert d.registry.reads == 1
    assert all([w.worker_id for w in a] == ["w1"] for a in answers)
    for _ in range(10):
        await d.router.live_workers()
    assert d.registry.reads == 1, "a read younger than registry_max_age_s serves every request"


async def test_an_older_read_is_used_at_once_and_replaced_in_the_background(deployment):
    d = deployment(registry_max_age_s=0.05, registry_stale_s=5.0)
    await d.register("w1")
    assert [w.load.running for w in await d.router.live_workers()] == [0]
    await d.registry.heartbeat("w1", "e1", WorkerLoad(running=3), TTL_S)
    await asyncio.sleep(0.1)
    started = time.perf_counter()
    stale = await asyncio.gather(*(d.router.live_workers() for _ in range(16)))
    assert all([w.load.running for w in s] == [0] for s in stale), "the old snapshot, without waiting"
    await asyncio.sleep(0.05)  # the one background read lands
    assert d.registry.reads == 2
    assert [w.load.running for w in await d.router.live_workers()] == [3]
    assert time.perf_counter() - started < 1.0


async def test_a_read_older_than_the_stale_limit_is_waited_for(deployment):
    d = deployment(registry_max_age_s=0.01, registry_stale_s=0.1)
    await d.register("w1")
    await d.router.live_workers()
    await d.register("w2")
    await asyncio.sleep(0.15)
    assert [w.worker_id for w in await d.router.live_workers()] == ["w1", "w2"]


async def test_a_model_the_snapshot_lacks_is_read_at_once(deployment):
    d = deployment(registry_max_age_s=60.0, registry_stale_s=60.0)
    await d.register("w1", model="small")
    assert (await d.router.serving(None))[0] == "small"
    await d.register("w2", model="large")  # registered after the snapshot was taken
    name, pool = await d.router.serving("large")
    assert name == "large" and [w.worker_id for w in pool] == ["w2"]
    assert d.registry.reads == 2


async def test_a_worker_marked_down_stays_out_until_it_heartbeats_again(deployment):
    d = deployment(registry_max_age_s=0.0, registry_stale_s=60.0)
    w1 = await d.register("w1")
    await d.register("w2")
    [first, _] = await d.router.live_workers()
    d.router.mark_down(first, "test: connection refused")
    for _ in range(3):  # each call starts a background read; none brings w1 back
        assert [w.worker_id for w in await d.router.live_workers()] == ["w2"]
        await asyncio.sleep(0.02)
    assert d.registry.reads >= 3
    await d.registry.heartbeat(w1.worker_id, w1.epoch, WorkerLoad(), TTL_S)
    await d.router.live_workers(fresh=True)
    assert [w.worker_id for w in await d.router.live_workers()] == ["w1", "w2"]
