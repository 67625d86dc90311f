"""The engine: add requests, step, get outputs. Synchronous and single-threaded by design.

    batch, overflow = scheduler.schedule()
    sampled = model_runner.run(batch)
    outputs = postprocess(batch, sampled)

The lookahead (``async_scheduling``, on for CUDA): the host never waits for the device between
steps. Step N is launched and left unread, and the scheduler is told it is done: its sequences'
computed tokens advance, and each one it samples gains a *pending* token (sampled on the device,
not yet read). The next call schedules step N+1 as usual (decodes, prefill chunks, admissions),
a sequence whose next input is its pending token taking it on the device; launches N+1; and only
then reads N's tokens and post-processes them:

    host:    launch N | schedule+launch N+1, read N, postprocess N | schedule+launch N+2, read N+1 ...
    device:  ..... N ..........|............ N+1 ..................|............ N+2 .........

A sequence whose pending token is its last by length is left out of N+1. One that N's token
finishes otherwise (EOS, a stop string) was computed once more in N+1 for nothing; that result is
dropped (its blocks are already freed, and a block freed while N+1 runs is only handed out by a
later schedule, whose step the device runs after N+1). A step whose sampled rows want logprobs takes
the plain path (scheduled, then run once N's tokens are in). One with structured outputs, whose
masks for N+1 need N's tokens in the matchers, looks ahead in two parts: N+1's forward is
launched before N is read, and its sampling (masks filled on the host meanwhile) once N's tokens
are in:

    host:    schedule+launch forward N+1, read N, postprocess N (matchers take N), masks, sample N+1
    device:  ... N ...|...... forward N+1 ......................................|sample N+1|

AsyncEngine (async_engine.py) drives it from a background thread for servers.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from worker.distributed.group import get_tp
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import take_text_delta, update_text
from worker.engine.errors import InvalidRequestError
from worker.engine.input_processor import InputProcessor
from worker.engine.model_runner import (DTYPES, ModelRunner, PendingTokens, cuda_kv_blocks, kv_bytes_per_block,
                                       kv_storage_dtype)
from worker.engine.outputs import EngineStats, RequestOutput, Usage
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledSeq, Scheduler
from worker.engine.sequence import Sequence
from worker.engine.speculative import SpecStats, make_ngram_drafter
from worker.engine.draft_model import DraftModelDrafter, load_draft
from worker.engine.structured_output import Grammars
from worker.models.backends import create_attention_backend
from worker.models.llama import LlamaForCausalLM
from worker.models.config import ModelConfig
from contracts.models import resolve_model
from contracts.tokenizers import load_tokenizer
from worker.models.loader import iter_dummy_weights, iter_weights, load_config
from worker.models.quantization import quant_plan, weight_bytes

log = logging.getLogger(__name__)

SPEC_MISSES_BEFORE_BACKOFF = 3  # fully rejected drafts in a row before a sequence sits drafting out
MAX_SPEC_BACKOFF = 16  # steps it sits out at most


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, model: LlamaForCausalLM | None = None):
        """``tokenizer`` and ``model`` reuse ones already loaded for the same ``config.model``
        (the model holds no per-engine state: the KV pool is the runner's)."""
        self.config = config
        source = resolve_model(config.model)
        self.model_id = source.model_id
        self.model_config = load_config(source)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source, config.tokenizer)
        self.max_model_len = _max_model_len(config, self.model_config)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.speculative = config.speculative_config
        draft = None
        if self.speculative is not None and self.speculative.method == "draft":
            # loaded first: on CUDA the pool is sized by what the weights of both leave
            draft = load_draft(config, self.speculative, self.tokenizer, self.model_config, build_model)
        self.runner = build_runner(config, source, self.model_config, model,
                                   extra_bytes_per_block=draft.bytes_per_block if draft else 0)
        self.model = self.runner.model
        num_blocks = self.runner.num_blocks
        self.max_model_len = _fit_to_pool(config, self.max_model_len, num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, self.model_id, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.inputs = InputProcessor(self.model_id, self.tokenizer, self.max_model_len, self.model_config.vocab_size)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids, warm=True)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._inflight: _InFlight | None = None  # the lookahead's launched, unread step
        self.drafter = None
        if draft is not None:
            self.drafter = DraftModelDrafter(draft.runner(self.runner.num_blocks, self.max_model_len))
        elif self.speculative is not None:
            self.drafter = make_ngram_drafter(self.speculative)
        self.spec_stats = SpecStats()
        if config.freeze_gc:
            # What start-up built lives as long as the process serves: move it to the permanent
            # generation, so the full collections that the step loop's short-lived objects
            # trigger walk only what is new. Unfrozen, one such pass over torch's objects took
            # tens of ms on the H100 host: a decode step the device spent waiting.
            gc.collect()
            gc.freeze()
        if config.kv_cache_dtype == "fp8" and self.model_config.qkv_bias:
            log.warning("kv_cache_dtype fp8 on a model with biased keys (%s): measured on Qwen2.5-Coder-1.5B, "
                        "perplexity x3.4 (int8: +4.4%%); prefer int8 (docs/BENCHMARKS.md)", self.model_id)
        log.info("engine ready: model=%s blocks=%d x %d tokens (KV cache %s), max_model_len=%d",
                 self.model_id, num_blocks, config.block_size, str(self.runner.kv_dtype).removeprefix("torch."),
                 self.max_model_len)

    # --- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                 tools: list[dict] | None = None) -> list[int]:
        """Prompt text or chat messages (and their tools) to token ids, as the router does too."""
        return self.inputs.tokenize(prompt, messages, tools)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse what can never run; safe to call from any thread (reads only configuration)."""
        self.inputs.validate(prompt_token_ids, params)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        self.validate(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if params.structured_output is not None:
            # A continuation (seed_offset: the answer's tokens so far end its prompt) resumes the grammar.
            so_far = prompt_token_ids[len(prompt_token_ids) - params.seed_offset:] if params.seed_offset else []
            seq.matcher = self.grammars.matcher(params.structured_output, so_far)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; its final output when it was in flight."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        seq.matcher = None
        return self._final_output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # --- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self._inflight is not None:
            return self._step_ahead()
        batch, overflow = self.scheduler.schedule(drafts=self._propose() if self.drafter is not None else None)
        outputs = [self._finish(seq, "length") for seq in overflow]
        if not batch:
            return outputs
        if self._can_look_ahead(batch):
            try:
                self._launch(batch)
                return outputs
            except Exception as exc:
                return outputs + self._fail(batch, exc)
        return outputs + self._run_plain(batch)

    def _run_plain(self, batch: list[ScheduledSeq]) -> list[RequestOutput]:
        try:
            draft_probs = self.drafter.fill(batch) if self.drafter is not None else None
            sampled, prompt = self.runner.run(batch, draft_probs)
        except Exception as exc:  # a failed step fails its batch, never the engine...
            if self.runner.tp.size > 1:
                # ...except under tensor parallelism: the ranks may now disagree on where they are
                # in the step's collectives, and only a restart of all of them is safe.
                raise
            return self._fail(batch, exc)
        return self._postprocess(batch, sampled, prompt=prompt)

    def _fail(self, batch: list[ScheduledSeq], exc: Exception) -> list[RequestOutput]:
        log.error("step failed; failing its %d requests", len(batch), exc_info=exc)
        return [self._finish(item.seq, "error", error=f"{type(exc).__name__}: {exc}")
                for item in batch if not item.seq.finished]

    # --- the lookahead (module docstring) ----------------------------------------------------

    def _can_look_ahead(self, batch: list[ScheduledSeq]) -> bool:
        return (self.config.async_scheduling and self.drafter is None
                and all(it.seq.params.logprobs is None for it in batch if it.samples)
                and not any(_wants_prompt_logprobs(it.seq) for it in batch))

    def _launch(self, batch: list[ScheduledSeq], prev: _InFlight | None = None) -> None:
        """Launch ``batch`` unread and advance its sequences as if it had run (module docstring)."""
        prev_index = None
        if prev is not None:
            prev_index = {id(it.seq): i for i, it in enumerate(it for it in prev.batch if it.samples)}
        samplers = [it.seq for it in batch if it.samples]
        inputs = self.runner.prepare(batch, prev_index)
        if prev is not None and any(seq.matcher is not None for seq in samplers):
            # Structured outputs: the forward now, the sampling once prev's tokens are in the matchers.
            self._inflight = _InFlight(batch, None, self.runner.forward_ahead(inputs, prev.tokens.device), samplers)
        else:
            tokens = self.runner.launch(inputs, samplers, prev.tokens.device if prev is not None else None)
            self._inflight = _InFlight(batch, tokens)
        for it in batch:
            # Blocks whose tokens are all known can be found by the next schedule already: any
            # step that reads them runs on the device after this one has written them.
            self._advance(it)
            if it.samples:
                it.seq.num_pending_tokens += 1

    def _advance(self, item: ScheduledSeq) -> None:
        """The step computed ``item``'s new tokens: count them and cache the blocks they fill."""
        item.seq.num_computed_tokens += item.num_new_tokens
        self.block_manager.cache_full_blocks(item.seq)

    def _ends_by_length(self, seq: Sequence, pending: int = 0) -> bool:
        """``seq`` is done by length once it holds ``pending`` more tokens than are known."""
        limit = seq.params.max_tokens
        return ((limit is not None and seq.num_output_tokens + pending >= limit)
                or len(seq.token_ids) + pending >= self.max_model_len)

    def _last_token_pending(self, seq: Sequence) -> bool:
        """The token in flight ends ``seq`` by length: nothing to schedule after it."""
        return seq.num_pending_tokens > 0 and self._ends_by_length(seq, seq.num_pending_tokens)

    def _step_ahead(self) -> list[RequestOutput]:
        current, self._inflight = self._inflight, None
        outputs: list[RequestOutput] = []
        batch: list[ScheduledSeq] = []
        try:
            skip = frozenset(id(it.seq) for it in current.batch if self._last_token_pending(it.seq))
            batch, overflow = self.scheduler.schedule(skip)
            outputs = [self._finish(seq, "length") for seq in overflow]
            if batch and self._can_look_ahead(batch):
                self._launch(batch, current)
                batch = []
            tokens = current.tokens.tolist()  # waits for step N only: N+1 is queued behind it
        except Exception as exc:
            launched, self._inflight = self._inflight, None
            return outputs + self._fail(current.batch + batch + (launched.batch if launched else []), exc)
        it = iter(tokens)
        outputs += self._postprocess(current.batch, [(next(it), None) if item.samples else None
                                                     for item in current.batch], looked_ahead=True)
        launched = self._inflight
        if launched is not None and launched.tokens is None:  # its sampling waited for these tokens
            try:
                launched.tokens = self.runner.sample_launched(launched.logits, launched.samplers)
                launched.logits = launched.samplers = None
            except Exception as exc:
                self._inflight = None
                outputs += self._fail(launched.batch, exc)
        if batch:  # scheduled, not launched (logprobs wanted): a plain step, now that N's tokens are in
            batch = [item for item in batch if not item.seq.finished]
            if batch:
                outputs += self._run_plain(batch)
        return outputs

    # --- speculative decoding (speculative.py) ---------------------------------------------------

    def _propose(self) -> dict[int, list[int]]:
        """Drafts for the running sequences in plain decode: id(seq) -> up to k tokens, never more
        than the request's max_tokens or the context can still take after the target's own token."""
        drafts: dict[int, list[int]] = {}
        limit = self.config.speculative_max_batch
        if limit is not None and len(self.scheduler.running) > limit:
            return drafts
        for seq in self.scheduler.running:
            if not self._may_speculate(seq):
                continue
            if seq.spec_skip:  # backing off after a fully rejected draft
                seq.spec_skip -= 1
                continue
            room = self.max_model_len - len(seq.token_ids) - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            k = min(self.speculative.num_tokens, room)
            if k > 0 and (draft := self.drafter.propose(seq, k)):
                drafts[id(seq)] = draft
        return drafts

    def _may_speculate(self, seq: Sequence) -> bool:
        p = seq.params
        return (p.speculative and seq.num_tokens - seq.num_computed_tokens == 1 and not seq.num_pending_tokens
                and seq.matcher is None and seq.num_output_tokens >= p.min_tokens
                and not _wants_prompt_logprobs(seq))

    def _accept(self, item: ScheduledSeq, emitted: list) -> RequestOutput:
        """Apply a verification: the accepted drafts' KV stays (the rest is beyond the computed
        tokens, its blocks returned), and the emitted tokens are taken one by one, stopping where
        one ends the request."""
        seq = item.seq
        accepted = len(emitted) - 1
        self.spec_stats.record(len(item.draft), accepted)
        # Drafts rejected outright, again and again, cost their rows for nothing: from the third
        # such step in a row, sit out 1, 2, 4 .. steps (drafts that do not match this answer stop
        # costing); a hit ends it. (Sporadic misses are cheap: a verify step costs ~1.1 decodes.)
        seq.spec_misses = seq.spec_misses + 1 if accepted == 0 else 0
        if seq.spec_misses >= SPEC_MISSES_BEFORE_BACKOFF:
            seq.spec_skip = min(2 ** (seq.spec_misses - SPEC_MISSES_BEFORE_BACKOFF), MAX_SPEC_BACKOFF)
        seq.num_computed_tokens += item.num_new_tokens - len(item.draft) + accepted
        for token, logprob in emitted:
            reason = self._take(seq, token, logprob)
            if reason is not None:
                return self._finish(seq, reason, error=seq.error)
        self.block_manager.trim(seq, seq.num_tokens)
        self.block_manager.cache_full_blocks(seq)
        return self._make_output(seq)

    def _take(self, seq: Sequence, token: int, logprob) -> str | None:
        """Append one sampled token; why it ends the request, if it does."""
        seq.token_ids.append(token)
        seq.pending_token_ids.append(token)
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        return self._stop_reason(seq, token)

    def _postprocess(self, batch: list[ScheduledSeq], sampled, looked_ahead: bool = False,
                     prompt: list | None = None) -> list[RequestOutput]:
        """Apply a step's results. ``looked_ahead``: the step was launched by the lookahead, which
        advanced its sequences already; its sampled tokens are their pending ones. ``prompt``: the
        prompt logprobs the step computed, per scheduled sequence."""
        outputs = []
        for i, (item, result) in enumerate(zip(batch, sampled)):
            seq = item.seq
            if seq.finished:  # aborted, or finished by the step before (a lookahead step's extra)
                continue
            if prompt is not None:
                seq.prompt_logprobs += prompt[i]
            if item.draft:
                outputs.append(self._accept(item, result))
                continue
            if not looked_ahead:
                self._advance(item)
            if result is None:
                continue
            if looked_ahead:
                seq.num_pending_tokens -= 1
            reason = self._take(seq, *result)
            if reason is not None:
                outputs.append(self._finish(seq, reason, error=seq.error))
            else:
                outputs.append(self._make_output(seq))
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        hit_stop_string = p.detokenize and self.tokenizer is not None and update_text(seq, self.tokenizer)
        if hit_stop_string or token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):  # the mask allowed only what it takes: a bug
                seq.error = f"structured output: token {token} refused: {seq.matcher.get_error()[:300]}"
                log.error("%s: %s", seq.request_id, seq.error)
                return "error"
            if seq.matcher.is_stopped():  # the answer is complete and nothing may follow
                return "stop"
        if self._ends_by_length(seq):
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.request_id, None)
        seq.error = error
        seq.matcher = None
        return self._final_output(seq)

    def _make_output(self, seq: Sequence) -> RequestOutput:
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.pending_token_ids,
            text_delta=take_text_delta(seq, seq.finished),
            logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            finished=seq.finished,
        )
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            out.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        seq.pending_token_ids, seq.pending_logprobs = [], []
        return out

    def _final_output(self, seq: Sequence) -> RequestOutput:
        out = self._make_output(seq)
        out.finish_reason = seq.finish_reason
        out.error = seq.error
        out.usage = Usage(seq.num_prompt_tokens, seq.num_cached_tokens or 0, seq.num_output_tokens)
        if seq.first_token_time is not None:
            out.ttft_s = seq.first_token_time - seq.arrival_time
        return out

    # --- conveniences ----------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts (token ids) to completion in one batch; the output token ids of each."""
        return [tokens for tokens, _ in self.generate_logprobs(prompts, params)]

    def generate_logprobs(self, prompts: list[list[int]],
                          params: SamplingParams | list[SamplingParams]) -> list[tuple[list[int], list[float]]]:
        """``generate``, with the logprob of each output token (empty where ``params.logprobs`` is None)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        runs: dict[str, tuple[list[int], list[float]]] = {i: ([], []) for i in ids}
        while self.has_unfinished():
            for out in self.step():
                tokens, logprobs = runs[out.request_id]
                tokens.extend(out.new_token_ids)
                logprobs.extend(e.logprob for e in out.logprobs or [])
        return [runs[i] for i in ids]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks, kv_blocks_used=bm.num_used_blocks,
            prefix_queries=bm.prefix_queries, prefix_hits=bm.prefix_hits, block_size=bm.block_size,
            pending_prefill_tokens=sum(s.num_prefill_pending for s in self.requests.values()),
            spec_drafted=self.spec_stats.drafted, spec_accepted=self.spec_stats.accepted,
            spec_verifications=self.spec_stats.verifications,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def close(self) -> None:
        """Release the other tensor-parallel ranks (they leave their step loop); the engine takes
        no more steps. Called from the thread that steps it."""
        self.runner.close()


def build_model(config: EngineConfig, source, model_cfg: ModelConfig) -> LlamaForCausalLM:
    """This rank's part of the model, on the device in the serving dtype, weights loaded one full
    tensor at a time (each parameter keeps its own shard)."""
    dtype = DTYPES[config.dtype]
    # Parameters are created in the serving dtype on the device (no full-size fp32 copy);
    # the rotary tables ask for float32 explicitly and stay so.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    plan = quant_plan(config.quantization, config.quantization_group_size, source, model_cfg.num_layers,
                      model_cfg.tie_word_embeddings)
    try:
        with torch.device(config.device):
            model = LlamaForCausalLM(model_cfg, plan)
    finally:
        torch.set_default_dtype(default_dtype)
    if source.kind == "dummy":
        model.load_weights(iter_dummy_weights(model_cfg, config.seed, config.device, dtype))
    else:
        # Packed checkpoint tensors go to packed projections as they are (float ones dequantize them).
        model.load_weights(iter_weights(source, packed=plan is not None))
    if plan is not None:
        log.info("weights quantized (%s): %.2f GiB on the device", config.quantization,
                 weight_bytes(model) / 2**30)
    return model


@dataclass
class _InFlight:
    batch: list[ScheduledSeq]
    tokens: PendingTokens | None  # its tokens, one per sequence, not yet read (None: not sampled yet)
    logits: torch.Tensor | None = None  # until sampled: the sampled rows' logits, and their sequences
    samplers: list[Sequence] | None = None


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    """Prompt logprobs still to compute: the step takes the plain path, which reads them."""
    return seq.params.prompt_logprobs is not None and seq.prompt_logprobs_next < seq.num_prompt_tokens


def _fit_to_pool(config: EngineConfig, max_model_len: int, num_blocks: int) -> int:
    """The context length the engine advertises: every request it accepts can run alone, so a
    pool smaller than the model's context caps it (said at start-up); a --max-model-len the pool
    cannot hold is refused."""
    fits = num_blocks * config.block_size
    if max_model_len <= fits:
        return max_model_len
    if config.max_model_len is not None:
        raise ValueError(f"max_model_len={config.max_model_len} does not fit the KV pool ({num_blocks} blocks, "
                         f"{fits} tokens): give it more memory (kv_cache_bytes, gpu_memory_utilization) or "
                         f"a max_model_len <= {fits}")
    log.warning("max_model_len %d -> %d: the KV pool (%d blocks of %d) holds no longer request; more memory "
                "(kv_cache_bytes, gpu_memory_utilization) raises it", max_model_len, fits, num_blocks,
                config.block_size)
    return fits


def _max_model_len(config: EngineConfig, model_cfg: ModelConfig) -> int:
    return min(config.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)


def build_runner(config: EngineConfig, source, model_cfg: ModelConfig,
                 model: LlamaForCausalLM | None = None, extra_bytes_per_block: int = 0) -> ModelRunner:
    """This rank's model and KV pool. Every rank of a tensor-parallel worker calls it (rank 0 from
    LLMEngine, the others from ``follow``) and meets the others in the same collectives.
    ``extra_bytes_per_block``: what a block also costs elsewhere (a draft model's KV)."""
    tp = get_tp()
    if tp.size != config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} but this process is rank "
                         f"{tp.rank} of {tp.size}: start the ranks with worker.distributed.ranks")
    if model is None:
        model = build_model(config, source, model_cfg)
    model = model.eval()
    backend = create_attention_backend(config.attention_backend)
    max_model_len = _max_model_len(config, model_cfg)
    num_blocks = kv_block_count(config, model_cfg, model, backend, max_model_len, extra_bytes_per_block)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no KV block of this model")
    return ModelRunner(config, model_cfg, model, backend, num_blocks, max_model_len)


def follow(config: EngineConfig) -> None:
    """The life of a tensor-parallel rank > 0 (its group already joined): load its shard, then run
    the steps rank 0 broadcasts until rank 0 closes its engine."""
    source = resolve_model(config.model)
    runner = build_runner(config, source, load_config(source))
    log.info("rank %d of %d ready: %d KV blocks", runner.tp.rank, runner.tp.size, runner.num_blocks)
    runner.follow()


def kv_block_count(config: EngineConfig, model_cfg: ModelConfig, model: LlamaForCausalLM, backend,
                   max_model_len: int, extra_bytes_per_block: int = 0) -> int:
    """KV blocks in the pool; under tensor parallelism every rank sizes its share and all take the
    smallest, since a block id means the same block on every rank."""
    dtype = kv_storage_dtype(config)
    if config.num_kv_blocks:
        blocks = config.num_kv_blocks
    elif config.device.startswith("cuda"):
        blocks = cuda_kv_blocks(config, model_cfg, model, backend, max_model_len, extra_bytes_per_block)
    else:
        blocks = config.kv_cache_bytes // (kv_bytes_per_block(model_cfg, config.block_size, dtype, model.kv_heads)
                                           + extra_bytes_per_block)
    return get_tp().min_int(blocks)
