"""GPTQ and AWQ 4-bit safetensors checkpoints (as AutoGPTQ / GPTQModel and AutoAWQ write them)
read into kernels/wquant.py's layout, exactly and without a float copy.

A projection ``P`` [N outputs, K inputs] is stored as ``P.qweight``, ``P.qzeros`` and ``P.scales``
(fp16, [K / group, N]); each weight is ``w = s (q - z)`` with 4-bit q and z:

    GPTQ  qweight int32 [K / 8, N]: 8 consecutive inputs a word, lowest bits first
          qzeros  int32 [K / group, N / 8]: 8 consecutive outputs a word; the stored zero is
                  z - 1 (the ``gptq`` v1 format every released checkpoint uses)
          g_idx   int32 [K] (optional): the group of each input; act-order (desc_act) checkpoints
                  permute it, which groups of contiguous columns cannot hold: those are dequantized
    AWQ   qweight int32 [K, N / 8] and qzeros int32 [K / group, N / 8]: 8 outputs a word, in the
          order 0, 2, 4, 6, 1, 3, 5, 7 (AutoAWQ's GEMM layout), zeros stored as they are

In kernels/wquant.py's terms: the scale s, and the bias b = -z s, per output row and group.
"""

from __future__ import annotations

import torch

from kernels.wquant import QuantizedWeight, pack_int4

METHODS = ("gptq", "awq")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ packs outputs 0, 2, 4, 6, 1, 3, 5, 7 into a word's nibbles


def unpack_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words of 8 nibbles (lowest first) -> their values 0..15, spread along ``dim``."""
    nib = (words.unsqueeze(-1) >> _SHIFTS) & 0xF  # [..., 8]
    nib = nib.movedim(-1, dim + 1) if dim != words.dim() - 1 else nib
    shape = list(words.shape)
    shape[dim] *= 8
    return nib.reshape(shape).to(torch.uint8)


def quantization_method(hf_config: dict) -> tuple[str, int] | None:
    """(method, group size) of a config.json's 4-bit GPTQ / AWQ quantization_config, else None."""
    q = hf_config.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method not in METHODS:
        return None
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits} bits are not supported (4 bits are)")
    group = q.get("group_size", q.get("q_group_size", 128))
    return method, int(group)


def to_quantized(method: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor | None = None) -> QuantizedWeight | torch.Tensor:
    """One projection's tensors -> a QuantizedWeight [N, K] (or, for act-order GPTQ, its float weight)."""
    groups, n = scales.shape
    s = scales.float()
    if method == "gptq":
        q = unpack_words(qweight, 0)  # [K, N]
        z = unpack_words(qzeros, 1).float() + 1  # [groups, N]
    else:
        order = torch.tensor(AWQ_ORDER).argsort()  # the nibble that holds output j of a word
        q = unpack_words(qweight, 1).view(qweight.shape[0], -1, 8)[..., order].reshape(qweight.shape[0], -1)
        z = unpack_words(qzeros, 1).view(groups, -1, 8)[..., order].reshape(groups, -1).float()
    k = q.shape[0]
    group = k // groups
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        # act-order: column k belongs to group g_idx[k], not k // group
        return ((q.float() - z[g_idx.long()]) * s[g_idx.long()]).t().contiguous()
    return QuantizedWeight(pack_int4(q.t().contiguous()), s.t().contiguous(), (-z * s).t().contiguous(), 4, group)
