"""GGUF's quantized blocks repacked into kernels/wquant.py's layout, without a float copy.

Each format below maps exactly (the same q, scales and biases; no rounding added):

    Q4_0  32 weights: f16 d, 16 bytes of nibbles     w = d (q - 8)            -> int4, group 32
    Q4_1  32 weights: f16 d, f16 m, 16 bytes         w = d q + m              -> int4, group 32
    Q4_K  256 weights: f16 d, dmin, 12 bytes of      w = d sc_j q - dmin m_j  -> int4, group 32
          6-bit (sc_j, m_j) for 8 sub-blocks, 128 bytes of nibbles
    Q5_0  32 weights: f16 d, 4 bytes of high bits,   w = d (q - 16)           -> int8, group 32
          16 bytes of low nibbles
    Q8_0  32 weights: f16 d, 32 int8                 w = d q                  -> int8, group 32
    Q6_K  256 weights: 128 bytes low nibbles, 64 of  w = d sc_j (q - 32)      -> int8, group 16
          high 2-bit pairs, 16 int8 scales, f16 d

In the nibble formats, byte j of a 32-weight (sub-)block holds weight j in its low nibble and
weight j + 16 in its high one (Q4_K: a 32-byte run holds two sub-blocks, low then high); Q5_0's
high bits are a little-endian 32-bit word, bit j weight j's. Other types (F32, F16, Q5_1, Q5_K, ...)
are not repacked: they are dequantized by the ``gguf`` package as before. (llama.cpp's Q4_K_M stores
a projection whose inputs are not a multiple of 256 in Q5_0: most of Qwen2.5-0.5B's, 896 wide.)
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.wquant import QuantizedWeight, pack_int4

# GGML type name -> (bits, group size) of its exact repacking
REPACKED = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q5_0": (8, 32), "Q8_0": (8, 32), "Q6_K": (8, 16)}


def repack(data: np.ndarray, type_name: str, rows: int, cols: int) -> QuantizedWeight:
    """A GGUF tensor's raw blocks ``data`` (uint8, rows x bytes) as a QuantizedWeight [rows, cols]."""
    blocks = np.ascontiguousarray(data).reshape(rows, -1)
    q, scales, biases = _UNPACK[type_name](blocks, rows)
    bits, group = REPACKED[type_name]
    q = torch.from_numpy(np.ascontiguousarray(q.reshape(rows, cols)))
    scales = torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, cols // group), dtype=np.float32))
    if bits == 4:
        biases = torch.from_numpy(np.ascontiguousarray(biases.reshape(rows, cols // group), dtype=np.float32))
        return QuantizedWeight(pack_int4(q), scales, biases, 4, group)
    return QuantizedWeight(q, scales, None, 8, group)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles are weights 0..15, high ones 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q4_0(blocks, rows):
    b = blocks.reshape(rows, -1, 18)
    d = _f16(b[..., :2])
    return _nibbles32(b[..., 2:]), d, -8.0 * d


def _q4_1(blocks, rows):
    b = blocks.reshape(rows, -1, 20)
    d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
    return _nibbles32(b[..., 4:]), d, m


def _q4_k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = sc.reshape(*sc.shape[:-1], 3, 4)
    lo, hi, mixed = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    scale = np.concatenate((lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)), axis=-1)
    mins = np.concatenate((hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)), axis=-1)
    return scale.astype(np.float32), mins.astype(np.float32)


def _q4_k(blocks, rows):
    b = blocks.reshape(rows, -1, 144)
    d, dmin = _f16(b[..., :2]), _f16(b[..., 2:4])
    sc, m = _q4_k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(rows, -1, 4, 32)  # 4 runs of 32 bytes: sub-blocks 2r (low), 2r + 1 (high)
    q = np.stack((qs & 0x0F, qs >> 4), axis=-2)  # [rows, blocks, 4, 2, 32]
    return q, d * sc, -(dmin * m)


def _q5_0(blocks, rows):
    b = blocks.reshape(rows, -1, 22)
    high = np.ascontiguousarray(b[..., 2:6]).view("<u4") >> np.arange(32, dtype=np.uint32) & 1
    q = (_nibbles32(b[..., 6:]) | (high << 4).astype(np.uint8)).astype(np.int16) - 16
    return q.astype(np.int8), _f16(b[..., :2]), None


def _q8_0(blocks, rows):
    b = blocks.reshape(rows, -1, 34)
    return np.ascontiguousarray(b[..., 2:]).view(np.int8), _f16(b[..., :2]), None


def _q6_k(blocks, rows):
    b = blocks.reshape(rows, -1, 210)
    ql, qh = b[..., :128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    # 256 weights in two halves of 128: ql's 64 bytes give weights 0-63 (low nibbles) and 64-127
    # (high); qh's 32 bytes give each weight's 2 high bits, 4 pairs a byte
    low = ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (low & 0x0F).reshape(rows, -1, 2, 4, 32)
    high = qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = (high & 0x03).reshape(rows, -1, 2, 4, 32)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    return q, d * sc, None


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q6_K": _q6_k}
