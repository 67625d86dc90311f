"""W4A16 and W8A16 on Hopper in Gluon: out^T = W x^T with the weight as wgmma's register operand and the
wgmma chain kept asynchronous across K tiles (kernels/wq_matmul.py's swapped kernel, in Triton,
waits for every wgmma: Triton 3.6's tl.dot always waits for 0 outstanding).

One K tile is 128 columns (one group, or inside one). Per tile, the weight tile [BLOCK_N, 128]
and x's tile [BLOCK_M, 128] arrive by TMA in a STAGES-deep shared-memory ring (one mbarrier a
stage); each warpgroup loads its 64 rows' words from shared memory, unpacks them to bf16 in
registers as w = q s + b, and issues the tile's wgmma (m64 nBLOCK_M k16, x^T from shared memory)
without waiting for it: the wait allows one wgmma group in flight, so tile t's MMA runs while
tile t + 1 is unpacked, and the ring stage it read is refilled only after it is done.

The unpacking is 15 instructions a word (8 weights): for s = 0..3, (w >> 4s) & 0x000F000F ORed
with bf16 0x4300 (128.0) is the pair (128 + q_s, 128 + q_{s+4}) in one register (one LOP3, and a
shift for s > 0), less 128 exactly (sub.bf16x2), times s plus b (fma.bf16x2: one rounding of
q s + b, as the dense path's bf16 weight). For that pair to be what wgmma's A fragment holds in
one register, the weight is repacked once (``repack_int4``): wgmma gives lane c of a quad, per 16
columns, the columns 2c, 2c + 1, 2c + 8, 2c + 9 (two registers) of two rows 8 apart, so a
thread's 32 columns of a row in a tile are stored as the 4 words 4c..4c + 3 of the row's 16, word
4c + i's nibble s + 4e holding column 32 i + 8 s + 2 c + e (``INT4_TILE_ORDER``). x keeps its
natural order, so TMA stages it as it lies. Scales and biases go in one int32 a group (``pack_scales``:
bf16 s low, b high).

int8 (W8A16) takes the same kernel with BITS 8: 32 words a row's tile, a thread's 8 words
8c..8c + 7 (one a 16-column step j), word 8c + j holding columns 16 j + 2c, 16 j + 2c + 8,
16 j + 2c + 1, 16 j + 2c + 9 in its bytes 0..3 (``INT8_TILE_ORDER``), each as u = q + 128. A byte
pair (0, 2) becomes the bf16x2 pair q s in 4 instructions (``_UNPACK8``): its low 7 bits ORed into
bf16 128.0's mantissa (w & 0x007F007F | 0x43004300, one LOP3) are 128 + (u & 127), and its top bit,
inverted, into the exponent's lowest bit (~w & 0x00800080 | 0x43004300, one LOP3) is 128.0 where
u >= 128 and 256.0 below; their difference is u - 128 = q exactly (every integer up to 256 is a
bf16), times s rounded once; bytes (1, 3) the same from w >> 8: 9 instructions a word of 4 weights
(13 with the nibble pairs before, 2026-11-28; the same bits out). No bias, so
a group's scale is its bf16 bits alone, one int16 (``pack_scales8``): 2 bytes a group of 128
weights, not an int32 whose high half is always zero (1.6% of int8's bytes a step, not 3.1%).

Where this kernel runs, the repacked form is the weight's only form on the GPU (a ``TiledWeight``,
built at load by kernels/wq_matmul.prepare in place of the natural nibbles): the Gluon kernel
takes 1-512 rows of x, and above that one pass dequantizes the tiles for cuBLAS
(kernels/wq_matmul.py). ``gluon_weight`` builds the same form of a natural QuantizedWeight once
and keeps it beside it (benchmarks and tests that time the paths side by side). Tiles (this kernel's and the warp-specialized one's, kernels/wq_gluon_ws.py) are timed per shape
and rows bucket at first use, from a CUDA graph over copies of the weight that miss the L2
(kernels/wq_gluon_tune.py).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch

from kernels.wquant import QuantizedWeight, unpack_int4

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # no Triton, or one without Gluon
    gluon = gl = None

HAS_GLUON = gluon is not None
# a programmatic dependent launch (the weights' first stages fetched before the wait for the
# kernel before); KVCASCADE_GLUON_PDL=0 launches it plainly (the A/B), as KVCASCADE_PDL=0 does all
PDL = os.environ.get("KVCASCADE_GLUON_PDL", "1") != "0"
# when the next kernel may be scheduled: right after the wait for the one before, or late, once
# the main loop is done (the next kernel's programs then take no SM slots from this one's). H200,
# alternating runs (docs/BENCHMARKS.md): late, int8 batch 1 3.21 against 3.33 ms, batch 16 3.34
# against 3.43, int4 -1%; batch 64 int8 4.53 against 4.37: late up to PDL_LATE_ROWS rows of x.
# KVCASCADE_GLUON_PDL_LATE=0 / 1: never / always late (A/B)
PDL_LATE_ROWS = 16
PDL_LATE = {"0": False, "1": True}.get(os.environ.get("KVCASCADE_GLUON_PDL_LATE", ""))
# ... except where the caller asks for the next kernel early (``early_next``, one row of x only).
# o_proj's and gate_up's calls do: their next kernels (gate_up, down) fetch weight stages before
# their wait. On an H200 that took 8 and 23 µs off an int4 batch-1 step one at a time, 40 together
# (int8: 52); early after qkv and down added 20 and 6 (docs/BENCHMARKS.md, 2026-11-29).
# KVCASCADE_GLUON_EARLY_NEXT=0: late there too (the A/B)
EARLY_NEXT = os.environ.get("KVCASCADE_GLUON_EARLY_NEXT", "1") != "0"


def late_launch(rows: int, early_next: bool = False) -> bool:
    """Whether a kernel over ``rows`` rows of x schedules the next kernel late (after its main loop),
    not right after its wait: PDL_LATE where set, else up to PDL_LATE_ROWS rows, unless the caller
    asked for the next one early at one row (EARLY_NEXT)."""
    if PDL_LATE is not None:
        return PDL_LATE
    return rows <= PDL_LATE_ROWS and not (early_next and EARLY_NEXT and rows == 1)


BLOCK_K = 128  # columns a tile: 16 int32 words of a row (int4), 32 (int8)
_BK = gl.constexpr(BLOCK_K) if gl else BLOCK_K  # the kernels' name for it


def _tile_order() -> torch.Tensor:
    """The column (0..127 of a tile) each nibble of a repacked row's tile holds: nibble 8 u + n
    of the tile's 16 words, u = 4 c + i, n = s + 4 e, holds column 32 i + 8 s + 2 c + e."""
    order = torch.empty(BLOCK_K, dtype=torch.long)
    for c in range(4):
        for i in range(4):
            for s in range(4):
                for e in range(2):
                    order[8 * (4 * c + i) + s + 4 * e] = 32 * i + 8 * s + 2 * c + e
    return order


