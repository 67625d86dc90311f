"""The worker's front end of an engine core process (process.py): requests in, streams out.

Same interface as AsyncEngine (the in-process driver), so the gRPC server and the registry
publisher take either. What it does on this side of the process boundary:

- tokenizes (a long prompt in a thread) and validates at the door (InputProcessor), refusing
  overload at once (QueueFullError);
- sends each request to the core once, aborts when a stream is left early;
- one reader thread takes the core's one message per step, detokenizes each request's new tokens,
  checks stop strings (aborting a request one ends) and hands each event loop its streams' updates
  in one call; a stream that lags gets what has piled up as one update;
- a core that exits or fails ends every open stream with EngineDeadError (gRPC UNAVAILABLE) and
  reports unhealthy, so the worker's watchdog exits and its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import zmq

from contracts.tokenizers import tokenize_prompt
from worker.core.messages import FROM_CORE, Abort, Add, Control, CoreOutput, Failed, Ready, Step
from worker.core.process import core_params
from worker.engine.block_manager import KVEvent
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import take_text_delta, update_text
from worker.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from worker.engine.input_processor import InputProcessor
from worker.engine.outputs import EngineStats, RequestOutput, TokenLogprob, Usage
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence

log = logging.getLogger(__name__)

_POLL_MS = 100  # the reader notices a core that died without a word within this


@dataclass
class _Request:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq: Sequence  # holds the detokenizer's state; its params are the client's (stop strings included)
    arrival: float
    first_token_time: float | None = None
    cached_tokens: int = 0
    done: bool = False  # its last update is out: anything the core still sends for it is dropped


class EngineCoreClient:
    def __init__(self, config: EngineConfig, *, init_method: str | None = None, tokenizer=None,
                 env: dict[str, str] | None = None):
        """``init_method``: with tensor parallelism, where the other ranks (already started) wait;
        ``env``: variables the core process gets on top of this one's (a replica's GPUs or threads)."""
        self.config = config
        self.init_method = init_method
        self.env = env or {}
        self._tokenizer = tokenizer
        self.inputs: InputProcessor | None = None
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # _requests, _stats, _kv_events, the input socket
        self._requests: dict[str, _Request] = {}
        self._stats: EngineStats | None = None
        self._kv_events: list[KVEvent] = []
        self._collect_kv_events = False
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FROM_CORE).decode

    # --- what the server and the publisher read ------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.inputs.model_id

    @property
    def max_model_len(self) -> int:
        return self.inputs.max_model_len

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    def is_healthy(self) -> bool:
        return self._reader is not None and self._dead is None and not self._stopping

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout_s: float | None = None, watch: Callable[[], str | None] = lambda: None) -> None:
        """Start the core process and return once its engine is ready (blocking). ``watch`` says why
        the start cannot succeed (a tensor-parallel rank that died), or None."""
        from contracts.models import resolve_model
        from contracts.tokenizers import load_tokenizer

        self._dir = tempfile.mkdtemp(prefix="kvcascade-core-")
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.bind(f"ipc://{self._dir}/in")
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(f"ipc://{self._dir}/out")
        payload = json.dumps(dataclasses.asdict(self.config))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.core.process", "--config", payload, "--input", f"ipc://{self._dir}/in",
             "--output", f"ipc://{self._dir}/out", "--parent-pid", str(os.getpid()),
             *(["--init-method", self.init_method] if self.init_method else [])],
            env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env))
        try:
            # The tokenizer loads here while the core loads the model.
            tokenizer = self._tokenizer if self._tokenizer is not None else load_tokenizer(resolve_model(self.config.model), self.config.tokenizer)
            ready = self._wait_ready(timeout_s, watch)
        except BaseException:
            self._kill()
            raise
        self.inputs = InputProcessor(ready.model_id, tokenizer, ready.max_model_len, ready.vocab_size)
        self._stats = EngineStats(0, 0, ready.num_blocks, ready.num_blocks, 0, 0, 0, ready.block_size)
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()
        log.info("engine core ready: pid %d, model %s, %d KV blocks", ready.pid, ready.model_id, ready.num_blocks)

    def _wait_ready(self, timeout_s: float | None, watch: Callable[[], str | None]) -> Ready:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._out.poll(200):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine core exited with code {self.proc.returncode} while starting "
                                   "(its log above says why)")
            if (reason := watch()) is not None:
                raise RuntimeError(reason)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine core was not ready in {timeout_s} s")
        msg = self._decode(self._out.recv())
        if isinstance(msg, Failed):
            raise RuntimeError(msg.error)  # "ValueError: kv_cache_bytes=... holds no KV block ..."
        assert isinstance(msg, Ready), msg
        return msg

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (after the server's drain) and end any stream still open."""
        if self.proc is None:
            return
        self._stopping = True
        if self.proc.poll() is None:
            try:
                self._send(Control("shutdown"))
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine core did not exit in %.0f s; killing it", timeout)
            except zmq.ZMQError:
                pass
        self._kill()
        if self._reader is not None:
            self._reader.join(2)
        self._fail_all(EngineDeadError("engine shut down"))
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    # --- requests --------------------------------------------------------------------------------

    async def generate(self, request_id: str | None = None, *, prompt: str | None = None,
                       prompt_token_ids: list[int] | None = None, messages: list[dict] | None = None,
                       tools: list[dict] | None = None, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream a request's updates; leaving the iteration early aborts it and frees its blocks."""
        request_id = request_id or uuid.uuid4().hex
        if prompt_token_ids is None:
            prompt_token_ids = await tokenize_prompt(self.inputs.tokenize, prompt, messages, len(self._requests), tools)
        self.inputs.validate(prompt_token_ids, params)
        req = _Request(asyncio.get_running_loop(), asyncio.Queue(), Sequence(request_id, prompt_token_ids, params),
                       time.monotonic())
        with self._lock:
            if self._dead is not None or self._stopping:
                raise self._dead or EngineDeadError("the engine is shutting down")
            if len(self._requests) >= self.config.max_queued_requests:
                raise QueueFullError(f"{len(self._requests)} requests in flight (max_queued_requests="
                                     f"{self.config.max_queued_requests}); retry later")
            if request_id in self._requests:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
            self._requests[request_id] = req
        finished = False
        try:
            self._send(Add(request_id, prompt_token_ids, core_params(params), req.arrival))
            while True:
                items = [await req.queue.get()]
                while not req.queue.empty():
                    items.append(req.queue.get_nowait())
                for item in _coalesce(items):
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.finished:
                        finished = True
                        return
        finally:
            with self._lock:
                self._requests.pop(request_id, None)
            if not finished and not req.done:
                req.done = True
                self._abort_in_core(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self._requests.get(request_id)
        if req is not None:
            req.done = True
        self._abort_in_core(request_id)

    def _abort_in_core(self, request_id: str) -> None:
        if self._dead is None and self.proc is not None and self.proc.poll() is None:
            try:
                self._send(Abort([request_id]))
            except zmq.ZMQError:
                pass  # shutting down: the core frees everything as it goes

    def drain_kv_events(self) -> list[KVEvent]:
        """Prefix-cache events (block stored / evicted / cache cleared) since the last call."""
        with self._lock:
            if not self._collect_kv_events:
                self._collect_kv_events = True
                self._send_locked(Control("kv_events"))
            events, self._kv_events = self._kv_events, []
            return events

    def request_kv_snapshot(self) -> None:
        """Ask for "cleared" plus every cached block next, in order with the other events."""
        self._send(Control("snapshot"))

    def _send(self, msg) -> None:
        with self._lock:
            self._send_locked(msg)

    def _send_locked(self, msg) -> None:
        self._in.send(self._encode(msg), copy=False)

    # --- the reader thread -----------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                if not self._out.poll(_POLL_MS):
                    if self.proc.poll() is not None:
                        break
                    continue
                msg = self._decode(self._out.recv(copy=False).buffer)
                if isinstance(msg, Step):
                    self._on_step(msg)
                elif isinstance(msg, Failed):
                    self._dead = EngineDeadError(f"engine stopped: {msg.error}")
                    break
        except zmq.ZMQError:
            pass  # the sockets closed under us: shutdown
        except Exception as exc:  # a bug on this side: no request may hang on it
            log.exception("engine core reader failed")
            self._dead = EngineDeadError(f"engine front end failed: {type(exc).__name__}: {exc}")
        if self._stopping:
            return
        if self._dead is None:
            self._dead = EngineDeadError(f"engine core exited with code {self.proc.poll()}")
        log.error("%s; failing every open request", self._dead)
        self._fail_all(self._dead)

    def _on_step(self, msg: Step) -> None:
        with self._lock:
            self._stats = msg.stats
            if msg.snapshot:
                self._kv_events.clear()
            if self._collect_kv_events and msg.kv_events:
                self._kv_events.extend(KVEvent(kind, h) for kind, h in msg.kv_events)
            reqs = [(self._requests.get(o.request_id), o) for o in msg.outputs]
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for req, out in reqs:
            if req is None or req.done:
                continue
            update = self._update(req, out, now)
            by_loop.setdefault(req.loop, []).append((req.queue, update))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that caller's loop is closed
                pass

    def _update(self, req: _Request, out: CoreOutput, now: float) -> RequestOutput:
        """One step's tokens of one request as its client sees them: text, stop strings, usage."""
        seq, params = req.seq, req.seq.params
        req.cached_tokens = out.cached_tokens
        reason = out.finish_reason
        tokens = out.token_ids
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            if params.detokenize and self.inputs.tokenizer is not None and update_text(seq, self.inputs.tokenizer):
                if reason is None:
                    self._abort_in_core(seq.request_id)  # a stop string ended it: the core stops too
                reason, tokens = "stop", tokens[: i + 1]
                break
        if tokens and req.first_token_time is None:
            req.first_token_time = now
        logprobs = None
        if params.logprobs is not None and out.logprobs is not None:
            logprobs = [TokenLogprob(t, lp, [tuple(x) for x in top]) for t, lp, top in out.logprobs[: len(tokens)]]
        finished = reason is not None
        update = RequestOutput(seq.request_id, list(tokens), take_text_delta(seq, finished), logprobs, finished)
        if out.prompt_logprobs is not None:
            update.prompt_logprobs = [TokenLogprob(t, lp, [tuple(x) for x in top])
                                      for t, lp, top in out.prompt_logprobs]
        if finished:
            req.done = True
            update.finish_reason = reason
            update.error = out.error
            update.usage = Usage(seq.num_prompt_tokens, req.cached_tokens, seq.num_output_tokens)
            if req.first_token_time is not None:
                update.ttft_s = req.first_token_time - req.arrival
        return update

    def _fail_all(self, err: EngineDeadError) -> None:
        with self._lock:
            reqs = [r for r in self._requests.values() if not r.done]
        for req in reqs:
            req.done = True
            try:
                req.loop.call_soon_threadsafe(req.queue.put_nowait, err)
            except RuntimeError:
                pass


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _coalesce(items: list) -> list:
    """Consecutive updates merged into one; an error stays in its place."""
    out: list = []
    for item in items:
        if out and isinstance(item, RequestOutput) and isinstance(out[-1], RequestOutput):
            out[-1] = out[-1].merged(item)
        else:
            out.append(item)
    return out
