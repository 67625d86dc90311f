"""Weight-only quantization's packed layout, in plain torch: the one definition the loaders, the
CPU path, the Triton kernels (wq_matmul.py) and their references share.

A projection's weight W [N, K] (N outputs, K inputs) is cut along K into groups of
``group_size`` columns; each row's group has its own scale s (and for 4 bits a bias b):

    bits 8:  qweight int8 [N, K]            w = q * s             q in [-127, 127]
    bits 4:  qweight uint8 [N, K // 2]      w = q * s + b         q in [0, 15]; byte j of a row holds
                                                                  column 2j (low nibble), 2j+1 (high)
    scales, biases: [N, K // group_size], float (the model's dtype on a GPU, float32 on CPU)

``w = q * s + b`` takes every 4-bit format users bring without loss: symmetric int4 (b = -8 s),
GGUF Q4_0 (b = -8 d), Q4_1 (b = m), Q4_K (s = d * sc, b = -dmin * m) and GPTQ/AWQ's integer zero
points (b = -z s). Quantizing a float weight here (``quantize``):

    int8: symmetric, s = amax(|w|) / 127, q = round(w / s)
    int4: asymmetric over the group's range [lo, hi] = c [min, max], with c in _INT4_SHRINKS the
          one of least squared error: s = (hi - lo) / 15, b = lo, q = clamp(round((w - b) / s), 0, 15)

(int4 symmetric, s = amax / 7, measured 11% relative error per layer on SmolLM2 and +50%
perplexity: docs/BENCHMARKS.md.)

A ``QuantizedWeight`` narrows like a tensor (rows freely, columns on group boundaries) and
``copy_`` fills it from a float tensor (quantizing) or another QuantizedWeight (the same format:
copied; another: dequantized and quantized again), so tensor-parallel loaders slice it as they
slice a dense weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)
GROUP_SIZES = (16, 32, 64, 128, 256)
_QMAX = 127.0  # int8
# int4 tries these shrinks of a group's [min, max] and keeps the least squared error: an outlier
# then costs one clipped weight rather than a coarser step for all (llama.cpp's Q4_K and HQQ
# search likewise); on SmolLM2 (groups of 64) symmetric int4 (s = amax / 7) left 11-13% relative
# error per projection, min-max with this search 7.6-9.5% (docs/BENCHMARKS.md)
_INT4_SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
_EPS = 1e-12  # an all-zero group: any scale gives zeros; this one never divides by zero


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor | None  # bits 4 only
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        assert self.bits in BITS, self.bits
        assert (self.biases is None) == (self.bits == 8), "4-bit weights carry biases, 8-bit ones none"

    @property
    def shape(self) -> tuple[int, int]:
        n, packed = self.qweight.shape
        return n, packed * (2 if self.bits == 4 else 1)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.biases) if t is not None)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight | torch.Tensor:
        """Rows (dim 0) or columns (dim 1); columns off the group grid come back dequantized."""
        if dim == 0:
            return QuantizedWeight(self.qweight.narrow(0, start, length), self.scales.narrow(0, start, length),
                                   None if self.biases is None else self.biases.narrow(0, start, length),
                                   self.bits, self.group_size)
        assert dim == 1, dim
        g = self.group_size
        if start % g or length % g:
            return self.dequantize().narrow(1, start, length)
        per = 2 if self.bits == 4 else 1
        return QuantizedWeight(self.qweight.narrow(1, start // per, length // per),
                               self.scales.narrow(1, start // g, length // g),
                               None if self.biases is None else self.biases.narrow(1, start // g, length // g),
                               self.bits, g)

    def copy_(self, src: torch.Tensor | QuantizedWeight) -> None:
        if tuple(src.shape) != self.shape:
            raise ValueError(f"shape {tuple(src.shape)} != {self.shape}")
        if not (isinstance(src, QuantizedWeight) and (src.bits, src.group_size) == (self.bits, self.group_size)):
            src = quantize(src.dequantize() if isinstance(src, QuantizedWeight) else src, self.bits, self.group_size)
        self.qweight.copy_(src.qweight)
        self.scales.copy_(src.scales)
        if self.biases is not None:
            self.biases.copy_(src.biases)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] this stands for (computed in float32)."""
        q = unpack_int4(self.qweight) if self.bits == 4 else self.qweight
        n, k = self.shape
        w = q.float().view(n, k // self.group_size, self.group_size) * self.scales.float().unsqueeze(-1)
        if self.biases is not None:
            w = w + self.biases.float().unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` dequantized: an embedding lookup from a quantized (tied) LM head."""
        sub = QuantizedWeight(self.qweight[ids], self.scales[ids],
                              None if self.biases is None else self.biases[ids], self.bits, self.group_size)
        return sub.dequantize(dtype)


def empty_quantized(n: int, k: int, bits: int, group_size: int, scale_dtype: torch.dtype,
                    device: torch.device | str | None = None) -> QuantizedWeight:
    """Zeros (a zero weight) of this shape and format, to be filled with ``copy_``."""
    check_format(k, bits, group_size)
    groups = k // group_size
    q = torch.zeros(n, k // 2 if bits == 4 else k, dtype=torch.uint8 if bits == 4 else torch.int8, device=device)
    scales = torch.zeros(n, groups, dtype=scale_dtype, device=device)
    biases = torch.zeros(n, groups, dtype=scale_dtype, device=device) if bits == 4 else None
    return QuantizedWeight(q, scales, biases, bits, group_size)


def check_format(k: int, bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise ValueError(f"quantized weights have 4 or 8 bits, not {bits}")
    if group_size <= 0 or k % group_size or (bits == 4 and group_size % 2):
        raise ValueError(f"group size {group_size} does not divide the {k} input columns")


def quantize(w: torch.Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """Per-group quantization of a float weight [N, K] (the module docstring's formulas); scales
    in float32 (a packed projection's buffers take them in their own dtype)."""
    n, k = w.shape
    check_format(k, bits, group_size)
    wf = w.float().reshape(n, k // group_size, group_size)
    if bits == 8:
        scale = wf.abs().amax(-1).clamp_min(_EPS) / _QMAX
        q = torch.round(wf / scale.unsqueeze(-1))
        return QuantizedWeight(q.clamp(-_QMAX, _QMAX).to(torch.int8).view(n, k), scale, None, 8, group_size)
    # int4: asymmetric, over the group's [min, max] shrunk by the factor of least squared error
    lo_all, hi_all = wf.amin(-1), wf.amax(-1)
    best = None
    for shrink in _INT4_SHRINKS:
        lo, hi = lo_all * shrink, hi_all * shrink
        s = ((hi - lo) / 15).clamp_min(_EPS)
        q = torch.round((wf - lo.unsqueeze(-1)) / s.unsqueeze(-1)).clamp(0, 15)
        err = (q * s.unsqueeze(-1) + lo.unsqueeze(-1) - wf).square().sum(-1)
        if best is None:
            best = [err, q, s, lo]
            continue
        better = err < best[0]
        best[0] = torch.where(better, err, best[0])
        best[1] = torch.where(better.unsqueeze(-1), q, best[1])
        best[2] = torch.where(better, s, best[2])
        best[3] = torch.where(better, lo, best[3])
    _, q, s, lo = best
    return QuantizedWeight(pack_int4(q.to(torch.uint8).view(n, k)), s, lo, 4, group_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 (uint8) -> [N, K // 2] bytes: column 2j low nibble, 2j+1 high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: [N, K // 2] bytes -> [N, K] values 0..15 (uint8)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(packed.shape[0], -1)
