"""The shared state the router reads and workers write: the worker registry and the prefix index.

Two implementations stand behind one interface each: Redis (router/redis_state.py), for real
deployments with several routers and workers, and in-memory (router/memory_state.py), for the
embedded default where everything runs in one process. Workers write through the same classes.

Contracts (../shared/DESIGN.md):
- A worker is (worker_id, epoch); the epoch is new at every start. Index entries carry the epoch,
  and a lookup only counts entries whose epoch is the worker's live one, so a restarted or dead
  worker's stale entries never attract traffic.
- The index is exact: a worker reports "stored" when a full block enters its prefix cache and
  "evicted" when it leaves; "cleared" drops all of a worker's entries.
- ``match`` answers, in one round trip, how many *leading* blocks of a prompt each worker holds.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field


@dataclass
class WorkerLoad:
    running: int = 0
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    queued_tokens: int = 0  # prompt tokens still to prefill, across running and waiting


@dataclass
class WorkerInfo:
    worker_id: str
    epoch: str  # new at every start
    address: str  # host:port of the worker's gRPC server
    model: str
    tp_size: int = 1
    capacity: int = 0  # max_num_seqs: requests it runs at once
    block_size: int = 16
    load: WorkerLoad = field(default_factory=WorkerLoad)
    last_seen: float = field(default_factory=time.time)


@dataclass(frozen=True)
class CacheEvent:
    kind: str  # "stored" | "evicted" | "cleared"
    block_hash: int | None = None


class Registry(abc.ABC):
    """Live workers. A worker that stops heartbeating disappears after ``ttl_s``."""

    @abc.abstractmethod
    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        """Announce (or re-announce) a worker; also its heartbeat."""

    @abc.abstractmethod
    async def heartbeat(self, worker_id: str, epoch: str, load: WorkerLoad, ttl_s: float) -> None:
        """Refresh the TTL and publish the current load."""

    @abc.abstractmethod
    async def deregister(self, worker_id: str, epoch: str) -> None:
        """Leave at once (a clean shutdown); no effect if a newer epoch has registered."""

    @abc.abstractmethod
    async def live_workers(self, model: str | None = None) -> list[WorkerInfo]:
        """Workers whose heartbeat has not expired, optionally only those serving ``model``."""


class PrefixIndex(abc.ABC):
    @abc.abstractmethod
    async def apply(self, worker_id: str, epoch: str, model: str, events: list[CacheEvent]) -> None:
        """Apply a worker's cache events, in order."""

    @abc.abstractmethod
    async def match(self, model: str, block_hashes: list[int], workers: dict[str, str]) -> dict[str, int]:
        """For each worker in ``workers`` (id -> live epoch): how many leading blocks it holds."""

    @abc.abstractmethod
    async def drop_worker(self, worker_id: str) -> None:
        """Remove every entry of a worker, whatever its epoch (cleanup of dead or old epochs)."""
