"""The router's core: tokenize, look up the prefix index, pick a worker, stream its answer.

Front ends (gRPC in grpc_api.py, HTTP in http_api.py) call ``Router.generate`` with a proto
GenerateRequest and get the worker's GenerateResponse messages back, or a RouterError.

    request -> tokens (chat template applied exactly as a worker would) -> block hashes
            -> index.match (one round trip) with the live workers (a snapshot of the registry)
            -> policy.order -> first worker that answers -> stream

The registry is read at most every ``registry_max_age_s`` (0.1 s): requests share the last read,
and one older than that is used as it is while a background read replaces it, so no request waits
on the registry unless the last read is over ``registry_stale_s`` (1 s, a worker's heartbeat
period) old, or names a model the snapshot does not have yet. Heartbeats are a second apart, so
the load a snapshot carries is as fresh as a read's; a worker that fails is taken out at once,
and one that only drops out of the registry (Redis restarted empty) is kept while its last
heartbeat is recent (``registry_grace_s``), until it registers again.

With a cascade file (router/cascade.py), a request for the cascade runs through its tiers, each
tier's answer coming from this same path (``_answer``) for that tier's model.

A worker that fails before its first token is skipped for the next one in the policy's order;
one that fails after it hands the stream to another, which goes on from the tokens already sent
(``_stream``).
When Redis is unreachable the router keeps serving with load-only routing on the last workers
it knew, flags it in metrics and logs, and recovers on its own once Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from protos import kvcascade_pb2 as pb
from protos.block_hash import block_hashes
from router.cascade import plan as cascade_plan
from router.cascade import run_cascade
from router.cascade_config import CascadeConfig, CascadeFile
from contracts.chat import render_chat, takes_tools, template_inputs
from contracts.tokenizers import tokenize_inline
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.policy import Candidate, RoutingPolicy, create_policy
from contracts.state import PrefixIndex, Registry, WorkerInfo
from router.worker_client import WorkerClients

log = logging.getLogger(__name__)

# Worker errors that mean "this worker cannot take it now; another may".
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass
class RouterConfig:
    policy: str = "prefix_aware"
    max_attempts: int = 3  # workers tried before the first token
    # A stream whose worker fails after its first token goes on on another worker of the model, from
    # the prompt and the tokens already sent, at most this many times (0: it ends with UNAVAILABLE).
    max_migrations: int = 1
    default_timeout_s: float | None = None  # per request, when the client sets no deadline
    tokenizer: str | None = None  # --tokenizer: one tokenizer for every model instead of each worker's
    registry_max_age_s: float = 0.1  # a registry read this recent serves requests as it is
    registry_stale_s: float = 1.0  # one older than this is read again before a request uses it
    # A worker that drops out of the registry while it heartbeat this recently is kept: Redis
    # restarted empty (or failed over) and the worker re-registers at its next heartbeat. Below the
    # workers' heartbeat TTL (5 s), so a dead worker is never kept past its registration's expiry.
    registry_grace_s: float = 3.0


class Tokenizers:
    """One tokenizer per model source (and --tokenizer), loaded on first use, the way the worker loads it;
    ``override``: the router's own --tokenizer, used for every model."""

    def __init__(self, override: str | None = None) -> None:
        self.override = override
        self._by_source: dict[tuple[str, str], object] = {}
        self._lock = asyncio.Lock()

    async def get(self, source: str, tokenizer: str = ""):
        key = (source, self.override or tokenizer)
        if key not in self._by_source:
            async with self._lock:
                if key not in self._by_source:
                    self._by_source[key] = await asyncio.to_thread(_load_tokenizer, *key)
        return self._by_source[key]

    def __len__(self) -> int:
        return len(self._by_source)

    async def of(self, worker) -> object:
        """The tokenizer for a registered worker's prompts."""
        return await self.get(worker.model_source or worker.model, worker.tokenizer)


def _load_tokenizer(source: str, tokenizer: str):
    from contracts.models import resolve_model
    from contracts.tokenizers import load_tokenizer

    return load_tokenizer(resolve_model(source), tokenizer or None)


def _inline(request: pb.GenerateRequest, in_flight: int) -> bool:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return tokenize_inline(request.text, None, in_flight)
    if kind == "messages":
        chat = request.messages  # the tools' JSON is rendered into the prompt too
        return tokenize_inline(chat.tools_json, [{"content": m.content} for m in chat.messages], in_flight)
    return True


