"""Drives an LLMEngine from one background thread, for asyncio servers.

The engine is single-threaded: only the loop thread touches it. Callers hand adds and aborts
over under a lock; outputs come back to each caller's event loop through its own queue. The
request count is checked at the door, so overload is refused at once (QueueFullError) instead of
growing an unbounded queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from contracts.tokenizers import tokenize_prompt
from worker.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from worker.engine.llm_engine import LLMEngine
from worker.engine.outputs import EngineStats, RequestOutput
from worker.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cv = threading.Condition()
        self._adds: list[tuple[str, list[int], SamplingParams, float]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._stats = engine.stats()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        # Prefix-cache events for whoever publishes them (the worker's index publisher), in order.
        self._kv_events: list = []
        self._collect_kv_events = False  # off until a publisher first drains: no unbounded buffer
        self._snapshot_wanted = False

    # --- properties the server needs ----------------------------------------------------------

    @property
    def config(self):
        return self.engine.config

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> EngineStats:
        with self._cv:
            return self._stats

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # --- requests ------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str | None = None,
        *,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        params: SamplingParams,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's updates; leaving the iteration early aborts it and frees its blocks."""
        request_id = request_id or uuid.uuid4().hex
        if prompt_token_ids is None:
            prompt_token_ids = await tokenize_prompt(self.engine.tokenize, prompt, messages, len(self._streams), tools)
        self.engine.validate(prompt_token_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            if self._dead is not None or self._stopping:
                raise EngineDeadError("the engine is not running")
            if len(self._streams) >= self.engine.config.max_queued_requests:
                raise QueueFullError(
                    f"{len(self._streams)} requests in flight (max_queued_requests="
                    f"{self.engine.config.max_queued_requests}); retry later")
            if request_id in self._streams:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
            self._streams[request_id] = stream
            self._adds.append((request_id, prompt_token_ids, params, time.monotonic()))
            self._cv.notify()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._cv:
                self._streams.pop(request_id, None)

    def drain_kv_events(self) -> list:
        """Prefix-cache events (block stored / evicted / cache cleared) since the last call."""
        with self._cv:
            self._collect_kv_events = True
            events, self._kv_events = self._kv_events, []
            return events

    def request_kv_snapshot(self) -> None:
        """Ask for "cleared" plus every cached block next, in order with the other events (after
        a publisher lost events, e.g. while Redis was down, this makes the index exact again)."""
        with self._cv:
            self._snapshot_wanted = True
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    # --- the loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not (self._adds or self._aborts or self._stopping or self._snapshot_wanted
                               or engine.has_unfinished()):
                        self._cv.wait()
                    if self._stopping:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                for request_id in aborts:
                    engine.abort_request(request_id)
                for request_id, ids, params, arrival in adds:
                    try:
                        engine.add_request(ids, params, request_id=request_id, arrival_time=arrival)
                    except Exception as exc:  # validated at the door; this is a race, not a crash
                        self._deliver(request_id, exc)
                outputs = engine.step() if engine.has_unfinished() else []
                events = engine.block_manager.drain_events()
                with self._cv:
                    self._stats = engine.stats()
                    if self._snapshot_wanted:
                        self._snapshot_wanted = False
                        events = engine.block_manager.snapshot_events()  # supersedes what came before
                        self._kv_events.clear()
                    if self._collect_kv_events:
                        self._kv_events.extend(events)
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # the engine itself broke: fail everyone, loudly
            log.exception("engine loop died")
            self._dead = exc
        finally:
            try:
                engine.close()  # tensor-parallel ranks leave their step loop
            except Exception:
                log.exception("closing the engine failed")
            err = EngineDeadError(f"engine stopped: {self._dead!r}" if self._dead else "engine shut down")
            with self._cv:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, err)

    def _deliver(self, request_id: str, item) -> None:
        with self._cv:
            stream = self._streams.get(request_id)
        if stream is None:
            return  # the caller left; its abort is queued
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass
