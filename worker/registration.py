"""A worker's side of the shared state: register, heartbeat with load, publish prefix-cache events.

Events go out in order, about every ``event_interval_s``; the load goes out with every heartbeat.
If the state backend (Redis) fails, events in between are lost, so on recovery the worker
re-registers and asks its engine for a snapshot ("cleared" + every cached block): the index is
exact again without the router having to guess. A new process is a new epoch, and its first act
is to drop whatever an earlier epoch of the same worker id left in the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from contracts.state import CacheEvent, PrefixIndex, Registry, WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)


class WorkerPublisher:
    """``engine``: the worker's AsyncEngine or EngineCoreClient (one interface)."""

    def __init__(self, engine, registry: Registry, index: PrefixIndex, *, worker_id: str,
                 address: str, model_source: str, ttl_s: float = 5.0, heartbeat_s: float = 1.0,
                 event_interval_s: float = 0.05):
        self.engine = engine
        self.registry = registry
        self.index = index
        stats = engine.stats()
        self.info = WorkerInfo(
            worker_id=worker_id, epoch=uuid.uuid4().hex[:12], address=address, model=engine.model_id,
            model_source=model_source, tokenizer=engine.config.tokenizer or "", capacity=engine.config.max_num_seqs, block_size=stats.block_size,
            tp_size=engine.config.tensor_parallel_size, max_model_len=engine.max_model_len,
            load=self._load(),
        )
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s
        self.event_interval_s = event_interval_s
        self._task: asyncio.Task | None = None
        self._healthy = False
        self._stopping = False

    def _load(self) -> WorkerLoad:
        s = self.engine.stats()
        return WorkerLoad(running=s.running, waiting=s.waiting, kv_blocks_free=s.kv_blocks_free,
                          kv_blocks_total=s.kv_blocks_total, queued_tokens=s.pending_prefill_tokens,
                          spec_drafted_tokens=s.spec_drafted, spec_accepted_tokens=s.spec_accepted,
                          spec_verifications=s.spec_verifications)

    async def start(self) -> None:
        """Register now (so the worker is routable when this returns), then keep publishing."""
        self.engine.drain_kv_events()  # start collecting; the snapshot below covers what is cached
        await self._register()
        self._task = asyncio.create_task(self._run(), name=f"publisher-{self.info.worker_id}")

    async def stop(self) -> None:
        """Leave the registry at once (a clean shutdown), so routers stop sending here."""
        # The flag ends the loop even where a library swallows the cancel (contracts/redis_state.py).
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.registry.deregister(self.info.worker_id, self.info.epoch)
            await self.index.drop_worker(self.info.worker_id)

    async def _register(self) -> None:
        await self.index.drop_worker(self.info.worker_id)  # an earlier epoch's entries
        self.engine.request_kv_snapshot()
        self.info.load = self._load()
        await self.registry.register(self.info, self.ttl_s)
        self._healthy = True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_beat = loop.time() + self.heartbeat_s
        while not self._stopping:
            await asyncio.sleep(self.event_interval_s)
            try:
                if not self._healthy:
                    await self._register()
                    log.info("worker %s: state backend answers again; re-registered with a fresh snapshot",
                             self.info.worker_id)
                events = self.engine.drain_kv_events()
                if events:
                    await self.index.apply(self.info.worker_id, self.info.epoch, self.info.model,
                                           [CacheEvent(e.kind, e.block_hash) for e in events])
                if loop.time() >= next_beat:
                    next_beat = loop.time() + self.heartbeat_s
                    if not await self.registry.heartbeat(self.info.worker_id, self.info.epoch, self._load(), self.ttl_s):
                        # Expired (e.g. Redis restarted empty): announce again, with a snapshot.
                        log.info("worker %s: registration lapsed; registering again", self.info.worker_id)
                        await self._register()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._healthy:
                    log.warning("worker %s: state backend failed (%s); will re-register and resync",
                                self.info.worker_id, exc)
                self._healthy = False
                await asyncio.sleep(min(1.0, self.heartbeat_s))