async def tokenize_async(tokenizer, request: pb.GenerateRequest, in_flight: int = 0) -> list[int]:
    """``tokenize``, on the event loop for a short prompt at low load, else in a thread
    (contracts.tokenizers.tokenize_inline)."""
    if _inline(request, in_flight):
        return tokenize(tokenizer, request)
    return await asyncio.to_thread(tokenize, tokenizer, request)


def tokenize(tokenizer, request: pb.GenerateRequest) -> list[int]:
    """Prompt token ids exactly as the worker's engine computes them (LLMEngine.tokenize)."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: set one of text, token_ids or messages")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
    elif kind == "text":
        ids = tokenizer.encode(request.text, add_special_tokens=False)
    else:
        try:
            messages, tools = template_inputs(request.messages)
        except ValueError as exc:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"tools: not a JSON array of tools: {exc}") from None
        if not messages:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "messages: must hold at least one message")
        for i, m in enumerate(messages):
            if not m["role"]:
                raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"messages[{i}].role: must not be empty")
        if tools and not takes_tools(tokenizer):
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "tools: this model's chat template does not take tools")
        ids = render_chat(tokenizer, messages, tools)
    if not ids:
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
    return ids


class Router:
    def __init__(self, registry: Registry, index: PrefixIndex, config: RouterConfig | None = None,
                 policy: RoutingPolicy | None = None, metrics: RouterMetrics | None = None,
                 cascade: CascadeFile | None = None):
        self.config = config or RouterConfig()
        self.registry = registry
        self.index = index
        self.policy = policy or create_policy(self.config.policy)
        self.metrics = metrics or RouterMetrics()
        self.clients = WorkerClients()
        self.tokenizers = Tokenizers(self.config.tokenizer)
        self._same_vocab: dict[tuple[int, int], bool] = {}  # prompt_ids: tokenizer pairs checked
        self._in_flight: dict[str, int] = defaultdict(int)
        self._requests = 0  # generate() calls under way (a request tokenizing counts the others)
        self.prompt_tokens_total = 0  # over finished requests, for Stats
        self.cached_tokens_total = 0
        self._last_workers: list[WorkerInfo] = []  # the registry's last answer, less workers marked down
        self._kept: set[str] = set()  # workers in _last_workers only by registry_grace_s
        self._answered_again_at = float("-inf")  # when the registry last answered after failing
        self._max_token_chars: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> longest token
        self._read_at = -float("inf")  # when it was read (time.monotonic())
        self._reading: asyncio.Future[None] | None = None  # the read under way, shared by its callers
        self._state_ok = True
        # (worker_id, epoch) -> when a call to it failed as if it were gone: it gets no traffic until
        # it heartbeats after that (a restarted worker comes back under a new epoch, at once).
        self._down: dict[tuple[str, str], float] = {}
        self.cascade = cascade  # None: no cascade; its config may change between requests (reload)
        if cascade is not None:
            cascade.on_reload = lambda result: self.metrics.cascade_reloads.labels(result).inc()

    @property
    def cascade_config(self) -> CascadeConfig | None:
        return self.cascade.config if self.cascade is not None else None

    # --- state, with the Redis-down fallback ----------------------------------------------------

    def _state_failed(self, what: str, exc: Exception) -> None:
        if self._state_ok:
            log.warning("%s failed (%s); routing on load only with the last known workers until it answers",
                        what, exc)
        self._state_ok = False
        self.metrics.state_up.set(0)

    def _state_answered(self) -> None:
        if not self._state_ok:
            log.info("registry and prefix index answer again; prefix-aware routing resumes")
            self._answered_again_at = time.monotonic()  # a Redis back from an outage may be empty
        self._state_ok = True
        self.metrics.state_up.set(1)

    async def live_workers(self, fresh: bool = False) -> list[WorkerInfo]:
        """The live workers, less those marked down: the last registry read while it is recent
        (see the module's docstring), a new one when ``fresh``. Redis down: the last known ones."""
        age = time.monotonic() - self._read_at
        if fresh or age >= self.config.registry_stale_s:
            await self._read_registry()
        elif age >= self.config.registry_max_age_s and self._reading is None:
            self._reading = asyncio.ensure_future(self._read())  # the next requests get its answer
        return self._without_down(self._last_workers)

    async def _read_registry(self) -> None:
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
        await asyncio.shield(self._reading)  # a caller that is cancelled leaves the read to the others

    async def _read(self) -> None:
        try:
            workers = await self.registry.live_workers()
        except Exception as exc:  # kept, with its time: the next request tries again
            self._state_failed("worker registry", exc)
            return
        finally:
            self._reading = None
        self._state_answered()
        self._last_workers, self._read_at = self._with_recent(workers), time.monotonic()
        self.metrics.workers_live.set(len(workers))
        for w in workers:
            self.metrics.worker_running.labels(w.worker_id).set(w.load.running)
            self.metrics.worker_waiting.labels(w.worker_id).set(w.load.waiting)
            self.metrics.worker_kv_free.labels(w.worker_id).set(w.load.kv_blocks_free)
        self.metrics.worker_speculation.set({w.worker_id: w.load for w in workers})

    def _with_recent(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """``workers`` plus those of the last read that are missing from it but heartbeat within
        ``registry_grace_s`` (by their own clock: the registry's last_seen), or all of those for
        ``registry_grace_s`` after the registry answers again from an outage (the workers could
        not heartbeat into it meanwhile, and re-register at their next heartbeat)."""
        listed = {w.worker_id for w in workers}
        grace = self.config.registry_grace_s
        since = time.time() - grace if time.monotonic() - self._answered_again_at > grace else float("-inf")
        kept = [w for w in self._last_workers if w.worker_id not in listed and w.last_seen >= since]
        if (ids := {w.worker_id for w in kept}) - self._kept:
            log.info("workers %s are missing from the registry but heartbeat %.0f s ago or less: kept until "
                     "they register again", sorted(ids), self.config.registry_grace_s)
        self._kept = ids
        return workers + kept

    async def _workers_of(self, model: str | None) -> list[WorkerInfo]:
        """The live workers, read again when none of them serves ``model`` (one just registered)."""
        workers = await self.live_workers()
        if not workers or (model and all(w.model != model for w in workers)):
            workers = await self.live_workers(fresh=True)
        return workers

    def _without_down(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        listed = {(w.worker_id, w.epoch) for w in workers}
        for key in [k for k in self._down if k not in listed]:
            del self._down[key]  # expired or replaced by a new epoch
        up = []
        for w in workers:
            down_at = self._down.get((w.worker_id, w.epoch))
            if down_at is not None and w.last_seen <= down_at:
                continue
            if down_at is not None:
                log.info("worker %s heartbeats again; sending it requests", w.worker_id)
                del self._down[(w.worker_id, w.epoch)]
            up.append(w)
        return up

    def mark_down(self, worker: WorkerInfo, why: str) -> None:
        """Stop sending to ``worker`` now, not when its registration expires."""
        if (worker.worker_id, worker.epoch) not in self._down:
            log.warning("worker %s (epoch %s) is down (%s): no requests until it heartbeats again",
                        worker.worker_id, worker.epoch, why)
        self._down[(worker.worker_id, worker.epoch)] = time.time()  # live_workers leaves it out

    async def sweep(self) -> list[str]:
        """Drop index entries of workers that are no longer live (they never match, but use memory)."""
        try:
            live = {w.worker_id for w in await self.registry.live_workers()}
            dead = sorted(await self.index.indexed_workers() - live)
            for worker_id in dead:
                await self.index.drop_worker(worker_id)
        except Exception as exc:
            self._state_failed("index sweep", exc)
            return []
        if dead:
            log.info("dropped the prefix-index entries of dead workers %s", dead)
        return dead

    async def run_sweeper(self, interval_s: float = 30.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.sweep()

    async def models(self) -> list[str]:
        served = {w.model for w in await self.live_workers(fresh=True)}
        if (cascade := self.cascade_config) is not None and set(cascade.models) <= served:
            served.add(cascade.name)
        return sorted(served)

    async def context_lengths(self) -> dict[str, int]:
        """Per served model (and the cascade's name), the context length every live worker of it
        accepts: the smallest they registered (a cascade: over its tiers); absent when none said."""
        lengths: dict[str, int] = {}
        for w in await self.live_workers(fresh=True):
            if w.max_model_len:
                lengths[w.model] = min(lengths.get(w.model, w.max_model_len), w.max_model_len)
        cascade = self.cascade_config
        if cascade is not None and all(m in lengths for m in cascade.models):
            lengths[cascade.name] = min(lengths[m] for m in cascade.models)
        return lengths

    async def tokenizer_for(self, model: str | None):
        """(model name, its tokenizer) for a request naming ``model`` (None: the one served, or
        the cascade); a cascade's tiers share one vocabulary, so its first tier's serves."""
        name, pool = await self.serving(model)
        return name, await self.tokenizers.of(pool[0])

    async def serving(self, model: str | None) -> tuple[str, list[WorkerInfo]]:
        """The model name a request naming ``model`` gets (None: the one served, or the cascade)
        and the live workers whose tokenizer reads its prompts (a cascade's: its first tier's)."""
        cascade = self.cascade_config
        workers = await self._workers_of(cascade.tiers[0].model if cascade and model == cascade.name else model)
        if not workers:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no worker is live")
        served = sorted({w.model for w in workers})
        name = model or (cascade.name if cascade else served[0] if len(served) == 1 else "")
        if not name:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"model: name one of the served models {served}")
        source = cascade.tiers[0].model if cascade and name == cascade.name else name
        pool = [w for w in workers if w.model == source]
        if not pool:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"model: unknown model {name!r}; served: {served}")
        return name, pool

    async def ready(self) -> bool:
        return bool(await self.live_workers(fresh=True))

    # --- routing ----------------------------------------------------------------------------------

    async def route(self, request: pb.GenerateRequest) -> tuple[list[int], list[tuple[Candidate, str]]]:
        """The prompt's tokens and the workers to try, best first."""
        workers = await self._workers_of(request.model)
        if not workers:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no worker is live")
        served = sorted({w.model for w in workers})
        model = request.model or (served[0] if len(served) == 1 else "")
        if not model:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"model: name one of the served models {served}")
        pool = [w for w in workers if w.model == model]
        if not pool:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"model: unknown model {model!r}; served: {served}")
        ids = await self._tokenize(await self.tokenizers.of(pool[0]), request, pool)
        block_size = pool[0].block_size
        cached: dict[str, int] = {}
        if self._state_ok or not self._last_workers:
            try:
                hashes = block_hashes(ids, block_size, model)
                held = await self.index.match(model, hashes, {w.worker_id: w.epoch for w in pool})
                cached = {wid: n * block_size for wid, n in held.items()}
            except Exception as exc:
                self._state_failed("prefix index", exc)
        candidates = [Candidate(w, min(cached.get(w.worker_id, 0), len(ids)), self._in_flight[w.worker_id])
                      for w in pool]
        return ids, self.policy.order(candidates, len(ids))

    async def _tokenize(self, tokenizer, request: pb.GenerateRequest, pool: list[WorkerInfo]) -> list[int]:
        """The prompt's token ids, or INVALID_ARGUMENT without tokenizing when its characters alone
        show it is longer than the context: a 15 MiB text would otherwise cost seconds of CPU and
        gigabytes of memory before the worker refused it."""
        context = min((w.max_model_len for w in pool if w.max_model_len), default=0)
        kind = request.WhichOneof("prompt")
        chars = (len(request.text) if kind == "text" else
                 sum(len(m.content) for m in request.messages.messages) if kind == "messages" else 0)
        if context and chars > context:  # else it cannot be the case; the worker checks the rest
            per_token = self._max_token_chars.get(tokenizer)
            if per_token is None:
                per_token = self._max_token_chars[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
            if (least := -(-chars // per_token)) > context:
                raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"prompt: {chars:,} characters are at least {least:,} tokens (a token spells at "
                                  f"most {per_token} here), over the context of {context:,} tokens")
        return await tokenize_async(tokenizer, request, self._requests - 1)

    async def _pool_of(self, model: str) -> list[WorkerInfo]:
        pool = [w for w in await self._workers_of(model) if w.model == model]
        if not pool:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no live worker serves {model!r}")
        return pool

    async def _tokenizer_of(self, model: str):
        return await self.tokenizers.of((await self._pool_of(model))[0])

    async def prompt_ids(self, request: pb.GenerateRequest, model: str, draft_model: str | None = None) -> list[int]:
        """The request's prompt token ids as ``model``'s workers get them; with ``draft_model`` (a
        cascade's judge), refused unless its tokenizer has the same vocabulary, since the draft's
        token ids then go to ``model`` as they are."""
        pool = await self._pool_of(model)
        tokenizer = await self.tokenizers.of(pool[0])
        if draft_model is not None and draft_model != model:
            other = await self._tokenizer_of(draft_model)
            key = (id(tokenizer), id(other))
            if key not in self._same_vocab:
                self._same_vocab[key] = tokenizer is other or tokenizer.get_vocab() == other.get_vocab()
            if not self._same_vocab[key]:
                raise RouterError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"cascade judge: {model!r} and {draft_model!r} have different vocabularies; "
                                  "a tier can only judge drafts of its own model family")
        return await self._tokenize(tokenizer, request, pool)

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one request's answer: through the cascade when it takes the request (a snapshot of
        its configuration, so a reload never changes a request under way), else from the best worker."""
        status = "ok"
        finished = False
        self._requests += 1
        try:
            timeout = timeout if timeout is not None else self.config.default_timeout_s
            plan = cascade_plan(self.cascade_config, request)
            answer = (run_cascade(plan, request, self._answer, self.metrics, timeout, self.prompt_ids)
                      if plan is not None
                      else self._answer(request, timeout))
            # aclosing: a client that leaves cancels the worker call now, not at garbage collection.
            async with contextlib.aclosing(answer) as stream:
                async for msg in stream:
                    finished = bool(msg.finish_reason)
                    yield msg
        except RouterError as err:
            status = err.code.name.lower()
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # A consumer that stops right after the last message has not cancelled anything.
            status = "ok" if finished else "cancelled"
            raise
        finally:
            self._requests -= 1
            self.metrics.requests.labels(status).inc()

    async def _answer(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncIterator[pb.GenerateResponse]:
        """One model's answer from the best worker that takes it."""
        start = time.monotonic()
        ids, order = await self.route(request)
        forward = pb.GenerateRequest()
        forward.CopyFrom(request)
        forward.token_ids.ids[:] = ids  # workers get exactly the tokens that were hashed
        async with contextlib.aclosing(self._stream(forward, order, timeout, start, len(ids))) as stream:
            async for msg in stream:
                yield msg

    async def _stream(self, request, order, timeout, start, prompt_len) -> AsyncIterator[pb.GenerateResponse]:
        """The answer from the first worker in ``order`` that takes it. One that fails before its first
        token is skipped; one that fails (UNAVAILABLE) after it hands the stream to the next, which goes
        on from the prompt plus the tokens already sent (``_resumed``), up to ``max_migrations`` times,
        so the client sees one stream (greedy and seeded answers are the same tokens as without the
        failure)."""
        last_error: RouterError | None = None
        sent: list[int] = []  # tokens of this answer streamed so far, over every worker
        text_sent: list[str] = []
        migrations = 0
        candidates = order[: max(self.config.max_attempts, 1 + self.config.max_migrations)]
        for attempt, (cand, reason) in enumerate(candidates):
            if attempt >= self.config.max_attempts and not sent:
                break
            worker = cand.worker
            remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            resumed = bool(sent)
            call = self.clients.stub(worker.address).Generate(
                self._resumed(request, sent) if resumed else request, timeout=remaining)
            self._in_flight[worker.worker_id] += 1
            first_at = last_at = None
            tokens = 0
            try:
                async for msg in call:
                    now = time.monotonic()
                    if first_at is None:
                        first_at = now
                        if resumed:
                            self.metrics.migrations.labels("resumed").inc()
                        else:
                            msg.prompt_tokens = prompt_len
                            self.metrics.routing.labels(reason).inc()
                            self.metrics.ttft.observe(now - start)
                            if attempt:
                                self.metrics.retries.inc()
                    tokens += len(msg.token_ids)
                    last_at = now
                    sent.extend(msg.token_ids)
                    text_sent.append(msg.text)
                    if msg.finish_reason:
                        msg.worker_id, msg.route_reason = worker.worker_id, "migrated" if resumed else reason
                    if msg.HasField("usage"):
                        if resumed:  # the answer's usage, not the continuation's
                            msg.usage.prompt_tokens = prompt_len
                            msg.usage.cached_tokens = min(msg.usage.cached_tokens, prompt_len)
                            msg.usage.completion_tokens = len(sent)
                        self.metrics.prompt_tokens.inc(msg.usage.prompt_tokens)
                        self.metrics.cached_tokens.inc(msg.usage.cached_tokens)
                        self.metrics.completion_tokens.inc(msg.usage.completion_tokens)
                        self.prompt_tokens_total += msg.usage.prompt_tokens
                        self.cached_tokens_total += msg.usage.cached_tokens
                    yield msg
                if first_at is not None and tokens > 1:
                    self.metrics.tpot.observe((last_at - first_at) / (tokens - 1))
                return
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code == grpc.StatusCode.UNAVAILABLE:  # unreachable, or its engine stopped
                    self.mark_down(worker, err.details() or code.name)
                if sent and code not in _RETRYABLE:  # not the worker's failure (a deadline, a bad request)
                    raise RouterError(code, err.details() or code.name) from None
                if sent:  # tokens went out: go on elsewhere from them, or end the stream
                    why = self._unmovable(request, migrations if first_at is None else migrations + 1)
                    if why is None and attempt + 1 < len(candidates):
                        migrations += first_at is not None  # a continuation that never started is retried
                        log.warning("worker %s failed mid-stream (%s) after %d tokens; the stream goes on on "
                                    "the next worker", worker.worker_id, code.name, len(sent))
                        if (gap := await self._held_back_text(worker, sent, "".join(text_sent))) is not None:
                            text_sent.append(gap.text)
                            yield gap
                        continue
                    self.metrics.migrations.labels("not_moved").inc()
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"worker {worker.worker_id} failed mid-stream: {err.details()}"
                                      + (f" ({why})" if why else " (no other worker to go on)")) from None
                if code in _RETRYABLE:
                    log.warning("worker %s at %s: %s before the first token; trying the next",
                                worker.worker_id, worker.address, code.name)
                    last_error = RouterError(code, f"worker {worker.worker_id}: {err.details()}")
                    continue
                raise RouterError(code, err.details() or code.name) from None
            finally:
                self._in_flight[worker.worker_id] -= 1
                call.cancel()  # no-op when done; frees the worker's blocks when the client left
        if last_error is not None:  # (once tokens went out, the loop ends by returning or raising)
            raise last_error
        raise RouterError(grpc.StatusCode.UNAVAILABLE, "no worker is live")

    def _unmovable(self, request: pb.GenerateRequest, move: int) -> str | None:
        """Why a stream whose worker failed mid-way cannot go on on another worker (as its
        ``move``-th move); None when it can."""
        if move > self.config.max_migrations:
            return f"it was moved {move - 1} time(s), max_migrations {self.config.max_migrations}"
        if request.sampling.stop:
            # The failed worker held back text that might start a stop string; a continuation cannot
            # see a stop string across the break, so it could return one.
            return "stop strings: a continuation could not see one across the break"
        return None

    @staticmethod
    def _resumed(request: pb.GenerateRequest, sent: list[int]) -> pb.GenerateRequest:
        """``request`` going on after ``sent``: the prompt plus them as the new prompt, the token
        budgets less what is spent, seeded draws going on from where they were (``seed_offset``:
        the continuation's first token is the answer's token ``len(sent)``), no prompt logprobs again."""
        out = pb.GenerateRequest()
        out.CopyFrom(request)
        out.token_ids.ids.extend(sent)  # request.token_ids already holds the prompt's ids
        s = out.sampling
        s.seed_offset += len(sent)
        if s.max_tokens:
            s.max_tokens = max(1, s.max_tokens - len(sent))
        s.min_tokens = max(0, s.min_tokens - len(sent))
        s.ClearField("prompt_logprobs")
        s.ClearField("prompt_logprobs_start")
        return out

    async def _held_back_text(self, worker: WorkerInfo, sent: list[int], text: str) -> pb.GenerateResponse | None:
        """Text of ``sent`` the failed worker had not sent yet (held back as half a character), as a
        message of its own; the next worker reads only its own tokens' text."""
        try:
            full = (await self.tokenizers.of(worker)).decode(sent, skip_special_tokens=True)
        except Exception:  # no tokenizer for it (a dummy model): nothing to add
            return None
        if not full.startswith(text) or full == text or full.endswith("\ufffd"):
            return None
        return pb.GenerateResponse(text=full[len(text):])

    async def load_tokenizers(self) -> int:
        """Load the tokenizers of the workers registered now (a router, or one of its HTTP front
        processes, started while workers are up), so the first requests do not wait seconds for
        them; returns how many are loaded. One that fails is left to its first request to report."""
        for worker in await self.live_workers(fresh=True):
            try:
                await self.tokenizers.of(worker)
            except Exception as exc:
                log.warning("tokenizer of worker %s (%s) not loaded: %r", worker.worker_id, worker.model, exc)
        return len(self.tokenizers)

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        await self.clients.close()
