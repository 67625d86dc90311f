"""The torch attention backend: a row's result does not depend on what else its step holds.

Decodes of other lengths beside it, or a speculative verification's rows (the last token and k
drafts, one chunk), must give each row the bits it gets as a lone decode: CPU SDPA sums a padded
row in another order, and where activations are then rounded to bf16 (packed weights) a last-bit
difference flips greedy tokens, so speculation stopped emitting the plain run's output."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import PROMPTS
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models.attention import AttentionMetadata, TorchAttentionBackend

BS, KVH, H, D = 4, 2, 6, 32


def _attend(backend, pool, tables, items, q, k, v, num_decodes):
    """One step: ``items`` = (sequence, first position, tokens), decodes first; q/k/v per row."""
    slots, query_start, ctx = [], [0], []
    for s, first, n in items:
        slots += [tables[s][p // BS] * BS + p % BS for p in range(first, first + n)]
        query_start.append(query_start[-1] + n)
        ctx.append(first + n)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start=query_start, context_lens=ctx,
                             block_tables=[tables[s] for s, _, _ in items], block_size=BS, num_decodes=num_decodes)
    backend.prepare(meta, torch.device("cpu"))
    return backend.forward(q, k, v, *pool, meta, scale=D ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_rows_attention_is_its_lone_decodes_bits_whatever_the_step_holds(dtype):
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randn(64, BS, KVH, D, generator=gen).to(dtype) for _ in range(2)]  # K, V: stale-looking data
    tables = [list(range(0, 20)), list(range(20, 40)), list(range(40, 60))]
    # decodes at positions 36 and 69 (contexts 37, 70), a verification of 1 + 3 rows at 51..54 and a
    # prefill chunk of 6 rows continuing sequence 2 from position 10 (not rows: longer is not the point)
    items = [(0, 36, 1), (1, 69, 1), (2, 51, 4)]
    rows = sum(n for _, _, n in items)
    q, k, v = (torch.randn(rows, n, D, generator=gen).to(dtype) for n in (H, KVH, KVH))
    backend = TorchAttentionBackend()
    together = _attend(backend, pool, tables, items, q, k, v, num_decodes=2)
    row = 0
    for s, first, n in items:
        for j in range(n):
            alone = _attend(backend, pool, tables, [(s, first + j, 1)], q[row:row + 1], k[row:row + 1],
                            v[row:row + 1], num_decodes=1)
            assert torch.equal(alone[0], together[row]), f"row {row} (sequence {s}, position {first + j})"
            row += 1


def test_a_long_chunk_still_attends_causally_as_one():
    gen = torch.Generator().manual_seed(1)
    pool = [torch.randn(32, BS, KVH, D, generator=gen) for _ in range(2)]
    tables = [list(range(32))]
    q, k, v = (torch.randn(24, n, D, generator=gen) for n in (H, KVH, KVH))
    out = _attend(TorchAttentionBackend(), pool, tables, [(0, 8, 24)], q, k, v, num_decodes=0)
    keys = pool[0].view(-1, KVH, D)[:32].repeat_interleave(H // KVH, dim=1)
    vals = pool[1].view(-1, KVH, D)[:32].repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * D ** -0.5
    scores = scores.masked_fill(torch.arange(32)[None, None, :] > torch.arange(8, 32)[None, :, None], float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_packed_greedy_speculation_emits_the_plain_runs_tokens(smollm2):
    """SmolLM2 served packed from its GGUF (the default, ``auto``; bf16 activations into the
    packed matmuls): n-gram speculation's output is the plain run's, one request at a time and all
    at once (each against the plain run of the same batch: a prefill's bits still depend on how
    its prompt is chunked). Before rows attended alone, 9 of these 11 prompts diverged within 64
    tokens one at a time."""
    plain = LLMEngine(EngineConfig(model="smollm2-135m", quantization="auto"), tokenizer=smollm2.tokenizer)
    spec = LLMEngine(EngineConfig(model="smollm2-135m", quantization="auto", speculative="ngram",
                                  num_speculative_tokens=4), tokenizer=smollm2.tokenizer, model=plain.model)
    prompts = [plain.tokenize(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for group in ([p] for p in prompts[:4]):  # one at a time
        assert spec.generate(group, params) == plain.generate(group, params)
    assert spec.generate(prompts, params) == plain.generate(prompts, params)  # all at once
    assert spec.spec_stats.accepted > 0
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks
    for engine in (plain, spec):
        engine.close()
