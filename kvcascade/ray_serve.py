"""`kvcascade serve --workers N [--tp T] [--address RAY]`: the workers as Ray actor groups
(kvcascade/ray_worker.py), the router in this process, all meeting in Redis.

    this process:  Ray driver + router (gRPC --port, HTTP --http-port)
    Ray:           N x WorkerActor (+ T-1 RankActors each), one placement group per worker
    Redis:         --redis-url, or a redis-server child on loopback for a local cluster

Without --address a local Ray cluster is started for this process and stopped with it; with
--address the workers join that cluster (multi-node: they listen on all interfaces and register
their node's address, so Redis must be reachable from every node: --redis-url is then required).

Shutdown drains: the router stops taking requests and lets those under way finish (the grace
period), then every worker deregisters and drains the same way, then the actors are removed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile

from kvcascade.launch import StartupError
from worker.engine.config import EngineConfig

log = logging.getLogger("kvcascade")

NAMESPACE = "kvcascade"


def _init_ray(address: str | None, ranks: int) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address:
        ray.init(address=address, namespace=NAMESPACE)
        return
    # A local cluster of this process's own. Ranks ask for a CPU each (a GPU each on CUDA): on a
    # small machine the count is logical, the ranks share the cores.
    ray.init(num_cpus=max(os.cpu_count() or 1, ranks), namespace=NAMESPACE, include_dashboard=False,
             object_store_memory=256 * 2**20, _temp_dir=os.path.join(tempfile.gettempdir(), "kvcascade-ray"))


async def start_ray_workers(configs: list[EngineConfig], workers: int, running, *, address: str | None,
                            redis_url: str, key_prefix: str = "kvc:", grace_s: float = 5.0,
                            heartbeat_ttl_s: float = 5.0) -> list:
    """Start ``workers`` Ray workers per config; returns once each has registered. Stops (drain,
    then remove) with ``running``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from kvcascade.launch import WorkerOptions
    from kvcascade.ray_worker import WorkerActor, bundle, in_bundle

    _init_ray(address, sum(c.tensor_parallel_size for c in configs) * workers)
    running.on_stop(ray.shutdown)
    started: list[tuple[object, object]] = []
    never_started: set[int] = set()  # actors whose __init__ failed: nothing to drain

    async def drain(actor) -> None:
        try:
            async with asyncio.timeout(grace_s + 20):  # not wait_for: it can swallow a cancel on 3.11
                await asyncio.wrap_future(actor.drain.remote().future())
        except Exception as exc:  # dead, restarting, or stuck: it is removed all the same
            log.warning("a worker did not drain cleanly: %r", exc)

    async def drain_and_remove() -> None:
        await asyncio.gather(*(drain(actor) for actor, _ in started if id(actor) not in never_started))
        for actor, pg in started:
            ray.kill(actor, no_restart=True)
            remove_placement_group(pg)

    running.on_stop(drain_and_remove)
    worker_ids: list[str] = []
    for config in configs:
        name = config.model.replace("/", "_").replace(":", "_")
        for i in range(workers):
            worker_id = f"ray-{name}-{i}" if len(configs) > 1 else f"ray-{i}"
            pg = placement_group([bundle(config)] * config.tensor_parallel_size, strategy="STRICT_PACK",
                                 name=f"kvcascade-{worker_id}")
            await pg.ready()
            opts = WorkerOptions(host="0.0.0.0" if address else "127.0.0.1", port=0, redis_url=redis_url,
                                 worker_id=worker_id, heartbeat_ttl_s=heartbeat_ttl_s, key_prefix=key_prefix,
                                 exit_on_failure=True, grace_s=grace_s)
            resources = {"num_gpus": 1} if config.device.startswith("cuda") else {"num_cpus": 1}
            actor = WorkerActor.options(name=worker_id, scheduling_strategy=in_bundle(pg, 0), **resources).remote(
                config, opts, pg)
            started.append((actor, pg))
            worker_ids.append(worker_id)
    addresses = await asyncio.gather(*(actor.address.remote() for actor, _ in started), return_exceptions=True)
    failed = []
    for worker_id, (actor, _), addr in zip(worker_ids, started, addresses):
        if isinstance(addr, BaseException):
            failed.append(f"worker {worker_id} failed to start: {_cause(addr)}")
            if getattr(addr, "actor_init_failed", False):
                never_started.add(id(actor))
        else:
            log.info("ray worker %s at %s", worker_id, addr)
    if failed:  # a worker that cannot start would not start on a retry either: say so and stop
        raise StartupError("; ".join(failed))
    return [actor for actor, _ in started]


def _cause(exc: BaseException) -> str:
    """One line for a Ray actor's failure: for an error raised in its ``__init__``, that error's
    last line (``ValueError: ...``, without the StartupError that carried it out of the worker's
    start); else Ray's own first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if getattr(exc, "actor_init_failed", False) and lines:
        return lines[-1].removeprefix(f"{StartupError.__module__}.{StartupError.__qualname__}: ")
    return lines[0] if lines else type(exc).__name__
