"""The draft-model drafter: a smaller model with the target's tokenizer proposes k tokens.

It keeps its own paged KV pool of the same number of blocks as the target's and uses the target's
block tables: block b holds the target's K/V of some tokens in one pool and the draft's K/V of the
same tokens in the other, so the prefix cache, preemption and freeing need no second bookkeeping,
and a block's bytes (what the pool is sized by) are the two models' together.

Each step, after scheduling (the drafts' slots are allocated), the draft model runs

    forward 0:  the step's own tokens, drafts left out (prefill chunks, decodes, and each
                speculating sequence's last token at p): its KV follows the target's; the
                last token's logits give draft 1
    forward j:  draft j at position p + j (j = 1 .. k-1) gives draft j + 1

k forwards for k drafts. Draft k's K/V is not written: when all k are accepted, that position
(``Sequence.draft_hole``) is the first row of the next step's forward 0. So the draft's KV is
valid wherever the target's is (a rejected position is rewritten when it is computed again);
where it is not (a block cached by a request that ended on such a hole), drafts are worse,
never the output. Greedy requests draft the draft's argmax; sampled ones draw from its distribution
q (same temperature and cuts) and keep q for the rejection rule (speculative.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from contracts.models import resolve_model
from contracts.tokenizers import load_tokenizer
from worker.engine.config import EngineConfig, SpeculativeConfig
from worker.engine.model_runner import ModelRunner, StepInputs, kv_bytes_per_block, kv_storage_dtype
from worker.engine.sampler import draw_seed, greedy_tokens, probabilities
from worker.engine.scheduler import ScheduledSeq
from worker.engine.sequence import Sequence
from worker.models.backends import create_attention_backend
from worker.models.config import ModelConfig
from worker.models.loader import load_config

_DRAFT_STREAM = 0x5DEECE66D  # a seeded request's draft draws use their own stream of seeds


@dataclass
class LoadedDraft:
    config: EngineConfig  # the target's, naming the draft model
    model_config: ModelConfig
    model: torch.nn.Module
    bytes_per_block: int  # the draft's KV in one block

    def runner(self, num_blocks: int, max_model_len: int) -> ModelRunner:
        """The draft's runner over a pool of the target's number of blocks."""
        if self.model_config.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative draft model {self.config.model!r} takes "
                             f"{self.model_config.max_position_embeddings} positions, fewer than the target's "
                             f"max_model_len {max_model_len}: set --max-model-len")
        backend = create_attention_backend(self.config.attention_backend)
        return ModelRunner(self.config, self.model_config, self.model, backend, num_blocks, max_model_len)


def load_draft(config: EngineConfig, spec: SpeculativeConfig, tokenizer, target: ModelConfig,
               build_model: Callable) -> LoadedDraft:
    """The draft model of ``--speculative draft:MODEL``, on the target's device and dtype; refused
    unless its vocabulary is the target's (its tokens are verified as the target's).
    ``build_model``: llm_engine's (config, source, model config) -> model."""

    if config.tensor_parallel_size > 1:
        raise ValueError("speculative draft models run without tensor parallelism: use --speculative ngram "
                         "with --tp, or tensor_parallel_size 1")
    source = resolve_model(spec.draft_model)
    cfg = load_config(source)
    draft_tokenizer = load_tokenizer(source, config.tokenizer)
    same = cfg.vocab_size == target.vocab_size and (
        tokenizer is None or draft_tokenizer is None or draft_tokenizer.get_vocab() == tokenizer.get_vocab())
    if not same:
        raise ValueError(f"speculative draft model {spec.draft_model!r} has another vocabulary than the target "
                         f"({cfg.vocab_size} vs {target.vocab_size} ids, or other tokens): a draft must share the "
                         f"target's tokenizer")
    # (speculative stays set: the draft's runner captures graphs for multi-token rows too)
    draft_config = dataclasses.replace(config, model=spec.draft_model,
                                       quantization=config.speculative_draft_quantization or config.quantization)
    model = build_model(draft_config, source, cfg).eval()
    bpb = kv_bytes_per_block(cfg, config.block_size, kv_storage_dtype(config), model.kv_heads)
    return LoadedDraft(draft_config, cfg, model, bpb)


