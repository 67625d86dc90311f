"""The shared state the router reads and workers write: the worker registry and the prefix index.

Two implementations stand behind one interface each: Redis (contracts/redis_state.py), for real
deployments with several routers and workers, and in-memory (contracts/memory_state.py), for the
embedded default where everything runs in one process. Workers write through the same classes.

Contracts (../shared/DESIGN.md):
- A worker is (worker_id, epoch); the epoch is new at every start. Index entries carry the epoch,
  and a lookup only counts entries whose epoch is the worker's live one, so a restarted or dead
  worker's stale entries never attract traffic.
- The index is exact: a worker reports "stored" when a full block enters its prefix cache and
  "evicted" when it leaves; "cleared" drops all of a worker's entries.
- ``match`` answers, in one round trip, how many *leading* blocks of a prompt each worker holds.

Errors: when the shared store cannot be reached, every method raises ``StateUnavailable``, a
``ConnectionError``; the router catches it and routes by load only until the store is back.
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
    # Speculative decoding since the worker started (0 without --speculative): drafted tokens,
    # accepted ones, verifications. Totals, not rates: the router's metrics export them as counters.
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0


@dataclass
class WorkerInfo:
    worker_id: str
    epoch: str  # new at every start
    address: str  # host:port of the worker's gRPC server
    model: str
    model_source: str = ""  # what the worker was started with (--model): the router loads the same tokenizer
    tokenizer: str = ""  # the worker's --tokenizer, when it has one: the router loads that instead
    tp_size: int = 1
    capacity: int = 0  # max_num_seqs: requests it runs at once
    block_size: int = 16
    max_model_len: int = 0  # the context length its engine accepts (0: not said, a worker before this field)
    load: WorkerLoad = field(default_factory=WorkerLoad)
    last_seen: float = field(default_factory=time.time)


@dataclass(frozen=True)
class CacheEvent:
    kind: str  # "stored" | "evicted" | "cleared"
    block_hash: int | None = None


EVENT_KINDS = ("stored", "evicted", "cleared")
MAX_BLOCK_HASH = 2**64 - 1


class StateUnavailable(ConnectionError):
    """The shared store (Redis) did not answer; the caller falls back to load-only routing."""


def check_events(events: list[CacheEvent]) -> None:
    """Reject a bad batch before any of it is applied, so a batch is applied whole or not at all."""
    for ev in events:
        if ev.kind not in EVENT_KINDS:
            raise ValueError(f"unknown cache event kind {ev.kind!r}")
        if ev.kind != "cleared" and not (isinstance(ev.block_hash, int) and 0 <= ev.block_hash <= MAX_BLOCK_HASH):
            raise ValueError(f"{ev.kind} event needs an unsigned 64-bit block_hash, got {ev.block_hash!r}")


class Registry(abc.ABC):
    """Live workers. A worker that stops heartbeating disappears after ``ttl_s``."""

    @abc.abstractmethod
    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        """Announce (or re-announce) a worker; also its heartbeat."""

    @abc.abstractmethod
    async def heartbeat(self, worker_id: str, epoch: str, load: WorkerLoad, ttl_s: float) -> bool:
        """Refresh the TTL and publish the current load (and ``last_seen``).

        Returns False, changing nothing, when ``worker_id`` is not live under ``epoch``: its entry
        expired (or the store restarted) and the worker should ``register`` again, or another
        epoch registered since (epochs are opaque, so the latest ``register`` wins and an old
        epoch's heartbeat must not overwrite it)."""

    @abc.abstractmethod
    async def deregister(self, worker_id: str, epoch: str) -> None:
        """Leave at once (a clean shutdown); no effect if another epoch has registered since."""

    @abc.abstractmethod
    async def live_workers(self, model: str | None = None) -> list[WorkerInfo]:
        """Workers whose heartbeat has not expired, optionally only those serving ``model``,
        sorted by worker id. Each is a fresh copy: changing it changes nothing stored."""

    async def aclose(self) -> None:
        """Release connections (the Redis client is shared with the index: closing either closes it)."""


class PrefixIndex(abc.ABC):
    """(model, block_hash) -> {worker_id: epoch}: which workers hold a block in their prefix cache."""

    @abc.abstractmethod
    async def apply(self, worker_id: str, epoch: str, model: str, events: list[CacheEvent]) -> None:
        """Apply a worker's cache events, in order and atomically (one round trip):
        "stored" adds (or re-tags) the worker's entry for the block with ``epoch``; "evicted"
        removes it only if it carries ``epoch`` (a late event of an old epoch cannot drop a new
        epoch's block); "cleared" removes all of the worker's entries, whatever their epoch.
        A starting worker applies "cleared" (or calls drop_worker), so its old epoch's entries go.
        Raises ValueError, applying nothing, on an unknown kind or a hash outside [0, 2**64)."""

    @abc.abstractmethod
    async def match(self, model: str, block_hashes: list[int], workers: dict[str, str]) -> dict[str, int]:
        """For each worker in ``workers`` (id -> live epoch): how many leading blocks it holds.

        The answer has exactly the keys of ``workers``, in that order, 0 for a worker holding not
        even the first block. A worker's count stops at its first block that it lacks or holds
        under another epoch: holding blocks 0, 1 and 3 of 4 counts 2. One round trip."""

    @abc.abstractmethod
    async def drop_worker(self, worker_id: str) -> None:
        """Remove every entry of a worker, whatever its epoch (cleanup of dead or old epochs)."""

    @abc.abstractmethod
    async def indexed_workers(self) -> set[str]:
        """Ids of the workers that have entries: with the registry's live workers, this finds the
        dead ones to ``drop_worker`` (their entries never match, but they take memory)."""

    async def aclose(self) -> None:
        """Release connections (the Redis client is shared with the registry: closing either closes it)."""
