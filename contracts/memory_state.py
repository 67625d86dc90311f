"""The registry and prefix index in process memory: the embedded default (router and worker in one
process). Behaves exactly as the Redis ones in contracts/redis_state.py; tests/router/test_state.py
runs one contract suite over both."""

from __future__ import annotations

import copy
import time

from contracts.state import CacheEvent, PrefixIndex, Registry, WorkerInfo, WorkerLoad, check_events


class MemoryRegistry(Registry):
    def __init__(self) -> None:
        self._workers: dict[str, tuple[WorkerInfo, float]] = {}  # id -> (info, monotonic expiry)

    def _live(self, worker_id: str) -> WorkerInfo | None:
        entry = self._workers.get(worker_id)
        if entry is None:
            return None
        if entry[1] <= time.monotonic():
            del self._workers[worker_id]
            return None
        return entry[0]

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        # A copy, as Redis stores a snapshot: later changes to the caller's object publish nothing.
        stored = copy.deepcopy(info)
        stored.last_seen = time.time()
        self._workers[info.worker_id] = (stored, time.monotonic() + ttl_s)

    async def heartbeat(self, worker_id: str, epoch: str, load: WorkerLoad, ttl_s: float) -> bool:
        info = self._live(worker_id)
        if info is None or info.epoch != epoch:
            return False
        info.load = copy.copy(load)
        info.last_seen = time.time()
        self._workers[worker_id] = (info, time.monotonic() + ttl_s)
        return True

    async def deregister(self, worker_id: str, epoch: str) -> None:
        info = self._live(worker_id)
        if info is not None and info.epoch == epoch:
            del self._workers[worker_id]

    async def live_workers(self, model: str | None = None) -> list[WorkerInfo]:
        live = [self._live(w) for w in sorted(self._workers)]
        return [copy.deepcopy(i) for i in live if i is not None and (model is None or i.model == model)]


class MemoryPrefixIndex(PrefixIndex):
    def __init__(self) -> None:
        self._holders: dict[tuple[str, int], dict[str, str]] = {}  # (model, hash) -> {worker: epoch}
        self._held: dict[str, set[tuple[str, int]]] = {}  # worker -> its keys in _holders

    async def apply(self, worker_id: str, epoch: str, model: str, events: list[CacheEvent]) -> None:
        check_events(events)
        for ev in events:
            if ev.kind == "cleared":
                self._clear(worker_id)
                continue
            key = (model, ev.block_hash)
            if ev.kind == "stored":
                self._holders.setdefault(key, {})[worker_id] = epoch
                self._held.setdefault(worker_id, set()).add(key)
            elif self._holders.get(key, {}).get(worker_id) == epoch:  # evicted, by this epoch
                self._forget(worker_id, key)

    def _forget(self, worker_id: str, key: tuple[str, int]) -> None:
        holders = self._holders[key]
        del holders[worker_id]
        if not holders:
            del self._holders[key]
        held = self._held[worker_id]
        held.discard(key)
        if not held:
            del self._held[worker_id]

    def _clear(self, worker_id: str) -> None:
        for key in list(self._held.get(worker_id, ())):
            self._forget(worker_id, key)

    async def match(self, model: str, block_hashes: list[int], workers: dict[str, str]) -> dict[str, int]:
        counts = dict.fromkeys(workers, 0)
        alive = list(workers)
        for i, h in enumerate(block_hashes):
            holders = self._holders.get((model, h), {})
            alive = [w for w in alive if holders.get(w) == workers[w]]
            if not alive:
                break
            for w in alive:
                counts[w] = i + 1
        return counts

    async def drop_worker(self, worker_id: str) -> None:
        self._clear(worker_id)

    async def indexed_workers(self) -> set[str]:
        return set(self._held)
