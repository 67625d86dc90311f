"""Plain torch references for every kernel in kernels/, one per kernel and with its signature.

They favour being obviously right over being fast: attention loops over sequences and gathers
each one's K/V from its blocks, in fp32. Tests check each Triton kernel against these, and they
run on any device. An int8/fp8 pool (``kv_scales`` given) is written with ``kv_quant.quantize_kv``
and read back with ``kv_quant.dequantize_kv`` to fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.kv_quant import dequantize_kv, quantize_kv, token_major
from kernels.kv_store import kv_scale_args


def store_kv_ref(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 flat slot; -1 = skip (padding)
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8/fp8 pool: [num_blocks, KVH, block_size] fp32
) -> None:
    block_size, kvh, d = k_cache.shape[1:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_scale_args(k_cache, v_cache, kv_scales)  # as the kernel: the pool's dtype says whether scales are due
    if kv_scales is not None:
        for x, cache, scales in ((k, k_cache, kv_scales[0]), (v, v_cache, kv_scales[1])):
            stored, scale = quantize_kv(x[keep], cache.dtype)
            cache.view(-1, kvh, d)[slots] = stored
            token_major(scales)[slots // block_size, slots % block_size] = scale
        return
    k_cache.view(-1, kvh, d)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, kvh, d)[slots] = v[keep].to(v_cache.dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens of one sequence from the pool: [num_tokens, KVH, D] (or from
    ``token_major`` scales: [num_tokens, KVH])."""
    block_size = cache.shape[1]
    pos = torch.arange(num_tokens, device=cache.device)
    blocks = block_table.to(cache.device).long()[pos // block_size]
    return cache[blocks, pos % block_size]


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    block_table: torch.Tensor, num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, dequantized to fp32 from an int8/fp8 pool."""
    k, v = _gather(k_cache, block_table, num_tokens), _gather(v_cache, block_table, num_tokens)
    if kv_scales is None:
        return k, v
    k_scales, v_scales = (_gather(token_major(s), block_table, num_tokens) for s in kv_scales)
    return dequantize_kv(k, k_scales, torch.float32), dequantize_kv(v, v_scales, torch.float32)


def _attend(
    q: torch.Tensor,  # [q_len, H, D]
    k: torch.Tensor,  # [ctx, KVH, D]
    v: torch.Tensor,
    q_pos: torch.Tensor,  # [q_len] position of each query; it sees keys at positions <= its own
    scale: float,
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def _zeroed(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.zeros_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype
    return out.zero_()


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int | None = None,  # a kernel tuning knob; the result does not depend on it
    out: torch.Tensor | None = None,  # written in place when given
    order: torch.Tensor | None = None,  # the kernel's launch order; the result does not depend on it
    rope_store: tuple | None = None,  # (positions, k, v, cos, sin, slot_mapping): rotate q and k, store k and v first
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    kv_scale_args(k_cache, v_cache, kv_scales)  # as the kernel: the pool's dtype says whether scales are due
    if rope_store is not None:
        positions, k_new, v_new, cos, sin, slots = rope_store
        q, k_rot = rotary_embedding_ref(positions, q, k_new, cos, sin)
        store_kv_ref(k_rot, v_new, k_cache, v_cache, slots, kv_scales)
    out = _zeroed(q, out)
    for b, ctx in enumerate(context_lens.tolist()):
        if ctx == 0:  # an idle (padding) row: zeros
            continue
        k, v = _gather_kv(k_cache, v_cache, kv_scales, block_tables[b], ctx)
        q_pos = torch.tensor([ctx - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, q_pos, scale)[0]
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, H, D] the new tokens of all sequences, flattened
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32: cached prefix + new tokens
    scale: float,
    out: torch.Tensor | None = None,  # written in place when given
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    kv_scale_args(k_cache, v_cache, kv_scales)  # as the kernel: the pool's dtype says whether scales are due
    out = _zeroed(q, out)
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k, v = _gather_kv(k_cache, v_cache, kv_scales, block_tables[b], ctx)
        q_pos = torch.arange(ctx - (e - s), ctx, device=q.device)
        out[s:e] = _attend(q[s:e], k, v, q_pos, scale)
    return out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


@dataclass(frozen=True)
class RmsHandoff:
    """An add-RMS norm split across two projections at one row of x (kernels/wq_matmul.py's
    wq_matmul_norm): the first left the norm's elementwise part as the second's x and the sums of
    h^2 over its output tiles here; the second scales its sums by 1 / rms before its bias."""

    parts: torch.Tensor  # fp32 [tiles]: the sum of h^2 over each of the first projection's output tiles
    eps: float

    def inv_rms(self, k: int) -> torch.Tensor:
        """1 / rms of h, whose k columns ``parts`` sums the squares of (fp32, a 0-d tensor)."""
        return torch.rsqrt(self.parts.sum() / k + self.eps)

    def apply(self, out: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A projection's output without its bias -> what the norm's output would have given it."""
        out = (out.float() * self.inv_rms(k)).to(out.dtype)
        return out if bias is None else out + bias


def norm_handoff_ref(out: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     tile: int = 64) -> tuple[torch.Tensor, torch.Tensor, RmsHandoff]:
    """kernels/wq_gluon.py's _norm_out on one row: h = out + residual (rounded to the residual's
    dtype, as rms_norm's kernel rounds the sum), the next projection's x = weight * h (rounded to
    out's dtype), and h^2 summed over each ``tile`` columns. ``RmsHandoff.apply`` on the next
    projection's sums of that x gives rms_norm's output's sums, up to roundings."""
    assert out.shape[0] == 1 and out.shape == residual.shape
    h = (out.float() + residual.float()).to(residual.dtype)
    hf = h.float()
    xn = (weight.float() * hf).to(out.dtype)
    n = hf.shape[-1]
    parts = F.pad(hf.pow(2), (0, -n % tile)).view(-1, tile).sum(-1)
    return xn, h, RmsHandoff(parts, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding_ref(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # [max_pos, D] fp32, each half duplicated
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    def rotate(x: torch.Tensor) -> torch.Tensor:
        c = cos[positions].unsqueeze(1).to(x.dtype)
        s = sin[positions].unsqueeze(1).to(x.dtype)
        return x * c + _rotate_half(x) * s

    return rotate(q), rotate(k)


def rotary_store_kv_ref(
    positions: torch.Tensor,
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, KVH, D], rotated in place
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cos, sin)
    q.copy_(q_rot)
    k.copy_(k_rot)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q, k


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
