"""Rotary position embedding, neox (rotate-half) style, applied to q and k in place.

``rotary_store_kv`` also writes the rotated k and v into the paged pool in the same program:
the KV store needs no launch of its own (one small kernel fewer per layer, which at batch 1 is
latency, not bytes). Both run one kernel; ``STORE_KV`` says whether it writes the pool, and
``KV_QMAX`` whether it quantizes what it writes (an int8/fp8 pool, kernels/kv_quant.py)."""

from __future__ import annotations

import torch

from kernels._triton import check_launchable, jit, next_power_of_2, pdl_launch, tl, wait_for_producer
from kernels.kv_store import kv_scale, kv_scale_args, quantize, scale_offsets


@jit
def _rotate(x, partner, c, s, sign):
    """x * cos + rotate_half(x) * sin for the columns of x, where rotate_half's column is
    ``sign * partner`` (-x2 on the first half, x1 on the second). c, s: the table's fp32 values.

    Each product and the sum are rounded to x's dtype, as the torch math (and so the model) does."""
    dt = x.dtype
    c = c.to(dt).to(tl.float32)
    s = s.to(dt).to(tl.float32)
    rot = (sign * partner.to(tl.float32)) * s
    return ((x.to(tl.float32) * c).to(dt).to(tl.float32) + rot.to(dt).to(tl.float32)).to(dt)


@jit
def _rotate_heads(base, stride_h, num_heads, c1, c2, s1, s2, offs, d_mask, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates one token's heads in place, a half of each head at a time.

    Returns (mask, rotated first halves, rotated second halves) for a caller that stores them again."""
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & d_mask[None, :]
    p1 = base + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    o1 = _rotate(x1, x2, c1[None, :], s1[None, :], -1.0)
    o2 = _rotate(x2, x1, c2[None, :], s2[None, :], 1.0)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)
    return mask, o1, o2


@jit
def _store_quantized_halves(cache_ptr, scale_ptr, dst, scale_dst, x1, x2, keep, h_keep,
                            HALF: tl.constexpr, QMAX: tl.constexpr):
    """Stores head vectors, given as their halves [H, HALF] (zero where masked), quantized with a
    scale per head over both halves. k arrives rotated and rounded to its dtype, as the reference's."""
    amax = tl.maximum(tl.max(tl.abs(x1.to(tl.float32)), 1), tl.max(tl.abs(x2.to(tl.float32)), 1))
    scale = kv_scale(amax, QMAX)
    tl.store(cache_ptr + dst, quantize(x1, scale[:, None], cache_ptr.dtype.element_ty, QMAX), mask=keep)
    tl.store(cache_ptr + dst + HALF, quantize(x2, scale[:, None], cache_ptr.dtype.element_ty, QMAX), mask=keep)
    tl.store(scale_ptr + scale_dst, scale, mask=h_keep)


@jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    num_q_heads, num_k_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, STORE_KV: tl.constexpr,
    KV_QMAX: tl.constexpr,  # 0: a float pool; else an int8/fp8 pool's QMAX, with scales at ks_ptr, vs_ptr
    BLOCK_SIZE: tl.constexpr,  # KV_QMAX > 0: the pool's block size, which places a slot's scales
    USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    d_mask = offs < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # Both halves of the tables are read, so a table whose halves differ is still applied exactly.
    c1 = tl.load(cos_ptr + pos * stride_cos + offs, mask=d_mask, other=0.0)
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + offs, mask=d_mask, other=0.0)
    s1 = tl.load(sin_ptr + pos * stride_sin + offs, mask=d_mask, other=0.0)
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + offs, mask=d_mask, other=0.0)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, c1, c2, s1, s2, offs, d_mask, HALF, BLOCK_HQ)
    mask, o1, o2 = _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, c1, c2, s1, s2, offs, d_mask,
                                 HALF, BLOCK_HK)
    if STORE_KV:
        # The pool row of slot s is [KVH, D] at s * KVH * D; slot -1 is a padding token (CUDA graphs).
        slot = tl.load(slot_ptr + t).to(tl.int64)
        heads = tl.arange(0, BLOCK_HK)
        dst = tl.maximum(slot, 0) * num_k_heads * HEAD_DIM + heads[:, None] * HEAD_DIM + offs[None, :]
        keep = mask & (slot >= 0)
        if KV_QMAX > 0:
            h_keep = (heads < num_k_heads) & (slot >= 0)
            scale_dst = scale_offsets(tl.maximum(slot, 0), heads, num_k_heads, BLOCK_SIZE)
            _store_quantized_halves(k_cache_ptr, ks_ptr, dst, scale_dst, o1, o2, keep, h_keep, HALF, KV_QMAX)
            pv = v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs[None, :]
            v1 = tl.load(pv, mask=keep, other=0.0)
            v2 = tl.load(pv + HALF, mask=keep, other=0.0)
            _store_quantized_halves(v_cache_ptr, vs_ptr, dst, scale_dst, v1, v2, keep, h_keep, HALF, KV_QMAX)
        else:
            tl.store(k_cache_ptr + dst, o1.to(k_cache_ptr.dtype.element_ty), mask=keep)
            tl.store(k_cache_ptr + dst + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=keep)
            pv = v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs[None, :]
            v1 = tl.load(pv, mask=keep, other=0.0)
            v2 = tl.load(pv + HALF, mask=keep, other=0.0)
            tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=keep)
            tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=keep)


def _launch(positions, q, k, cos, sin, kv_store=None) -> None:
    """Checks the shared layout and runs the kernel; ``kv_store`` = (v, k_cache, v_cache, slot_mapping, kv_scales)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape == (num_tokens, num_k_heads, head_dim)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert cos.shape[-1] == head_dim and sin.shape == cos.shape
    v, k_cache, v_cache, slots, kv_scales = kv_store if kv_store is not None else (k, k, k, positions, None)
    k_scales, v_scales, qmax = kv_scale_args(k_cache, v_cache, kv_scales)  # all unused when not storing
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, v, cos, sin, k_cache, v_cache, k_scales, v_scales, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), num_q_heads, num_k_heads,
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=next_power_of_2(half),
        BLOCK_HQ=next_power_of_2(num_q_heads), BLOCK_HK=next_power_of_2(num_k_heads),
        STORE_KV=kv_store is not None, KV_QMAX=qmax,
        BLOCK_SIZE=k_cache.shape[1] if qmax else 1,  # unused by a float pool: no variant per block size
        num_warps=4, **pdl_launch(q.device),
    )


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, KVH, D], rotated in place
    cos: torch.Tensor,  # [max_pos, D] fp32, each half duplicated
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (views of a qkv buffer are fine) and returns them."""
    check_launchable(positions, q, k, cos, sin)
    _launch(positions, q, k, cos, sin)
    return q, k


def rotary_store_kv(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, KVH, D], rotated in place
    v: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # [max_pos, D] fp32, each half duplicated
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 flat slot; -1 = skip
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8/fp8 pool: [num_blocks, KVH, block_size] fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding`` then ``store_kv`` in one launch; returns the rotated (q, k)."""
    check_launchable(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, *(kv_scales or ()))
    assert v.shape == k.shape and v.stride(-1) == 1
    assert k_cache.shape[2:] == k.shape[1:] and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (q.shape[0],) and slot_mapping.is_contiguous()
    _launch(positions, q, k, cos, sin, (v, k_cache, v_cache, slot_mapping, kv_scales))
    return q, k
