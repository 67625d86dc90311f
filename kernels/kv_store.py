"""Writing new tokens' K/V into the paged pool."""

from __future__ import annotations

import torch

from kernels._triton import cdiv, check_launchable, jit, next_power_of_2, pdl_launch, tl, wait_for_producer

_MAX_BLOCK = 2048


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


def store_kv(
    k: torch.Tensor,  # [T, KVH, D]; a token's [KVH, D] must be contiguous (a slice of a qkv row is fine)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 flat slot = block * block_size + offset; -1 = skip
) -> None:
    check_launchable(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.shape == v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    for x in (k, v):
        assert x.shape == k.shape and x.stride(2) == 1 and x.stride(1) == head_dim
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    block = min(next_power_of_2(row), _MAX_BLOCK)
    _store_kv_kernel[(num_tokens, cdiv(row, block))](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row, BLOCK=block, num_warps=4, **pdl_launch(k.device),
    )
