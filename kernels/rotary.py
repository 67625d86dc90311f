"""Rotary position embedding, neox (rotate-half) style, applied to q and k in place."""

from __future__ import annotations

import torch

from kernels._triton import check_launchable, jit, next_power_of_2, tl


@jit
def _rotate_heads(base, stride_h, num_heads, c1, c2, s1, s2, offs, d_mask, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates one token's heads: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)."""
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & d_mask[None, :]
    p1 = base + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    # Each product and the sum are rounded to x's dtype, as the torch math (and so the model) does.
    c1 = c1.to(dt).to(tl.float32)
    c2 = c2.to(dt).to(tl.float32)
    s1 = s1.to(dt).to(tl.float32)
    s2 = s2.to(dt).to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = (x1 * c1[None, :]).to(dt).to(tl.float32) + (-x2 * s1[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)
    tl.store(p1, o1.to(dt), mask=mask)
    tl.store(p1 + HALF, o2.to(dt), mask=mask)


@jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    d_mask = offs < HALF
    # Both halves of the tables are read, so a table whose halves differ is still applied exactly.
    c1 = tl.load(cos_ptr + pos * stride_cos + offs, mask=d_mask, other=0.0)
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + offs, mask=d_mask, other=0.0)
    s1 = tl.load(sin_ptr + pos * stride_sin + offs, mask=d_mask, other=0.0)
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + offs, mask=d_mask, other=0.0)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, c1, c2, s1, s2, offs, d_mask, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, c1, c2, s1, s2, offs, d_mask, HALF, BLOCK_HK)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, KVH, D], rotated in place
    cos: torch.Tensor,  # [max_pos, D] fp32, each half duplicated
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (views of a qkv buffer are fine) and returns them."""
    check_launchable(positions, q, k, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    assert head_dim % 2 == 0 and k.shape[0] == num_tokens and k.shape[2] == head_dim
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert cos.shape[-1] == head_dim and sin.shape == cos.shape
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            num_q_heads, k.shape[1],
            HALF=half, BLOCK_HALF=next_power_of_2(half),
            BLOCK_HQ=next_power_of_2(num_q_heads), BLOCK_HK=next_power_of_2(k.shape[1]), num_warps=4,
        )
    return q, k
