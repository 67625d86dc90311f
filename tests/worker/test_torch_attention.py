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
from worker.models import quantization
from worker.models.attention import AttentionMetadata, TorchAttentionBackend

BS, KVH, H, D = 4, 2, 6, 32


def _attend(backend, pool, tables, items, q, k, v, num_decodes, verify=None):
    """One step: ``items`` = (sequence, first position, tokens), decodes first; q/k/v per row;
    ``verify``: per item, whether it is a speculative verification."""
    slots, query_start, ctx = [], [0], []
    for s, first, n in items:
        slots += [tables[s][p // BS] * BS + p % BS for p in range(first, first + n)]
        query_start.append(query_start[-1] + n)
        ctx.append(first + n)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start=query_start, context_lens=ctx,
                             block_tables=[tables[s] for s, _, _ in items], block_size=BS, num_decodes=num_decodes,
                             verify=verify)
    backend.prepare(meta, torch.device("cpu"))
    return backend.forward(q, k, v, *pool, meta, scale=D ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_rows_attention_is_its_lone_decodes_bits_whatever_the_step_holds(dtype):
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randn(64, BS, KVH, D, generator=gen).to(dtype) for _ in range(2)]  # K, V: stale-looking data
    tables = [list(range(0, 20)), list(range(20, 40)), list(range(40, 60))]
    # decodes at positions 36 and 69 (contexts 37, 70) and a verification of 1 + 3 rows at 51..54
    items = [(0, 36, 1), (1, 69, 1), (2, 51, 4)]
    rows = sum(n for _, _, n in items)
    q, k, v = (torch.randn(rows, n, D, generator=gen).to(dtype) for n in (H, KVH, KVH))
    backend = TorchAttentionBackend()
    together = _attend(backend, pool, tables, items, q, k, v, num_decodes=2, verify=[False, False, True])
    row = 0
    for s, first, n in items:
        for j in range(n):
            alone = _attend(backend, pool, tables, [(s, first + j, 1)], q[row:row + 1], k[row:row + 1],
                            v[row:row + 1], num_decodes=1)
            assert torch.equal(alone[0], together[row]), f"row {row} (sequence {s}, position {first + j})"
            row += 1


def test_a_prefill_chunk_gets_the_bits_of_the_whole_prompts_prefill():
    """A chunk continuing a prompt (chunked prefill, or the rest after a prefix-cache hit) attends
    causally with its offset, as one: its rows get what prefilling the whole prompt gives them,
    short chunks included (as rows alone they would not)."""
    gen = torch.Generator().manual_seed(1)
    pool = [torch.zeros(32, BS, KVH, D) for _ in range(2)]
    tables = [list(range(32))]
    q, k, v = (torch.randn(30, n, D, generator=gen) for n in (H, KVH, KVH))
    backend = TorchAttentionBackend()
    whole = _attend(backend, pool, tables, [(0, 0, 30)], q, k, v, num_decodes=0)
    # The last 1, 2, 3, 8 and 22 tokens after a prefix already in the pool (1-3 rows alone sum in
    # another order on AVX2 CPUs: the backend pads them).
    for first in (29, 28, 27, 22, 8):
        part = _attend(backend, pool, tables, [(0, first, 30 - first)], q[first:], k[first:], v[first:],
                       num_decodes=0)
        assert torch.equal(part, whole[first:]), first
    keys, vals = (p.view(-1, KVH, D)[:30].repeat_interleave(H // KVH, dim=1) for p in pool)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * D ** -0.5
    scores = scores.masked_fill(torch.arange(30)[None, None, :] > torch.arange(30)[None, :, None], float("-inf"))
    torch.testing.assert_close(whole, torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals), rtol=1e-5, atol=1e-5)


def test_packed_greedy_speculation_emits_the_plain_runs_tokens(smollm2, monkeypatch):
    """SmolLM2 served packed from its GGUF (the default, ``auto``; bf16 activations into the
    packed matmuls): n-gram speculation's output is the plain run's, one request at a time or all
    at once, and a request's answer is the same alone or batched, its prompt prefilled or found in
    the prefix cache. Before rows attended alone, 9 of these 11 prompts diverged within 64 tokens
    one at a time. The guarantee is the packed kernels' (``KVCASCADE_CPU_UNPACK=0``): the 11 prompts
    prefilled at once make a step of 256 rows or more, which would otherwise be unpacked to bf16
    (worker/models/quantization.py) and round differently from the same prompts one at a time."""
    monkeypatch.setattr(quantization, "CPU_UNPACK_ROWS", 0)
    plain = LLMEngine(EngineConfig(model="smollm2-135m", quantization="auto"), tokenizer=smollm2.tokenizer)
    spec = LLMEngine(EngineConfig(model="smollm2-135m", quantization="auto", speculative="ngram",
                                  num_speculative_tokens=4), tokenizer=smollm2.tokenizer, model=plain.model)
    prompts = [plain.tokenize(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = plain.generate(prompts, params)  # all at once, nothing cached yet
    assert [spec.generate([p], params)[0] for p in prompts[:4]] == expected[:4]  # one at a time, prefix hits
    assert spec.generate(prompts, params) == expected
    assert plain.generate(prompts[:4], params) == expected[:4]
    assert spec.spec_stats.accepted > 0 and spec.block_manager.prefix_hits > 0
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks
    for engine in (plain, spec):
        engine.close()