INT4_TILE_ORDER = _tile_order()


def _tile_order8() -> torch.Tensor:
    """The column (0..127 of a tile) each byte of a repacked int8 row's tile holds: byte 4 u + b
    of word u = 8 c + j holds column 16 j + 2 c + (0, 8, 1, 9)[b]."""
    order = torch.empty(BLOCK_K, dtype=torch.long)
    for c in range(4):
        for j in range(8):
            for b, off in enumerate((0, 8, 1, 9)):
                order[4 * (8 * c + j) + b] = 16 * j + 2 * c + off
    return order


INT8_TILE_ORDER = _tile_order8()


def repack_int8(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> [N, K // 4] int32 words of u = q + 128 in INT8_TILE_ORDER per 128 columns."""
    n, k = qweight.shape
    assert k % BLOCK_K == 0, k
    u = (qweight.to(torch.int16) + 128).to(torch.uint8).view(n, k // BLOCK_K, BLOCK_K)
    return u[:, :, INT8_TILE_ORDER.to(u.device)].reshape(n, k).contiguous().view(torch.int32)


def repack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] packed nibbles (kernels/wquant.py's order) -> [N, K // 8] int32 words in
    INT4_TILE_ORDER per 128 columns; K a multiple of 128."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    assert k % BLOCK_K == 0, k
    q = unpack_int4(qweight).view(n, k // BLOCK_K, BLOCK_K)
    q = q[:, :, INT4_TILE_ORDER.to(q.device)].reshape(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # nibble 2j low, 2j + 1 high: byte j of the words
    return packed.contiguous().view(torch.int32)


def pack_scales(scales: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """bf16 scales and biases [N, G] -> int32 [N, G]: s in the low half, b in the high."""
    s = scales.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    b = biases.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int32)
    return s | (b << 16)


def pack_scales8(scales: torch.Tensor) -> torch.Tensor:
    """int8's scales [N, G] (no biases) -> int16 [N, G]: the bf16 bits of s."""
    return scales.to(torch.bfloat16).contiguous().view(torch.int16)


def unpack_sb(sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, b) float32 [N, G] from ``pack_scales``' int32 or ``pack_scales8``'s int16 (b zero)."""
    s = (sb.to(torch.int32) << 16).view(torch.float32)
    if sb.dtype == torch.int16:
        return s, torch.zeros_like(s)
    return s, (sb & -65536).view(torch.float32)


@dataclass(frozen=True, eq=False)
class TiledWeight:
    """An int4 weight in this kernel's form: ``words`` int32 [N, K // 8] (INT4_TILE_ORDER per 128
    columns) and ``sb`` int32 [N, K // group] (``pack_scales``); int8: words [N, K // 4]
    (INT8_TILE_ORDER) and sb int16 (``pack_scales8``). Stands where a QuantizedWeight
    does for kernels/wq_matmul.wq_matmul (shape, bits, group_size, device, nbytes, dequantize)."""

    words: torch.Tensor
    sb: torch.Tensor
    group_size: int
    bits: int = 4

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[0], self.words.shape[1] * 32 // self.bits

    @property
    def device(self) -> torch.device:
        return self.words.device

    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.sb.numel() * self.sb.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] (computed in float32), as QuantizedWeight.dequantize."""
        return dequantize_repacked(self.words, self.sb, self.group_size, self.bits).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` dequantized: an embedding lookup from a tiled (tied, int8) LM head."""
        return TiledWeight(self.words[ids], self.sb[ids], self.group_size, self.bits).dequantize(dtype)


def tile_weight(weight: QuantizedWeight) -> TiledWeight:
    """``weight`` (bf16 scales, groups of whole tiles) in this kernel's form."""
    assert weight.group_size % BLOCK_K == 0, weight.group_size
    if weight.bits == 8:
        return TiledWeight(repack_int8(weight.qweight), pack_scales8(weight.scales), weight.group_size, 8)
    return TiledWeight(repack_int4(weight.qweight), pack_scales(weight.scales, weight.biases), weight.group_size)


_orders: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on_device(order: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tile order's copy on ``device``, made once: an embedding lookup from a tiled LM head
    (TiledWeight.rows) runs inside CUDA-graph capture, where a host-to-device copy may not (met
    first by the warm-up before it)."""
    key = (id(order), device)
    if key not in _orders:
        _orders[key] = order.to(device)
    return _orders[key]


def dequantize_repacked(words: torch.Tensor, sb: torch.Tensor, group: int, bits: int = 4) -> torch.Tensor:
    """The float32 weight [N, K] that ``words`` and ``sb`` stand for (the tests' reference)."""
    n, k = words.shape[0], words.shape[1] * 32 // bits
    if bits == 8:
        q = words.contiguous().view(torch.uint8).view(n, k // BLOCK_K, BLOCK_K).to(torch.int16) - 128
        order = INT8_TILE_ORDER
    else:
        q = unpack_int4(words.contiguous().view(torch.uint8).view(n, k // 2)).view(n, k // BLOCK_K, BLOCK_K)
        order = INT4_TILE_ORDER
    natural = torch.empty_like(q)
    natural[:, :, _on_device(order, q.device)] = q
    s, b = unpack_sb(sb)
    per = group // BLOCK_K if group >= BLOCK_K else None
    assert per, "tiles lie in one group"
    s, b = s.repeat_interleave(per, 1), b.repeat_interleave(per, 1)
    return (natural.float() * s[:, :, None] + b[:, :, None]).view(n, k)


if HAS_GLUON:
    # sb (s low, b high) -> (s, s) and (b, b) as bf16x2: once a row and tile
    _SPLIT_SB = gl.constexpr("prmt.b32 $0, $2, $2, 0x1010; prmt.b32 $1, $2, $2, 0x3232;")
    # a word's 8 nibbles -> 4 bf16x2 registers (q s + b) of pairs (s, s + 4): $0..$3 from the word
    # $4, (s, s) $5 and (b, b) $6
    _UNPACK = gl.constexpr("{ .reg .b32 t, m; mov.b32 m, 0x43004300; " + "".join(
        ("lop3.b32 t, $4, " if i == 0 else f"shr.u32 t, $4, {4 * i}; lop3.b32 t, t, ")
        + f"0x000F000F, 0x43004300, 0xEA; sub.rn.bf16x2 t, t, m; fma.rn.bf16x2 ${i}, t, $5, $6; " for i in range(4))
        + "}")
    def _unpack8_asm(scaled: bool) -> str:
        """An int8 word's 4 bytes (u = q + 128) -> 2 bf16x2 registers: $0 bytes (0, 2), $1 bytes (1, 3),
        from the word $2; q s with (s, s) $3 (scaled), else q (the group-column kernel's). Module
        docstring; LOP3 0xEA: (a & b) | c, 0xAE: (~a & b) | c."""
        return "{ .reg .b32 t, a, b; " + "".join(
            ("" if i == 0 else "shr.u32 t, $2, 8; ")
            + f"lop3.b32 a, {'$2' if i == 0 else 't'}, 0x007F007F, 0x43004300, 0xEA; "  # 128 + (u & 127)
            + f"lop3.b32 b, {'$2' if i == 0 else 't'}, 0x00800080, 0x43004300, 0xAE; "  # u < 128 ? 256 : 128
            + (f"sub.rn.bf16x2 a, a, b; mul.rn.bf16x2 ${i}, a, $3; " if scaled else f"sub.rn.bf16x2 ${i}, a, b; ")
            for i in range(2)) + "}"

    _UNPACK8 = gl.constexpr(_unpack8_asm(scaled=True))

    # the group-column kernel's unpacking (kernels/wq_gluon_ws.py, one row of x): the scale and bias
    # leave the weight, applied to the tile's sums once a block of 8 tiles. int4: a word's 8 nibbles
    # -> 4 bf16x2 registers 128 + q (exact), $0..$3 from the word $4: 7 instructions a word, not 15
    _UNPACK_GC = gl.constexpr("{ .reg .b32 t; " + "".join(
        ("lop3.b32 $0, $4, " if i == 0 else f"shr.u32 t, $4, {4 * i}; lop3.b32 ${i}, t, ")
        + "0x000F000F, 0x43004300, 0xEA; " for i in range(4)) + "}")
    # int8: q exactly, without the scale: 7 instructions a word, not 9
    _UNPACK8_GC = gl.constexpr(_unpack8_asm(scaled=False))

    @gluon.constexpr_function
    def _words_layout(block_n, num_warps, bits=4):
        """[block_n, 16] int32 words (int4; int8: 32): a thread holds words 4c..4c + 3 (int8: 8c..8c + 7)
        of rows r and r + 8 of its warp's 16, the rows of wgmma's A fragment (c: the lane in its
        quad), and the same again every 16 num_warps rows (wgmma's repeats along M when a warpgroup
        owns 128 rows or more)."""
        per = bits  # words a thread's row: 4 (int4), 8 (int8)
        warps = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
        reps = [[16 * num_warps << i, 0] for i in range((block_n // (16 * num_warps)).bit_length() - 1)]
        regs = [[0, 1 << i] for i in range(per.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg_bases=regs + [[8, 0]] + reps,
                                          lane_bases=[[0, per], [0, 2 * per], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=warps, block_bases=[], shape=[block_n, 4 * per])

    @gluon.jit
    def _unpack_tile(w, sb, a_layout: gl.constexpr, BLOCK_N: gl.constexpr, BITS: gl.constexpr = 4):
        """Words [BLOCK_N, 16] (int8: 32) and their rows' (s, b) (int8: s, int16) -> the tile [BLOCK_N, 128]
        bf16 in a_layout."""
        if BITS == 8:
            sb = sb.to(gl.int32)  # _SPLIT_SB reads the low half only
        s2, b2 = gl.inline_asm_elementwise(_SPLIT_SB, "=r,=r,r", [sb], dtype=(gl.int32, gl.int32), is_pure=True,
                                           pack=1)
        s2 = gl.expand_dims(s2, 1)
        b2 = gl.expand_dims(b2, 1)
        if BITS == 8:
            r0, r1 = gl.inline_asm_elementwise(_UNPACK8, "=r,=r,r,r", [w, s2], dtype=(gl.int32, gl.int32),
                                               is_pure=True, pack=1)
            t = _arrange8(r0, r1, a_layout, BLOCK_N)
        else:
            r0, r1, r2, r3 = gl.inline_asm_elementwise(_UNPACK, "=r,=r,=r,=r,r,r,r", [w, s2, b2],
                                                       dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                       pack=1)
            t = _arrange4(r0, r1, r2, r3, a_layout, BLOCK_N)
        return t

    @gluon.jit
    def _unpack_tile_gc(w, a_layout: gl.constexpr, BLOCK_N: gl.constexpr, BITS: gl.constexpr = 4):
        """Words [BLOCK_N, 16] (int8: 32) -> the tile [BLOCK_N, 128] bf16 in a_layout without its
        scale: 128 + q (int4), q (int8)."""
        if BITS == 8:
            r0, r1 = gl.inline_asm_elementwise(_UNPACK8_GC, "=r,=r,r", [w], dtype=(gl.int32, gl.int32),
                                               is_pure=True, pack=1)
            t = _arrange8(r0, r1, a_layout, BLOCK_N)
        else:
            r0, r1, r2, r3 = gl.inline_asm_elementwise(_UNPACK_GC, "=r,=r,=r,=r,r", [w],
                                                       dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                       pack=1)
            t = _arrange4(r0, r1, r2, r3, a_layout, BLOCK_N)
        return t

    @gluon.jit
    def _arrange8(r0, r1, a_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """An int8 tile's unpacked registers (bytes (0, 2), (1, 3) of each word) as [BLOCK_N, 128] bf16."""
        # [n, u, h, e] with u = 8 c + j: column 16 j + 8 h + 2 c + e
        t = gl.join(r0, r1)
        t = gl.join(t.to(gl.int16), (t >> 16).to(gl.int16))
        t = t.reshape([BLOCK_N, 4, 8, 2, 2])  # [n, c, j, h, e]
        t = t.permute([0, 2, 3, 1, 4])  # [n, j, h, c, e]
        t = t.reshape([BLOCK_N, _BK]).to(gl.bfloat16, bitcast=True)
        return gl.convert_layout(t, a_layout, assert_trivial=True)

    @gluon.jit
    def _arrange4(r0, r1, r2, r3, a_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """An int4 tile's unpacked registers (nibble pairs (s, s + 4) of each word) as [BLOCK_N, 128] bf16."""
        # [n, u] with u = 4 c + i, pairs s = 2 s1 + s0, halves e -> column 32 i + 16 s1 + 8 s0 + 2 c + e
        t = gl.join(gl.join(r0, r1), gl.join(r2, r3))  # [n, u, s0, s1]
        t = gl.join(t.to(gl.int16), (t >> 16).to(gl.int16))  # [n, u, s0, s1, e]
        t = t.reshape([BLOCK_N, 4, 4, 2, 2, 2])  # [n, c, i, s0, s1, e]
        t = t.permute([0, 2, 4, 3, 1, 5])  # [n, i, s1, s0, c, e]
        t = t.reshape([BLOCK_N, _BK]).to(gl.bfloat16, bitcast=True)
        return gl.convert_layout(t, a_layout, assert_trivial=True)

    @gluon.jit
    def _tile(i, t0, tiles, acc, sb, sb_ptrs, x_desc, w_desc, x_smem, w_smem, bars, off_m, off_n,
              a_layout: gl.constexpr, w_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              TPG: gl.constexpr, INFLIGHT: gl.constexpr, BITS: gl.constexpr):
        """Tile i of the program's split: its wgmma issued, tile i - 1's retired (INFLIGHT 1), and
        tile i - 1's stage refilled with tile i + STAGES - 1. Returns acc and tile i + 1's (s, b)."""
        stage = i % STAGES
        sb_next = gl.load(sb_ptrs + (t0 + gl.minimum(i + 1, tiles - 1)) // TPG)  # a tile ahead: its latency hidden
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        a = _unpack_tile(w_smem.index(stage).load(w_layout), sb, a_layout, BLOCK_N, BITS)
        acc = warpgroup_mma(a, x_smem.index(stage).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=INFLIGHT, deps=(acc, ))  # 0: the A/B without overlap
        # tile i - 1's wgmma is done in this warpgroup; the barrier makes it every warpgroup's (and
        # every warp's reads of its words) before its stage is refilled
        gl.thread_barrier()
        nxt = i + STAGES - 1
        ns = nxt % STAGES
        pred = nxt < tiles
        mbarrier.expect(bars.index(ns), x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [off_m, (t0 + nxt) * _BK], bars.index(ns), x_smem.index(ns), pred)
        tma.async_copy_global_to_shared(w_desc, [off_n, (t0 + nxt) * (_BK * BITS // 32)], bars.index(ns),
                                        w_smem.index(ns), pred)
        return acc, sb_next

    @gluon.jit
    def _wq_gluon_kernel(x_desc, w_desc, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N, K, stride_sb,
                         stride_om, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
                         BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr, num_warps: gl.constexpr,
                         INFLIGHT: gl.constexpr = 1, USE_PDL: gl.constexpr = False, BITS: gl.constexpr = 4,
                         LATE_LAUNCH: gl.constexpr = False, ACT: gl.constexpr = False, res_ptr=None,
                         nw_ptr=None, ss_ptr=None, n_parts=0, eps=0.0,
                         NORM_OUT: gl.constexpr = False, NORM_IN: gl.constexpr = False):
        """Program (i, j, s) owns out[j BLOCK_M:, i BLOCK_N:] over split s of K's tiles (the host
        makes the splits equal, of an even number of tiles). A warpgroup owns BLOCK_N / (num_warps /
        4) rows (64 or 128: one or two wgmma along M). INFLIGHT: wgmma groups left in flight at
        each tile's wait (1; 0 waits for each tile's, as tl.dot does). USE_PDL: launched as a
        programmatic dependent launch (kernels/_triton.py). BITS: 4 or 8 (the weight's words). ACT:
        out is a gated MLP's gate|up and act_ptr also gets silu(gate) * up (_silu_pair). NORM_OUT,
        NORM_IN: one row of x, an add-RMS norm split across two projections (_norm_out, _rms_parts)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        w_layout: gl.constexpr = _words_layout(BLOCK_N, num_warps, BITS)
        row_layout: gl.constexpr = gl.SliceLayout(1, w_layout)
        WPT: gl.constexpr = _BK * BITS // 32  # words a row's tile
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        tiles = K // _BK // SPLIT_K
        gl.assume(tiles >= 2)  # no zero-trip path: ptxas serialized the wgmmas over its code after the loop
        t0 = gl.program_id(2) * tiles
        off_n = pid_n * BLOCK_N
        off_m = pid_m * BLOCK_M

        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, _BK], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, WPT], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
        # the weights (and scales) first: no kernel writes them, so they are fetched before the
        # wait for the kernel before this one (PDL), while it drains
        for i in gl.static_range(STAGES - 1):
            pred = i < tiles
            mbarrier.expect(bars.index(i), nbytes, pred=pred)
            tma.async_copy_global_to_shared(w_desc, [off_n, (t0 + i) * WPT], bars.index(i), w_smem.index(i), pred)
        rows = gl.minimum(off_n + gl.arange(0, BLOCK_N, layout=row_layout), N - 1)  # edge rows re-read row N - 1
        sb_ptrs = sb_ptr + rows.to(gl.int64) * stride_sb
        TPG: gl.constexpr = GROUP // _BK  # tiles a group
        sb = gl.load(sb_ptrs + t0 // TPG)
        if USE_PDL:  # x (and out, ws) only after it
            _pdl_wait(not LATE_LAUNCH)
        if NORM_IN:
            inv_rms = _inv_rms(_rms_parts(ss_ptr, n_parts, num_warps), K, eps)
        for i in gl.static_range(STAGES - 1):
            tma.async_copy_global_to_shared(x_desc, [off_m, (t0 + i) * _BK], bars.index(i), x_smem.index(i),
                                            i < tiles)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        # two tiles an iteration: a wgmma reads its A registers until it completes, so the tile
        # unpacked while it runs must go to other registers (one loop body for each tile: the
        # next iteration rewrites a tile's registers after the wait that retired its wgmma)
        for j in range(tiles // 2):
            acc, sb = _tile(2 * j, t0, tiles, acc, sb, sb_ptrs, x_desc, w_desc, x_smem, w_smem, bars, off_m, off_n,
                            a_layout, w_layout, BLOCK_N, STAGES, TPG, INFLIGHT, BITS)
            acc, sb = _tile(2 * j + 1, t0, tiles, acc, sb, sb_ptrs, x_desc, w_desc, x_smem, w_smem, bars, off_m,
                            off_n, a_layout, w_layout, BLOCK_N, STAGES, TPG, INFLIGHT, BITS)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if USE_PDL and LATE_LAUNCH:
            _pdl_launch()
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        if NORM_IN:
            acc = acc * inv_rms

        _store(acc, off_n, off_m, pid_n, pid_m, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N, stride_om, mma,
               HAS_BIAS, BLOCK_N, BLOCK_M, SPLIT_K, ACT, res_ptr, nw_ptr, ss_ptr, NORM_OUT)

    @gluon.jit
    def _pdl_wait(LAUNCH: gl.constexpr = True):
        """kernels/_triton.py's wait_for_producer in Gluon (LAUNCH: and the next kernel scheduled now)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        if LAUNCH:
            _pdl_launch()

    @gluon.jit
    def _pdl_launch():
        """The next kernel (launched with PDL) may be scheduled once every program got here."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _store(acc, off_n, off_m, pid_n, pid_m, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N, stride_om,
               mma: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
               SPLIT_K: gl.constexpr, ACT: gl.constexpr = False, res_ptr=None, nw_ptr=None,
               ss_ptr=None, NORM_OUT: gl.constexpr = False):
        """acc [BLOCK_N, BLOCK_M] (out^T) into out (+ bias); with SPLIT_K > 1 the splits add into ws
        (fp32 [M, N], zero) and the last to count in stores and re-zeroes. ACT: then _silu_pair.
        NORM_OUT: not out itself but an add-RMS norm's elementwise part of it (_norm_out)."""
        gl.static_assert(not (ACT and NORM_OUT))
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        mask = gl.expand_dims(offs_n < N, 1) & gl.expand_dims(offs_m < M, 0)
        out_ptrs = out_ptr + gl.expand_dims(offs_m, 0) * stride_om + gl.expand_dims(offs_n, 1)
        if NORM_OUT:  # asked for first (by every split): their round trip overlaps the count's
            res = gl.load(res_ptr + gl.expand_dims(offs_m, 0) * N + gl.expand_dims(offs_n, 1), mask=mask, other=0.0)
            nw = gl.load(nw_ptr + gl.minimum(offs_n, N - 1))
        if SPLIT_K > 1:
            ws_ptrs = ws_ptr + gl.expand_dims(offs_m, 0) * N + gl.expand_dims(offs_n, 1)
            gl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
            gl.thread_barrier()  # every thread's adds issued before the count (released by the atomic)
            tile = pid_m * gl.num_programs(0) + pid_n
            if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:
                acc = gl.atomic_xchg(ws_ptrs, gl.zeros_like(acc), mask=mask, sem="relaxed")
                if HAS_BIAS:
                    acc += gl.expand_dims(gl.load(bias_ptr + gl.minimum(offs_n, N - 1)).to(gl.float32), 1)
                if NORM_OUT:
                    _norm_out(acc, res, nw, offs_n, offs_m, mask, pid_n, out_ptr, res_ptr, ss_ptr, M, N,
                              stride_om)
                else:
                    gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
                if ACT:
                    _silu_pair(acc, offs_n, offs_m, mask, pid_n, pid_m, out_ptr, cnt_ptr, act_ptr, N, stride_om)
        else:
            if HAS_BIAS:
                acc += gl.expand_dims(gl.load(bias_ptr + gl.minimum(offs_n, N - 1)).to(gl.float32), 1)
            if NORM_OUT:
                _norm_out(acc, res, nw, offs_n, offs_m, mask, pid_n, out_ptr, res_ptr, ss_ptr, M, N, stride_om)
            else:
                gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            if ACT:
                _silu_pair(acc, offs_n, offs_m, mask, pid_n, pid_m, out_ptr, cnt_ptr, act_ptr, N, stride_om)

    @gluon.jit
    def _norm_out(acc, res, nw, offs_n, offs_m, mask, pid_n, out_ptr, res_ptr, ss_ptr, M, N, stride_om):
        """The elementwise part of the add-RMS norm after this projection, in its epilogue (one
        row of x; kernels/wq_matmul.py's wq_matmul_norm): h = out + res, rounded as kernels/rmsnorm.py
        rounds it, over res (the residual, in place: a pointer fewer held through the main loop,
        which spilled int8's two-consumer tile); nw h, rounded, into out (the next projection's x);
        and the tile's sum of h^2 per row into ss[row, tile], which the next projection adds up for
        the norm's 1 / rms and applies to its sums (_rms_parts, _inv_rms): no norm kernel between."""
        rows = gl.expand_dims(offs_m, 0)
        cols = gl.expand_dims(offs_n, 1)
        h = (acc.to(out_ptr.dtype.element_ty).to(gl.float32) + res.to(gl.float32)).to(res_ptr.dtype.element_ty)
        gl.store(res_ptr + rows * N + cols, h, mask=mask)
        hf = gl.where(mask, h.to(gl.float32), 0.0)
        xn = gl.expand_dims(nw.to(gl.float32), 1) * hf
        gl.store(out_ptr + rows * stride_om + cols, xn.to(out_ptr.dtype.element_ty), mask=mask)
        gl.store(ss_ptr + offs_m * gl.num_programs(0) + pid_n, gl.sum(hf * hf, axis=0), mask=offs_m < M)

    @gluon.jit
    def _rms_parts(ss_ptr, n_parts, num_warps: gl.constexpr):
        """The norm's partial sums of squares that the projection before wrote (_norm_out, one row
        of x), a lane each, asked for right after the wait for that kernel and summed at once
        (_inv_rms): the first tile's x, asked for after the same wait, takes as long to come.
        (Summed after the main loop instead, the step measured the same: int4 batch 1 1.937 ms
        against 1.935-1.938 on two H200s, docs/BENCHMARKS.md.)"""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        offs = gl.arange(0, 32 * num_warps, layout=layout)
        return gl.load(ss_ptr + offs, mask=offs < n_parts, other=0.0)

    @gluon.jit
    def _inv_rms(parts, K, eps):
        """1 / rms of the row whose partial sums of squares are ``parts`` (_rms_parts)."""
        return gl.rsqrt(gl.sum(parts, axis=0) / K + eps)

    @gluon.jit
    def _silu_pair(acc, offs_n, offs_m, mask, pid_n, pid_m, out_ptr, cnt_ptr, act_ptr, N, stride_om):
        """A gated MLP's activation in the gate|up projection's epilogue: act [M, N / 2] = silu(gate)
        * up, rounded as kernels/activation.py's kernel rounds it. Output tile n of the gate half
        (columns < N / 2) pairs with tile n + N / 2 (the host makes N / 2 a multiple of BLOCK_N);
        whichever of the two stores second, by a counter a pair after the split counters, reads the
        other's stored tile back (from the L2) and writes act: no kernel between this projection and
        the down projection."""
        half = N // 2
        pairs = gl.num_programs(0) // 2
        counter = cnt_ptr + gl.num_programs(0) * gl.num_programs(1) + pid_m * pairs + pid_n % pairs
        gl.thread_barrier()  # every thread's stores issued before the count (released by the atomic)
        if gl.atomic_add(counter, 1, sem="acq_rel") == 1:
            is_gate = pid_n < pairs
            side = is_gate.to(gl.int32)  # 1: this tile is the gate's, its partner N / 2 columns on
            rows = gl.expand_dims(offs_m, 0)
            cols = gl.expand_dims(offs_n, 1)
            other = gl.load(out_ptr + rows * stride_om + cols + (2 * side - 1) * half, mask=mask,
                            cache_modifier=".cg").to(gl.float32)
            mine = acc.to(out_ptr.dtype.element_ty).to(gl.float32)  # as stored
            g = gl.where(is_gate, mine, other)
            u = gl.where(is_gate, other, mine)
            act = (g / (1.0 + gl.exp(-g))).to(out_ptr.dtype.element_ty).to(gl.float32) * u
            gl.store(act_ptr + rows * half + cols - (1 - side) * half, act.to(act_ptr.dtype.element_ty), mask=mask)
            gl.atomic_xchg(counter, 0, sem="relaxed")


WS_MAXNREG = {8: 64, 16: 64, 32: 80, 64: 80}  # the warp-specialized kernel's register cap, by BLOCK_M


_repacked: dict[tuple, tuple] = {}


def gluon_weight(weight: QuantizedWeight | TiledWeight) -> TiledWeight:
    """``weight`` in this kernel's form: a TiledWeight as it is; a natural QuantizedWeight's
    repacked once and kept while its qweight lives (a cache keyed by the packed tensor)."""
    if isinstance(weight, TiledWeight):
        return weight
    q = weight.qweight
    key = (q.data_ptr(), tuple(q.shape), weight.scales.data_ptr())
    hit = _repacked.get(key)
    if hit is not None and hit[0]() is q:
        return hit[1]
    assert not (q.is_cuda and torch.cuda.is_current_stream_capturing()), \
        "wq_gluon: a weight first met inside CUDA-graph capture"
    tiled = tile_weight(weight)
    _repacked[key] = (weakref.ref(q), tiled)
    return tiled


def gluon_fits(x: torch.Tensor, weight: QuantizedWeight | TiledWeight) -> bool:
    """Whether the kernel takes this call: Gluon on an sm_90 GPU, bf16 x and scales, int4 in
    groups of whole tiles, an even number of tiles along K (two a loop iteration), and x as TMA
    reads it (rows 16-byte aligned)."""
    if not (HAS_GLUON and x.is_cuda and x.dtype == torch.bfloat16 and weight.bits in (4, 8)):
        return False
    tiled = isinstance(weight, TiledWeight)
    if torch.cuda.get_device_capability(x.device) != (9, 0) or not (tiled or weight.scales.dtype == torch.bfloat16):
        return False
    return x_fits(x) and weight.group_size % BLOCK_K == 0 and x.shape[1] % (2 * BLOCK_K) == 0


def x_fits(x: torch.Tensor) -> bool:
    """x as the kernel's TMA descriptor reads it: unit column stride, rows 16-byte aligned."""
    return x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
