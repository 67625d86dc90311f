"""A worker as a Ray actor group: one engine on ``tp`` GPUs (or CPU processes) of one node.

    placement group: tp bundles, STRICT_PACK (one node)
      bundle 0:      WorkerActor  (max_restarts=-1): the whole worker -- engine, gRPC server,
                     registration in Redis -- on an event loop of its own (kvcascade.launch.start_worker)
      bundles 1..:   RankActor     run_rank(): the same function `kvcascade worker --tp` runs in its
                     child processes (worker/distributed/ranks.py); owned by the WorkerActor, so
                     they die with it

Failure: a dead rank or a dead engine loop makes rank 0 exit (launch.Watchdog), a dead rank 0
takes its rank actors with it; Ray then restarts the WorkerActor, whose ``__init__`` builds new
rank actors and a new process group, loads the model and registers under a new epoch. Until it
heartbeats again the router sends it nothing (router.Router marks it down on the first failed call).
A worker whose first ``__init__`` raises (a model that does not load, a pool that holds no block)
is not restarted: Ray restarts actors whose process died, not those whose constructor raised, and
kvcascade.ray_serve.start_ray_workers reports it (StartupError), so `kvcascade serve` exits with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from worker.engine.config import EngineConfig

log = logging.getLogger(__name__)


def bundle(config: EngineConfig) -> dict[str, float]:
    """What one rank asks of Ray: a GPU on CUDA, else a CPU."""
    return {"GPU": 1, "CPU": 1} if config.device.startswith("cuda") else {"CPU": 1}


def in_bundle(pg, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


@ray.remote(max_restarts=0)
class RankActor:
    def run(self, config: EngineConfig, rank: int, init_method: str) -> None:
        from worker.distributed.ranks import run_rank

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
        run_rank(config, rank, init_method)


class RayRanks:
    """Ranks 1..T-1 as actors in bundles 1..T-1 (the interface of ranks.LocalRanks: spawn, dead_rank,
    stop; launch.Watchdog polls dead_rank)."""

    def __init__(self, config: EngineConfig, pg):
        from contracts.ports import free_port

        self.config, self.pg = config, pg
        # The bundles are packed on this node: the ranks meet on loopback.
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.actors: list = []
        self.refs: list = []

    def spawn(self) -> EngineConfig:
        """Start ranks 1..T-1 as actors; they wait at ``init_method`` for rank 0 (the worker's engine
        core, a child process of this actor, joins as rank 0)."""
        opts = {"num_gpus": 1} if self.config.device.startswith("cuda") else {"num_cpus": 1}
        for rank in range(1, self.config.tensor_parallel_size):
            actor = RankActor.options(scheduling_strategy=in_bundle(self.pg, rank), **opts).remote()
            self.actors.append(actor)
            self.refs.append(actor.run.remote(self.config, rank, self.init_method))
        return self.config

    def dead_rank(self) -> str | None:
        if not self.refs:
            return None
        done, _ = ray.wait(self.refs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.refs.index(done[0]) + 1
        try:
            ray.get(done[0])
            return f"tensor-parallel rank {rank} left"
        except Exception as exc:
            return f"tensor-parallel rank {rank} died: {type(exc).__name__}"

    def stop(self, timeout_s: float = 10.0) -> None:
        from worker.distributed.group import leave_tp

        ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor)
        leave_tp(timeout_s)  # where this process is rank 0 (an engine in-process); else nothing to leave


@ray.remote(max_restarts=-1, max_task_retries=0)
class WorkerActor:
    """Rank 0 and the worker around it. Started (and restarted by Ray) in ``__init__``."""

    def __init__(self, config: EngineConfig, opts, pg):
        from kvcascade.launch import Running, start_worker

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="worker-loop", daemon=True).start()
        self._running = Running()
        if opts.host == "0.0.0.0" and not opts.advertise_host:  # other nodes dial this node's address
            opts = dataclasses.replace(opts, advertise_host=ray.util.get_node_ip_address())
        ranks = RayRanks(config, pg) if config.tensor_parallel_size > 1 else None
        start = start_worker(config, opts, self._running, ranks=ranks)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result()
        log.info("ray worker %s ready on %s", opts.worker_id, self._server.address)

    def address(self) -> str:
        return self._server.address

    def pid(self) -> int:
        return os.getpid()

    def drain(self) -> None:
        """Leave the registry, let requests under way finish (the grace period), stop everything."""
        asyncio.run_coroutine_threadsafe(self._running.stop(), self._loop).result()