class DraftModelDrafter:
    name = "draft"

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Before scheduling: k placeholder tokens (``fill`` writes the drafts once slots exist)."""
        return [0] * k

    @torch.inference_mode()
    def fill(self, batch: list[ScheduledSeq]) -> list[torch.Tensor | None]:
        """Run the draft model over the step (module docstring); write each speculating item's
        drafts in place; per item, q [k, V] for sampled speculating requests, else None."""
        holes = set()  # sequences whose last known token's draft KV is missing (all drafts accepted)
        for it in batch:
            hole, it.seq.draft_hole = it.seq.draft_hole, None
            if hole is not None and hole == it.seq.num_computed_tokens - 1:
                holes.add(id(it.seq))
                it.seq.num_computed_tokens -= 1  # for prepare only: the chunk starts at the hole
        try:
            inputs = self.runner.prepare([ScheduledSeq(it.seq, it.num_new_tokens - len(it.draft)
                                                       + (id(it.seq) in holes)) for it in batch])
        finally:
            for it in batch:
                it.seq.num_computed_tokens += id(it.seq) in holes
        active = [i for i, it in enumerate(batch) if it.draft]  # batch indices still drafting
        inputs.sample_rows = [inputs.query_start[i + 1] - 1 for i in active]
        inputs.prompt = None  # the target scores prompts; the draft only follows
        logits, _ = self.runner.execute(inputs)
        if logits is not None and logits.shape[0] != len(active):  # a CUDA graph's: one row per item
            logits = logits[active]
        q: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        j = 0
        while active:
            for i, token in zip(active, self._draw(logits, batch, active, j, q)):
                batch[i].draft[j] = token
            active = [i for i in active if j + 1 < len(batch[i].draft)]  # those that want draft j + 1
            if active:  # draft j's forward; the last draft's K/V waits for the next step (a hole)
                logits, _ = self.runner.execute(_decode_inputs([batch[i] for i in active], j, self.runner.block_size))
            j += 1
        for it in batch:
            if it.draft:
                it.seq.draft_hole = it.seq.num_computed_tokens + len(it.draft)
        return [torch.stack(q[i]) if q.get(i) else None for i in range(len(batch))]

    @staticmethod
    def _draw(logits: torch.Tensor, batch: list[ScheduledSeq], active: list[int], j: int,
              q: dict[int, list[torch.Tensor]]) -> list[int]:
        """Draft ``j`` of each active item (logits row r: batch item active[r]): the draft's argmax
        (greedy requests) or a draw from its distribution, which goes into ``q``."""
        tokens = greedy_tokens(logits).tolist()
        for r, i in enumerate(active):
            it = batch[i]
            p = it.seq.params
            if p.greedy:
                continue
            probs = probabilities(logits[r : r + 1], [p])[0]
            gen = None
            if p.seed is not None:
                index = p.seed_offset + it.seq.num_output_tokens + j
                gen = torch.Generator(device=probs.device).manual_seed(draw_seed(p.seed ^ _DRAFT_STREAM, index))
            tokens[r] = int(torch.multinomial(probs, 1, generator=gen)[0])
            q[i].append(probs)
        return tokens


def _decode_inputs(items: list[ScheduledSeq], j: int, block_size: int) -> StepInputs:
    """A decode step of the draft model: each item's draft ``j`` at its position."""
    ids, positions, slots, block_tables, context_lens = [], [], [], [], []
    for it in items:
        seq = it.seq
        pos = seq.num_computed_tokens + 1 + j
        ids.append(it.draft[j])
        positions.append(pos)
        slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        block_tables.append(seq.block_table)
        context_lens.append(pos + 1)
    n = len(items)
    return StepInputs(ids, positions, slots, list(range(n + 1)), context_lens, block_tables, n, list(range(n)))
