"""The engine: add requests, step, get outputs. Synchronous and single-threaded by design.

    batch, overflow = scheduler.schedule()
    sampled = model_runner.run(batch)
    outputs = postprocess(batch, sampled)

AsyncEngine (async_engine.py) drives it from a background thread for servers.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import take_text_delta, update_text
from worker.engine.errors import InvalidRequestError
from worker.engine.model_runner import DTYPES, ModelRunner, cuda_kv_blocks, kv_bytes_per_block
from worker.engine.outputs import EngineStats, RequestOutput, Usage
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledSeq, Scheduler
from worker.engine.sequence import Sequence
from worker.models.attention import create_attention_backend
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import iter_weights, load_config, load_tokenizer, resolve_model

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, model: LlamaForCausalLM | None = None):
        """``tokenizer`` and ``model`` reuse ones already loaded for the same ``config.model``
        (the model holds no per-engine state: the KV pool is the runner's)."""
        self.config = config
        source = resolve_model(config.model)
        self.model_id = source.model_id
        self.model_config = load_config(source)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        dtype = DTYPES[config.dtype]
        backend = create_attention_backend(config.attention_backend)
        if model is None:
            torch.manual_seed(config.seed)
            # Parameters are created in the serving dtype on the device (no full-size fp32 copy);
            # the rotary tables ask for float32 explicitly and stay so.
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.device(config.device):
                    model = LlamaForCausalLM(self.model_config)
            finally:
                torch.set_default_dtype(default_dtype)
            if source.kind == "dummy":
                _init_dummy(model)
            else:
                model.load_weights(iter_weights(source))
        self.model = model.eval()
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif config.device.startswith("cuda"):
            num_blocks = cuda_kv_blocks(config, self.model_config, self.model, backend, self.max_model_len)
        else:
            num_blocks = config.kv_cache_bytes // kv_bytes_per_block(self.model_config, config.block_size, dtype)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no KV block of this model")
        self.block_manager = BlockManager(num_blocks, config.block_size, self.model_id, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(config, self.model_config, self.model, backend, num_blocks, self.max_model_len)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        log.info("engine ready: model=%s blocks=%d x %d tokens, max_model_len=%d",
                 self.model_id, num_blocks, config.block_size, self.max_model_len)

    # --- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Prompt text or chat messages to token ids, the way the router will do it too."""
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", f"{self.model_id} has no tokenizer: send token ids")
        if messages is not None:
            if not messages:
                raise InvalidRequestError("messages", "must hold at least one message")
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not m.get("role"):
                    raise InvalidRequestError(f"messages[{i}]", "needs a role and a string content")
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse what can never run; safe to call from any thread (reads only configuration)."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"{n} tokens leave no room to generate within max_model_len={self.max_model_len}")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError("prompt_token_ids", f"token ids must be in [0, {vocab})")
        if self.block_manager.blocks_needed(n + 1) > self.block_manager.num_blocks:
            raise InvalidRequestError(
                "prompt", f"{n} tokens do not fit the KV cache ({self.block_manager.num_blocks} blocks)")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        self.validate(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        seq = Sequence(request_id, list(prompt_token_ids), params)
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
        return self._final_output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch, overflow = self.scheduler.schedule()
        outputs = [self._finish(seq, "length") for seq in overflow]
        if not batch:
            return outputs
        try:
            sampled = self.runner.run(batch)
        except Exception as exc:  # a failed step fails its batch, never the engine
            log.exception("step failed; failing its %d requests", len(batch))
            return outputs + [self._finish(item.seq, "error", error=f"{type(exc).__name__}: {exc}")
                              for item in batch]
        return outputs + self._postprocess(batch, sampled)

    def _postprocess(self, batch: list[ScheduledSeq], sampled) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for item, result in zip(batch, sampled):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if result is None:
                continue
            token, logprob = result
            seq.token_ids.append(token)
            seq.pending_token_ids.append(token)
            if logprob is not None:
                seq.pending_logprobs.append(logprob)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, token)
            if reason is not None:
                outputs.append(self._finish(seq, reason))
            else:
                outputs.append(self._make_output(seq))
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        hit_stop_string = p.detokenize and self.tokenizer is not None and update_text(seq, self.tokenizer)
        if hit_stop_string or token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.request_id, None)
        seq.error = error
        return self._final_output(seq)

    def _make_output(self, seq: Sequence) -> RequestOutput:
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.pending_token_ids,
            text_delta=take_text_delta(seq, seq.finished),
            logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            finished=seq.finished,
        )
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
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
        return [tokens[i] for i in ids]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks, kv_blocks_used=bm.num_used_blocks,
            prefix_queries=bm.prefix_queries, prefix_hits=bm.prefix_hits, block_size=bm.block_size,
            pending_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens - 1 for s in self.requests.values()
                                       if s.num_tokens - s.num_computed_tokens > 1),
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


def _init_dummy(model: torch.nn.Module) -> None:
    """Random weights with sane scales (what a step costs does not depend on the values)."""
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
        else:
            torch.nn.init.zeros_(p)
