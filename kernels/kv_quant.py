"""The quantized KV cache's format, in plain torch: the one definition the kernels, their
references and the torch attention backend share.

A quantized pool keeps, per layer, K and V as ``[num_blocks, block_size, KVH, D]`` in int8 or
fp8 (e4m3) and beside each a float32 scale per token and KV head, ``[num_blocks, KVH,
block_size]``. Heads come before tokens because an attention program owns one KV head: its
scales for a block are then block_size contiguous floats, where a token-major layout cost a
32-byte sector for each token's 4 bytes. Slot s's scale of head h is at ``[s // block_size, h,
s % block_size]``. The scale is computed when the token is written, from that token's head
vector alone:

    scale = max(amax(|x|), EPS) / QMAX        (QMAX: 127 for int8, 448 for fp8 e4m3)
    stored = round(x / scale)                  int8: half away from zero; fp8: the cast's own rounding
    x ~= stored * scale

A scale per token and head costs 4 bytes against D (128) bytes of data: 3%. It needs no
calibration and follows the outliers of each token (RoPE'd keys of a few heads run 10x the
others), where one scale per head would be set by the worst token it ever sees.
"""

from __future__ import annotations

import torch

EPS = 1e-6  # an all-zero vector stores zeros with a tiny scale, never a division by zero
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}

# --kv-cache-dtype names -> the pool's storage dtype (auto: the model's dtype, no scales)
KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] -> (stored [..., D] in ``dtype``, scale [...] float32)."""
    qmax = QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(EPS) / qmax
    y = (xf / scale.unsqueeze(-1)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5))
    return y.to(dtype), scale


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_kv``, in ``dtype``."""
    return (stored.float() * scale.unsqueeze(-1)).to(dtype)


def token_major(scales: torch.Tensor) -> torch.Tensor:
    """A pool's scales ``[num_blocks, KVH, block_size]`` as a view ``[num_blocks, block_size, KVH]``,
    indexed by (block, offset) as the K/V data are; writes through it land in the pool."""
    return scales.transpose(1, 2)
