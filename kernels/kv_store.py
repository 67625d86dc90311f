"""Writing new tokens' K/V into the paged pool.

An int8 or fp8 pool (kernels/kv_quant.py's format) is written quantized: each token's head
vector with its own scale, beside it in ``kv_scales``. ``kv_scale``, ``quantize`` and
``scale_offsets`` are that format in Triton, shared with the kernels that store K/V on their way
(rotary, fused decode)."""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, cdiv, check_launchable, jit, next_power_of_2, pdl_launch, tl, wait_for_producer
from kernels.kv_quant import EPS, QMAX, is_quantized

_MAX_BLOCK = 2048
_EPS = tl.constexpr(EPS) if HAS_TRITON else EPS  # a jit function reads only constexpr globals


def kv_scale_args(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Checks ``kv_scales`` against the pool's dtype, which decides; returns (k_scales, v_scales,
    QMAX) for a launch. A float pool gives QMAX 0 (the kernels' flag: no scales) and its caches as
    the (unused) scale pointers."""
    assert k_cache.dtype == v_cache.dtype, "the K and V pools must share a dtype"
    if not is_quantized(k_cache.dtype):
        assert kv_scales is None, f"kv_scales given for a {k_cache.dtype} KV cache: only int8/fp8 caches have scales"
        return k_cache, v_cache, 0.0
    assert kv_scales is not None, f"a {k_cache.dtype} KV cache needs kv_scales=(k_scales, v_scales)"
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    shape = (num_blocks, num_kv_heads, block_size)  # heads before tokens: kernels/kv_quant.py
    for s in kv_scales:
        assert s.shape == shape and s.dtype == torch.float32 and s.is_contiguous(), (
            f"kv_scales must be contiguous float32 {shape}, got {tuple(s.shape)} {s.dtype}")
    return kv_scales[0], kv_scales[1], QMAX[k_cache.dtype]


@jit
def scale_offsets(slot, head, num_kv_heads, BLOCK_SIZE: tl.constexpr):
    """Where slot ``slot``'s scale of ``head`` sits in a [num_blocks, KVH, block_size] scale tensor."""
    return (slot // BLOCK_SIZE) * (num_kv_heads * BLOCK_SIZE) + head * BLOCK_SIZE + slot % BLOCK_SIZE


@jit
def kv_scale(amax, QMAX: tl.constexpr):
    """The scale of a head vector whose largest magnitude is ``amax`` (fp32), divided as torch does."""
    return tl.div_rn(tl.maximum(amax, _EPS), QMAX)


@jit
def quantize(x, scale, dtype: tl.constexpr, QMAX: tl.constexpr):
    """``x / scale`` clamped to +-QMAX and rounded into ``dtype`` (an int8 to nearest, half away
    from zero; fp8 by the cast), as ``kv_quant.quantize_kv``. Clamping first keeps the cast in range."""
    y = tl.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if dtype == tl.int8:
        y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    return y.to(dtype)


@jit
def _store_quantized(src_ptrs, cache_ptrs, scale_ptrs, mask, h_mask, QMAX: tl.constexpr):
    """Loads head vectors [H, D], stores them quantized and each head's scale."""
    x = tl.load(src_ptrs, mask=mask, other=0.0).to(tl.float32)
    scale = kv_scale(tl.max(tl.abs(x), 1), QMAX)
    tl.store(cache_ptrs, quantize(x, scale[:, None], cache_ptrs.dtype.element_ty, QMAX), mask=mask)
    tl.store(scale_ptrs, scale, mask=h_mask)


@jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_vt,
    ROW: tl.constexpr, BLOCK: tl.constexpr,  # ROW = KVH * D: one token's slot in the pool
    USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < ROW) & (slot >= 0)  # slot -1: a padding token (CUDA graphs), written nowhere
    dst = tl.maximum(slot, 0) * ROW + offs
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@jit
def _store_kv_quant_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, slot_ptr, stride_kt, stride_vt,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One token a program, as a [KVH, D] tile: a scale per head needs the head's whole vector."""
    wait_for_producer(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = (heads < NUM_KV_HEADS) & (slot >= 0)  # slot -1: a padding token, written nowhere
    mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    offs = heads[:, None] * HEAD_DIM + offs_d[None, :]
    dst = tl.maximum(slot, 0) * (NUM_KV_HEADS * HEAD_DIM) + offs
    scale_dst = scale_offsets(tl.maximum(slot, 0), heads, NUM_KV_HEADS, BLOCK_SIZE)
    _store_quantized(k_ptr + t * stride_kt + offs, k_cache_ptr + dst, ks_ptr + scale_dst, mask, h_mask, QMAX)
    _store_quantized(v_ptr + t * stride_vt + offs, v_cache_ptr + dst, vs_ptr + scale_dst, mask, h_mask, QMAX)


def store_kv(
    k: torch.Tensor,  # [T, KVH, D]; a token's [KVH, D] must be contiguous (a slice of a qkv row is fine)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 flat slot = block * block_size + offset; -1 = skip
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8/fp8 pool: [num_blocks, KVH, block_size] fp32
) -> None:
    check_launchable(k, v, k_cache, v_cache, slot_mapping, *(kv_scales or ()))
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.shape == v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    for x in (k, v):
        assert x.shape == k.shape and x.stride(2) == 1 and x.stride(1) == head_dim
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.is_contiguous()
    k_scales, v_scales, qmax = kv_scale_args(k_cache, v_cache, kv_scales)
    if num_tokens == 0:
        return
    if qmax:
        _store_kv_quant_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, k.stride(0), v.stride(0),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim), QMAX=qmax,
            num_warps=4, **pdl_launch(k.device),
        )
        return
    block = min(next_power_of_2(row), _MAX_BLOCK)
    _store_kv_kernel[(num_tokens, cdiv(row, block))](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row, BLOCK=block, num_warps=4, **pdl_launch(k.device),
    )
