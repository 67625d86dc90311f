"""Paged attention behind one interface; the per-step metadata lives in a forward context.

The model runner builds an ``AttentionMetadata`` once per step and sets it as the forward
context, so a model's forward stays ``forward(input_ids, positions)``. Each attention layer then
writes its new K/V into the paged pool and attends over the sequence's blocks.

Token layout of one step (T new tokens, B sequences, flattened, decodes first):

    seq:        | d0 | d1 | d2 |  p0 (chunk of 5)  |  p1 (chunk of 3) |
    query_start   0    1    2    3                   8                  11
    context_len = cached/computed tokens before this step + the new ones (what the query sees)

A backend is chosen by name (``worker.models.backends.create_attention_backend``); the torch one
runs anywhere and is the reference the Triton backend is checked against. The KV pool and the backend travel in the metadata, so a
model holds no engine state and one loaded model can serve several engines.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, NamedTuple

import torch
import torch.nn.functional as F

from kernels.kv_quant import dequantize_kv, quantize_kv, token_major

if TYPE_CHECKING:
    from worker.models.layers import RotaryEmbedding


class LayerKV(NamedTuple):
    """One layer's share of the KV pool: K and V [num_blocks, block_size, KVH, D]; in a quantized
    pool (int8 / fp8) also their scales, each [num_blocks, KVH, block_size] (kernels/kv_quant.py)."""

    k: torch.Tensor
    v: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: flat pool slot (block * block_size + offset) per new token
    query_start: list[int]  # [B + 1] offsets of each sequence's new tokens in the flat batch
    context_lens: list[int]  # [B] tokens each sequence attends over (prefix + new)
    block_tables: list[list[int]]  # [B] the physical blocks of each sequence, in order
    block_size: int
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    # Per layer, its K/V caches (and scales). The pool travels with the step rather than living in
    # the model, so one loaded model can serve several engines.
    kv_caches: list[LayerKV] = field(default_factory=list)
    backend: "AttentionBackend | None" = None  # likewise: the engine's choice, not the model's
    # Per sequence, whether its chunk is a speculative verification (its last token and drafts);
    # None: no sequence's is. The torch backend attends such rows as the decodes they stand for.
    verify: list[bool] | None = None
    # Backend-specific tensors built once per step (not once per layer).
    extra: dict[str, object] = field(default_factory=dict)


# The step's metadata, per thread (a ContextVar): engines stepping in threads of one process, such
# as the two tiers of a cascade, each see their own step. A module global here once let one
# model's step write into the other's KV cache.
_context: ContextVar[AttentionMetadata | None] = ContextVar("kvcascade_forward_context", default=None)


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    token = _context.set(meta)
    try:
        yield
    finally:
        _context.reset(token)


def get_forward_context() -> AttentionMetadata:
    meta = _context.get()
    assert meta is not None, "attention called outside a forward_context"
    return meta


class AttentionBackend:
    """Applies the rotary embedding to new q/k, writes new K/V into a layer's paged cache and
    attends over it. Rotation belongs here, not in the model, so that a backend can fuse it with
    the KV store (the Triton one does: one launch per layer instead of two)."""

    name = "base"

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        """Build per-step tensors into ``meta.extra``; called once before the forward pass."""

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rope: "tuple[torch.Tensor, RotaryEmbedding] | None" = None,  # (positions [T], the layer's rotary)
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # a quantized pool's (k, v) scales
        next_quantized: bool = False,  # a quantized projection reads the output (kernels/_triton.py's early_next)
    ) -> torch.Tensor:  # [T, H, D]
        raise NotImplementedError


# A prefill chunk of fewer rows is padded to this many: on AVX2 CPUs, masked SDPA over 1-3 query
# rows sums in another order than over 4 or more (measured, torch 2.13), so a prompt's last 1-3
# tokens after a prefix-cache hit got other bits than the whole prompt's prefill gives them.
_MIN_PREFILL_ROWS = 4


class TorchAttentionBackend(AttentionBackend):
    """Plain torch: gathers each sequence's K/V from its blocks and calls SDPA.

    Every decode, and every row of a speculative verification (a sequence's last token and its
    drafts, ``meta.verify``), attends as a row of its own over exactly its context, rows of equal
    context batched, none padded. So a decode's result never depends on what else the step holds (a
    padded batch changes CPU SDPA's float32 sums), and a verification's rows get the bits of the
    plain decodes they stand for (greedy speculation then emits the plain run's tokens also where
    activations are rounded to bf16, as before packed matmuls). Prefill chunks go one sequence at a
    time, causal with their prefix's offset: a row gets the same bits however its prompt was
    chunked or served from the prefix cache (as rows alone it would not).
    """

    name = "torch"

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        bs = meta.block_size
        by_ctx: dict[int, tuple[list[int], list[torch.Tensor]]] = {}  # context length -> (rows, slots)
        prefills = []
        for i, ctx in enumerate(meta.context_lens):
            start = meta.query_start[i]
            q_len = meta.query_start[i + 1] - start
            slots = _slots_of(meta.block_tables[i], ctx, bs)
            if i < meta.num_decodes or (meta.verify is not None and meta.verify[i]):
                for j in range(q_len):  # row j sees the sequence's first ctx - q_len + j + 1 tokens
                    seen = ctx - q_len + j + 1
                    rows, group = by_ctx.setdefault(seen, ([], []))
                    rows.append(start + j)
                    group.append(slots[:seen])
                continue
            mask = None
            # a cached or earlier-chunk prefix (causal with an offset), or a chunk padded to 4 rows
            if ctx != q_len or q_len < _MIN_PREFILL_ROWS:
                q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
                mask = torch.arange(ctx).unsqueeze(0) <= q_pos
                if q_len < _MIN_PREFILL_ROWS:  # padding rows, attending to everything, dropped after
                    mask = torch.cat([mask, mask.new_ones(_MIN_PREFILL_ROWS - q_len, ctx)])
                mask = mask.to(device)
            prefills.append((start, start + q_len, slots.to(device), mask))
        meta.extra["row_groups"] = [(torch.tensor(rows, device=device), torch.stack(group).to(device))
                                    for rows, group in by_ctx.values()]
        meta.extra["prefills"] = prefills

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, rope=None, kv_scales=None, next_quantized=False):
        if rope is not None:
            positions, rotary = rope
            q, k = rotary(positions, q, k)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        if kv_scales is None:
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)

            def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return k_flat[slots], v_flat[slots]
        else:  # a quantized pool: store data + scale, read back dequantized in q's dtype
            # Through uint8 views: CPU torch has no index_copy_ for fp8 (both formats are a byte).
            # The scales, [num_blocks, KVH, block_size], through views indexed by (block, offset).
            kv_dtype, bs = k_cache.dtype, k_cache.shape[1]
            k_bytes, v_bytes = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
            ks_tok, vs_tok = (token_major(s) for s in kv_scales)
            new = (meta.slot_mapping // bs, meta.slot_mapping % bs)
            for x, flat, s_tok in ((k, k_bytes, ks_tok), (v, v_bytes, vs_tok)):
                data, sc = quantize_kv(x, kv_dtype)
                flat.index_copy_(0, meta.slot_mapping, data.view(torch.uint8))
                s_tok[new] = sc

            def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                blk, off = slots // bs, slots % bs
                return (dequantize_kv(k_bytes[slots].view(kv_dtype), ks_tok[blk, off], q.dtype),
                        dequantize_kv(v_bytes[slots].view(kv_dtype), vs_tok[blk, off], q.dtype))
        out = torch.empty_like(q)
        for rows, slots in meta.extra["row_groups"]:
            kd, vd = gather(slots)  # [rows, ctx, KVH, D]
            od = F.scaled_dot_product_attention(
                q[rows].unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2), scale=scale, enable_gqa=True
            )
            out[rows] = od.squeeze(2)
        for s, e, slots, mask in meta.extra["prefills"]:
            qp = q[s:e].transpose(0, 1)  # [H, q_len, D]
            if e - s < _MIN_PREFILL_ROWS:
                qp = torch.cat([qp, qp.new_zeros(qp.shape[0], _MIN_PREFILL_ROWS - (e - s), qp.shape[2])], dim=1)
            kp, vp = gather(slots)
            kp, vp = kp.transpose(0, 1), vp.transpose(0, 1)  # [KVH, ctx, D]
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            out[s:e] = op[:, :e - s].transpose(0, 1)
        return out


def _slots_of(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Flat pool slots of a sequence's first ``num_tokens`` tokens."""
    blocks = torch.tensor(block_table, dtype=torch.long)
    pos = torch.arange(num_tokens)
    return blocks[pos // block_size] * block_size + pos % block_size
