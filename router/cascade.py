"""The cascade: answer with the first tier, escalate to the next while it is unsure.

    request -> plan (cascade? pinned tier? opted out?) -> tier 1's prompt router (``route``):
               unlikely to answer right -> skip to the next tier before it runs
            -> tier 1 with logprobs, held back
            -> confidence over its window (``measure: stacked``: over the prompt's text too)
                                          -> accept: release what was held, stream the rest
                                          -> unsure, with a judge: the next tier scores the draft
                                             in one prefill (its prompt logprobs) -> accept | escalate
                                          -> escalate: cancel it, next tier ... the last answers

The invariant the client relies on: it never sees a token of a tier that was thrown away. A
trial tier's messages are buffered until the decision (``full``: when it finishes; ``early``:
after its first ``window`` tokens) and only then released, so no message of an escalated tier
ever leaves this module. Messages carry ``tier`` and ``escalated``; the last also ``confidence``.

The judge (a tier's ``judge``) reads the draft as the next tier's model would have written it:
the request's prompt in that model's tokenization followed by the draft's token ids, one prefill
with ``prompt_logprobs`` from the draft's first token and a single generated token. Its prompt's
KV blocks stay in that worker's prefix cache, so an escalation after a rejection routes there
and skips that prefill. The draft's ids only mean the same text under one vocabulary: the router
refuses a judge across two (``PromptIds``).

Cost accounting: the last message carries ``tier_usage``, every tier's prompt, cached and
generated tokens for the request (trials thrown away and judging included), and the metrics
count the same (``kvcascade_cascade_usage_tokens``).

Which requests cascade (``plan``): those naming no model or the cascade's name. ``tier`` pins one
tier (no escalation); ``cascade: CASCADE_OFF`` on such a request goes to the last tier unjudged,
like a request naming a model, which goes to that model as without a cascade.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from protos import kvcascade_pb2 as pb
from router.cascade_config import CascadeConfig, TierConfig
from router.errors import RouterError
from router.metrics import RouterMetrics

# Answers one request through the normal routing path (Router._answer).
Answerer = Callable[[pb.GenerateRequest, float | None], AsyncIterator[pb.GenerateResponse]]
# The request's prompt token ids for a model (Router.prompt_ids); with ``draft_model``, refuses
# (FAILED_PRECONDITION) when that model's vocabulary differs.
PromptIds = Callable[[pb.GenerateRequest, str, str | None], Awaitable[list[int]]]
# A trial tier failing with these before any output is skipped: the next tier may be up.
_SKIPPABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass(frozen=True)
class Plan:
    config: CascadeConfig
    tiers: tuple[TierConfig, ...]  # tried in order; the last answers unjudged
    report: bool  # tag messages with tier, escalated, confidence


def plan(config: CascadeConfig | None, request: pb.GenerateRequest) -> Plan | None:
    """How the cascade takes this request; None: route it as if there were no cascade."""
    if config is None:
        if request.tier:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "tier: this router has no cascade configured")
        return None
    if request.tier:
        tier = config.tier(request.tier)
        if tier is None:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"tier: unknown tier {request.tier!r}; tiers: {[t.name for t in config.tiers]}")
        return Plan(config, (tier,), report=True)
    if request.model not in ("", config.name):
        return None
    if request.cascade == pb.CASCADE_OFF:
        return Plan(config, config.tiers[-1:], report=False)
    return Plan(config, config.tiers, report=True)


class _Trial:
    """What one tier produced so far: its messages (held back), logprobs and token count."""

    def __init__(self, tier: TierConfig, prompt: str | None = None):
        self.tier = tier
        self.measure = tier.create_measure(prompt)  # (the stacked measure also reads the prompt)
        self.messages: list[pb.GenerateResponse] = []
        self.logprobs: list[pb.TokenLogprob] = []
        self.token_ids: list[int] = []
        self.usage: pb.Usage | None = None  # the worker's, on its last message
        self.started = time.monotonic()

    def add(self, msg: pb.GenerateResponse) -> None:
        self.logprobs.extend(msg.logprobs)
        self.token_ids.extend(msg.token_ids)
        if msg.HasField("usage"):
            self.usage = msg.usage

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def confidence(self) -> float | None:
        """The measure over the window; None when the tier produced no token."""
        window = self.logprobs[: self.tier.window] if self.tier.window else self.logprobs
        return self.measure.score(window) if window else None

    @property
    def text(self) -> str:
        return "".join(m.text for m in self.messages)


class CascadeRun:
    """One request through a plan."""

    def __init__(self, plan: Plan, request: pb.GenerateRequest, answer: Answerer, metrics: RouterMetrics,
                 timeout: float | None, prompt_ids: PromptIds | None = None):
        self.plan, self.request, self.answer, self.metrics = plan, request, answer, metrics
        self.prompt_ids = prompt_ids
        self.usage: list[pb.TierUsage] = []  # every tier's tokens so far (tier_usage)
        self.judge_score: float | None = None  # the last judge's
        self.deadline = None if timeout is None else time.monotonic() + timeout
        sampling = request.sampling
        self.client_logprobs = sampling.logprobs if sampling.HasField("logprobs") else None
        self.client_max = sampling.max_tokens if sampling.HasField("max_tokens") else None

    def _remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def _tier_request(self, tier: TierConfig, final: bool, draft: str | None) -> pb.GenerateRequest:
        req = pb.GenerateRequest()
        req.CopyFrom(self.request)
        req.model = tier.model
        req.ClearField("cascade")
        req.ClearField("tier")
        wanted = max(self.client_logprobs or 0, tier.create_measure().top_logprobs)
        if self.plan.report or self.client_logprobs is not None:
            req.sampling.logprobs = wanted
        if not final and self.plan.config.mode == "full" and tier.max_tokens is not None \
                and self.client_max is not None and (self.client_max == 0 or tier.max_tokens < self.client_max):
            req.sampling.max_tokens = tier.max_tokens  # (a client max of 0: until the context ends)
        if draft is not None and not self.plan.config.original_prompt_only:
            _append_draft(req, draft, self.plan.config.review_prompt)
        return req

    def _release(self, msg: pb.GenerateResponse, tier: TierConfig, escalated: bool) -> pb.GenerateResponse:
        """The message as the client sees it: logprobs as it asked, cascade fields when reporting."""
        if self.client_logprobs is None:
            del msg.logprobs[:]
        else:
            for lp in msg.logprobs:
                del lp.top[self.client_logprobs:]
        if self.plan.report:
            msg.tier, msg.escalated = tier.name, escalated
        return msg

    async def run(self) -> AsyncIterator[pb.GenerateResponse]:
        draft: str | None = None
        for i, tier in enumerate(self.plan.tiers):
            final = i == len(self.plan.tiers) - 1
            escalated = i > 0
            if not final and tier.route is not None and tier.route.skips(prompt_text(self.request)):
                self.metrics.cascade_decisions.labels(tier.name, "skip").inc()
                self.metrics.cascade_escalations.labels(tier.name, "route").inc()
                continue  # costs nothing: the tier never ran
            trial = _Trial(tier, prompt_text(self.request))
            stream = self.answer(self._tier_request(tier, final, draft), self._remaining())
            async with contextlib.aclosing(stream):
                if final:
                    async for msg in stream:
                        trial.add(msg)
                        if msg.finish_reason:
                            self._finish_message(msg, trial, trial.confidence() or 0.0)
                        yield self._release(msg, tier, escalated)
                    self._answered(trial, escalated)
                    return
                try:
                    reason = await self._judge(trial, stream, self.plan.tiers[i + 1])
                except RouterError as err:
                    if err.code not in _SKIPPABLE:
                        raise
                    reason = "unavailable"
                if reason is None:
                    self.metrics.cascade_decisions.labels(tier.name, "accept").inc()
                    confidence = trial.confidence()
                    for msg in trial.messages:
                        if msg.finish_reason:
                            self._finish_message(msg, trial, confidence)
                        yield self._release(msg, tier, escalated)
                    # early mode: the rest of an accepted tier streams straight through.
                    async for msg in stream:
                        trial.add(msg)
                        if msg.finish_reason:
                            self._finish_message(msg, trial, confidence)
                        yield self._release(msg, tier, escalated)
                    self._answered(trial, escalated)
                    return
            # The stream is closed: the worker call is cancelled and its KV blocks freed.
            await self._escalated(trial, reason)
            draft = trial.text

    async def _judge(self, trial: _Trial, stream: AsyncIterator[pb.GenerateResponse],
                     next_tier: TierConfig) -> str | None:
        """Hold the tier's messages until it can be judged; None: accepted, else why it escalates."""
        tier, early = trial.tier, self.plan.config.mode == "early"
        async for msg in stream:
            trial.messages.append(msg)
            trial.add(msg)
            if msg.finish_reason or (early and len(trial.logprobs) >= tier.window):
                break
        last = trial.messages[-1] if trial.messages else None
        if last is None or last.finish_reason in ("error", "abort"):
            return "error"
        if last.finish_reason == "length" and self.client_max is not None \
                and (self.client_max == 0 or last.usage.completion_tokens < self.client_max):
            return "limit"  # the trial's own cap, not the client's, ended it
        confidence = trial.confidence()
        self.metrics.cascade_confidence.labels(tier.name).observe(confidence if confidence is not None else 0.0)
        if confidence is None:
            return "confidence"
        if tier.accepts(confidence):
            return None
        if not tier.judged(confidence) or not trial.token_ids:
            return "confidence"
        return await self._ask_judge(trial, next_tier)

    async def _ask_judge(self, trial: _Trial, judge_tier: TierConfig) -> str | None:
        """The next tier scores the draft in one prefill (module docstring); None: it agrees."""
        judge, name = trial.tier.judge, trial.tier.name
        if self.prompt_ids is None:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, f"tiers[{name}].judge: this router cannot judge")
        prompt = await self.prompt_ids(self.request, judge_tier.model, trial.tier.model)
        req = pb.GenerateRequest(model=judge_tier.model)
        if self.request.request_id:
            req.request_id = f"{self.request.request_id}/judge"
        req.token_ids.ids[:] = prompt + trial.token_ids
        req.sampling.max_tokens = 1
        req.sampling.temperature = 0.0
        measure = judge.create_measure()
        req.sampling.prompt_logprobs = measure.top_logprobs
        req.sampling.prompt_logprobs_start = len(prompt)
        scored: list[pb.TokenLogprob] = []
        usage = None
        async with contextlib.aclosing(self.answer(req, self._remaining())) as stream:
            async for msg in stream:
                scored.extend(msg.prompt_logprobs)
                if msg.HasField("usage"):
                    usage = msg.usage
        self._count(judge_tier, "judge", usage)
        score = measure.score(scored) if scored else None
        self.judge_score = score
        accepted = score is not None and judge.accepts(score)
        self.metrics.cascade_judgements.labels(name, "accept" if accepted else "reject").inc()
        if score is not None:
            self.metrics.cascade_judge_score.labels(name).observe(score)
        return None if accepted else "judge"

    def _count(self, tier: TierConfig, role: str, usage: pb.Usage | None, completion: int | None = None,
               prompt: int = 0) -> pb.TierUsage:
        """Record what ``tier`` computed for this request (tier_usage and the metrics)."""
        entry = pb.TierUsage(tier=tier.name, model=tier.model, role=role,
                             prompt_tokens=usage.prompt_tokens if usage is not None else prompt,
                             cached_tokens=usage.cached_tokens if usage is not None else 0,
                             completion_tokens=usage.completion_tokens if completion is None else completion)
        self.usage.append(entry)
        tokens = self.metrics.cascade_usage_tokens
        tokens.labels(tier.name, role, "prompt").inc(entry.prompt_tokens)
        tokens.labels(tier.name, role, "cached").inc(entry.cached_tokens)
        tokens.labels(tier.name, role, "completion").inc(entry.completion_tokens)
        return entry

    def _finish_message(self, msg: pb.GenerateResponse, trial: _Trial, confidence: float | None) -> None:
        """The answer's last message: its confidence and, when reporting, every tier's usage."""
        self._count(trial.tier, "answer", trial.usage, completion=trial.tokens)
        if self.plan.report:
            msg.confidence = confidence or 0.0
            msg.tier_usage.extend(self.usage)
            if self.judge_score is not None:
                msg.judge_score = self.judge_score

    def _answered(self, trial: _Trial, escalated: bool) -> None:
        m, name = self.metrics, trial.tier.name
        m.cascade_answers.labels(name, str(escalated).lower()).inc()
        m.cascade_tokens.labels(name, "kept").inc(trial.tokens)
        m.cascade_tier_seconds.labels(name).observe(time.monotonic() - trial.started)

    async def _escalated(self, trial: _Trial, reason: str) -> None:
        m, name = self.metrics, trial.tier.name
        m.cascade_decisions.labels(name, "escalate").inc()
        m.cascade_escalations.labels(name, reason).inc()
        m.cascade_tokens.labels(name, "discarded").inc(trial.tokens)
        m.cascade_tier_seconds.labels(name).observe(time.monotonic() - trial.started)
        prompt = 0
        if trial.usage is None and trial.tokens and self.prompt_ids is not None:
            # Cancelled mid-answer (early mode, a trial's cap): the worker never reported usage.
            with contextlib.suppress(RouterError):
                prompt = len(await self.prompt_ids(self.request, trial.tier.model, None))
        self._count(trial.tier, "trial", trial.usage, completion=trial.tokens, prompt=prompt)


def prompt_text(req: pb.GenerateRequest) -> str | None:
    """What a prompt router reads: the last user message, or the text prompt; None for token ids."""
    kind = req.WhichOneof("prompt")
    if kind == "messages":
        return next((m.content for m in reversed(req.messages.messages) if m.role == "user"), None)
    return req.text if kind == "text" else None


def _append_draft(req: pb.GenerateRequest, draft: str, review_prompt: str) -> None:
    """Show the escalated tier the draft it replaces (original_prompt_only: false)."""
    kind = req.WhichOneof("prompt")
    if kind == "messages":
        req.messages.messages.add(role="assistant", content=draft)
        req.messages.messages.add(role="user", content=review_prompt)
    elif kind == "text":
        req.text = f"{req.text}{draft}\n\n{review_prompt}\n\n"
    # token ids: the router cannot know the client's text format; the prompt stays as it is.


def run_cascade(plan_: Plan, request: pb.GenerateRequest, answer: Answerer, metrics: RouterMetrics,
                timeout: float | None, prompt_ids: PromptIds | None = None) -> AsyncIterator[pb.GenerateResponse]:
    return CascadeRun(plan_, request, answer, metrics, timeout, prompt_ids).run()
