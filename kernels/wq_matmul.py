"""``x @ W.T (+ bias)`` with W stored packed (kernels/wquant.py): W8A16 and W4A16.

Paths by rows of x (decode_path; the crossovers were measured on an H200):
- 1 row (GEMV_ROWS; int4: 2): a GEMV on the CUDA cores, no dot. The packed weight is read as int32 words
  (8 nibbles or 4 bytes each), 4 words of 8 rows a thread; a weight becomes a float without any
  conversion: an integer n < 2^24 read as a float32 is n 2^-149 exactly, so a nibble or byte
  ANDed out in place at bit p is the float q 2^(p - 149) (one AND a weight; int8's sign flipped
  to q + 128 on the way; the top byte shifted down), and x's column is prescaled by the power of
  two that makes every product x q 2^-64: exact, normal, and with no constant part to take out.
  Per word the FMA chain's sum is scaled once by its group's scale, plus b sum(x) for int4's bias
  (-128 s sum(x) for int8's offset), into per-element fp32 sums reduced once at the end. x is
  loaded once a tile (bf16: 16 bytes a word) and reused over the thread's 8 rows. On a GPU the
  scales and x are read by inline asm in the tile's own register layout (_ld_scale): tl.load gave
  the per-row scales a layout of their own and converted it through shared memory, two barriers a
  tile right behind the load, and took 245 registers (now 168) for int4's 8 rows. Few output
  blocks split K (SPLITS): the splits add into an fp32 workspace and the last one writes the
  output and zeroes it again, so no extra launch, and nothing allocated per call (CUDA graphs).
- int4 and int8 (groups of 128 or more), bf16, on sm_90: kernels/wq_gluon.py, the swapped
  kernel's idea in Gluon with the wgmma chain kept asynchronous across K tiles, on the weight
  repacked into wgmma's fragment order. The engine's weights are repacked at load (``prepare``: a
  TiledWeight, their only form there), and take the Gluon kernel from 1 row to GLUON_ROWS' last
  (512), dequantize + cuBLAS above; a natural weight (benchmarks, tests) takes it at GLUON_ROWS
  (int4 3-512, int8 2-512) through a repacked copy kept beside it. GLUON = False
  (KVCASCADE_GLUON=0) turns it off: natural weights, the paths below.
- up to SWAP_MAX_ROWS rows: the swapped kernel, out^T = W x^T. The weight tile is the dot's first
  operand, which Hopper's wgmma takes from registers (its second only from shared memory), so the
  unpacked tile goes straight from registers into the tensor cores; each K tile is one group (or
  lies in one), so the dot runs on the integers and the scale is applied to its [BLOCK_N, BLOCK_M]
  result (int4's bias times sum(x) likewise); int4 nibbles ORed into bf16 0x4300 are 128 + q
  with no conversion instruction. PERM maps the dot's K positions so that each lane's weight
  bytes are contiguous (x is read in that order). Groups of no power of two take the older
  paths: up to DECODE_MAX_ROWS the "dequant" kernel (q * s + b per weight into the dot's second
  operand), above it "dense".
- "dense" (more rows): the weight dequantized in one pass to a transient copy in x's dtype, then
  cuBLAS. Dequantizing in the older kernel's main loop (weight as the second operand) measured
  2.5-3x cuBLAS's time at 512-2048 rows (docs/BENCHMARKS.md); the copy costs a write and a read
  of the dense weight per call. Doing it in L2-sized slabs of rows, cuBLAS on each right after it
  is written, measured 1.2-2x slower than the whole copy at 64-2048 rows on an H200, also over 2-8
  streams (each slab's cuBLAS grid is small and re-reads x; docs/BENCHMARKS.md, seventh run).

Tiles (and the GEMV's split) are tuned per (N, K, format, rows) at first use: the engine's
warm-up, before CUDA-graph capture; the choices are kept on disk for the next start (Triton's
autotuners in Triton's cache folder, the Gluon tiles by kernels/tune_cache.py). Measured on an
H200 (docs/BENCHMARKS.md): the GEMV reads int4 at 1.4-2.1 TB/s and int8 at 1.9-3.7 TB/s (int4
about 3.1 SASS instructions a weight, three 128-thread programs an SM), short of the 4.2 TB/s
copy rate; the dequant kernel and a tensor-core variant fed by a mantissa trick were slower than
the GEMV at 1 row, and an L2 prefetch of each row's tile 4 ahead (prefetch.global.L2) cost more
registers than it saved.
"""

from __future__ import annotations

import os

import torch

from kernels import wq_gluon, wq_gluon_tune
from kernels._triton import _cuda_capability, check_launchable, interpreting, jit, pdl_launch, tl, triton, wait_for_producer
from kernels.reference import RmsHandoff
from kernels.wq_gluon import TiledWeight
from kernels.wquant import QuantizedWeight

DECODE_MAX_ROWS = 16
INTERPRETER_CONFIG = dict(BLOCK_N=16, BLOCK_K=32)


@jit
def _wq_matmul_kernel(
    x_ptr, q_ptr, s_ptr, b_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)
    PACK: tl.constexpr = 2 if BITS == 4 else 1
    BLOCK_KQ: tl.constexpr = BLOCK_K // PACK
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kq = tl.arange(0, BLOCK_KQ)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    q_ptrs = q_ptr + offs_n[:, None].to(tl.int64) * stride_qn + offs_kq[None, :]
    s_row = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_mask[:, None] & ((k + offs_k) < K)[None, :], other=0.0)
        q = tl.load(q_ptrs, mask=n_mask[:, None] & ((k // PACK + offs_kq) < K // PACK)[None, :], other=0)
        if BITS == 4:
            q = tl.interleave(q & 0x0F, q >> 4)  # byte j holds columns 2j (low) and 2j + 1 (high)
        w = q.to(tl.float32)
        if GROUP % BLOCK_K == 0:  # the tile lies in one group: a scale (and bias) per row
            s = tl.load(s_ptr + s_row + k // GROUP, mask=n_mask, other=0.0).to(tl.float32)
            w = w * s[:, None]
            if BITS == 4:
                w += tl.load(b_ptr + s_row + k // GROUP, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        else:  # BLOCK_K // GROUP groups in the tile
            NG: tl.constexpr = BLOCK_K // GROUP
            offs_g = k // GROUP + tl.arange(0, NG)
            sg_ptrs = s_row[:, None] + offs_g[None, :]
            sg_mask = n_mask[:, None] & (offs_g < K // GROUP)[None, :]
            s = tl.load(s_ptr + sg_ptrs, mask=sg_mask, other=0.0).to(tl.float32)
            w = tl.reshape(w, [BLOCK_N, NG, GROUP]) * s[:, :, None]
            if BITS == 4:
                w += tl.load(b_ptr + sg_ptrs, mask=sg_mask, other=0.0).to(tl.float32)[:, :, None]
            w = tl.reshape(w, [BLOCK_N, BLOCK_K])
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_KQ
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# The GEMV's unpacking: an integer below 2^24 read as a float32 is n 2^-149 exactly (denormals,
# then exponent 1 continues at the same spacing), so a nibble or byte ANDed out in place at bit p
# of a word is already the float q 2^(p - 149). Each column of x is prescaled by the power of two
# that makes its product x q 2^P: normal, exact, and with no constant to take out again.
# the products' common exponent; x's prescale is 2^(P + 149 - p) <= 2^85, so |x| < 2^43
_P = tl.constexpr(-64) if tl else -64


@jit
def _gemv_x(xr, cols, i: tl.constexpr):
    return tl.load(xr + cols + i).to(tl.float32)


@jit
def _bf16_pair(v):
    """The two bf16 halves of int32 words as float32 (low, high)."""
    return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)


@jit
def _gemv_x8(xr, cols):
    """x's 8 bf16 columns of each word, one 16-byte load a word in the words' own layout."""
    a, b, c, d = tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                           [xr + cols], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                           is_pure=False, pack=1)
    x0, x1 = _bf16_pair(a)
    x2, x3 = _bf16_pair(b)
    x4, x5 = _bf16_pair(c)
    x6, x7 = _bf16_pair(d)
    return x0, x1, x2, x3, x4, x5, x6, x7


@jit
def _gemv_row(acc, xr, cols, w, s, bb, BITS: tl.constexpr, NG: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_KW: tl.constexpr, XVEC: tl.constexpr):
    """One row of x against a tile of words: acc += s 2^-P sum_i x_i f_i + bb sum_i x_i per word
    (bb: the int4 bias, or -128 s for int8's offset)."""
    E: tl.constexpr = _P + 149  # x's prescale for a field at bit 0
    if BITS == 4:
        # nibble i at bits 4i: 0-5 ANDed out in place; w >> 24 is q6 + 16 q7 and w >> 28 is q7, so
        # x6 (q6 + 16 q7) + (x7 - 16 x6) q7 takes 6 and 7 with one shift each and no mask
        if XVEC:
            x0, x1, x2, x3, x4, x5, x6, x7 = _gemv_x8(xr, cols)
        else:
            x0, x1, x2, x3 = _gemv_x(xr, cols, 0), _gemv_x(xr, cols, 1), _gemv_x(xr, cols, 2), _gemv_x(xr, cols, 3)
            x4, x5, x6, x7 = _gemv_x(xr, cols, 4), _gemv_x(xr, cols, 5), _gemv_x(xr, cols, 6), _gemv_x(xr, cols, 7)
        t = (x0 * 2.0 ** E)[None, :] * (w & 0xF).to(tl.float32, bitcast=True)
        t += (x1 * 2.0 ** (E - 4))[None, :] * (w & 0xF0).to(tl.float32, bitcast=True)
        t += (x2 * 2.0 ** (E - 8))[None, :] * (w & 0xF00).to(tl.float32, bitcast=True)
        t += (x3 * 2.0 ** (E - 12))[None, :] * (w & 0xF000).to(tl.float32, bitcast=True)
        t += (x4 * 2.0 ** (E - 16))[None, :] * (w & 0xF0000).to(tl.float32, bitcast=True)
        t += (x5 * 2.0 ** (E - 20))[None, :] * (w & 0xF00000).to(tl.float32, bitcast=True)
        t += (x6 * 2.0 ** E)[None, :] * (w >> 24).to(tl.float32, bitcast=True)
        t += ((x7 - 16.0 * x6) * 2.0 ** E)[None, :] * (w >> 28).to(tl.float32, bitcast=True)
        xs = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
    else:
        # byte b, plus 128 once its top bit flips, at bits 8b: 0-2 in place, 3 shifted down to bit 0
        u = w ^ 0x80808080
        if XVEC:
            a, b = tl.inline_asm_elementwise("ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [xr + cols],
                                             dtype=(tl.int32, tl.int32), is_pure=False, pack=1)
            x0, x1 = _bf16_pair(a)
            x2, x3 = _bf16_pair(b)
        else:
            x0, x1, x2, x3 = _gemv_x(xr, cols, 0), _gemv_x(xr, cols, 1), _gemv_x(xr, cols, 2), _gemv_x(xr, cols, 3)
        t = (x0 * 2.0 ** E)[None, :] * (u & 0xFF).to(tl.float32, bitcast=True)
        t += (x1 * 2.0 ** (E - 8))[None, :] * (u & 0xFF00).to(tl.float32, bitcast=True)
        t += (x2 * 2.0 ** (E - 16))[None, :] * (u & 0xFF0000).to(tl.float32, bitcast=True)
        t += (x3 * 2.0 ** E)[None, :] * (u >> 24).to(tl.float32, bitcast=True)
        xs = x0 + x1 + x2 + x3
    # the x sums per word go into acc too (bb sum x, one FMA a word): summed per tile they met
    # reductions across threads and layout conversions
    if NG == 1:  # s, bb: [BLOCK_N]
        acc += t * s[:, None]
        acc += bb[:, None] * xs[None, :]
    else:  # s, bb: [BLOCK_N, NG]
        t = tl.reshape(t, [BLOCK_N, NG, BLOCK_KW // NG]) * s[:, :, None]
        t += bb[:, :, None] * tl.reshape(xs, [NG, BLOCK_KW // NG])[None, :, :]
        acc += tl.reshape(t, [BLOCK_N, BLOCK_KW])
    return acc


@jit
def _gemv_store(acc, row, offs_n, n_mask, bias_ptr, out_ptr, ws_ptr, N, stride_om, HAS_BIAS: tl.constexpr,
                SPLIT: tl.constexpr):
    """A row's share: stored (one split), or added into the fp32 workspace row."""
    part = tl.sum(acc, axis=1)
    if not SPLIT:
        if HAS_BIAS:
            part += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + offs_n, part.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.atomic_add(ws_ptr + row * N + offs_n, part, mask=n_mask, sem="relaxed")


@jit
def _gemv_fixup(row, offs_n, n_mask, bias_ptr, out_ptr, ws_ptr, N, stride_om, HAS_BIAS: tl.constexpr):
    """The last split of a block: the summed row out of the workspace, which it leaves zero."""
    bits = tl.atomic_xchg((ws_ptr + row * N + offs_n).to(tl.pointer_type(tl.int32)), tl.zeros_like(offs_n),
                          mask=n_mask, sem="relaxed")  # as int32: the interpreter swaps no floats
    part = bits.to(tl.float32, bitcast=True)
    if HAS_BIAS:
        part += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, part.to(out_ptr.dtype.element_ty), mask=n_mask)


# a scale's load by inline asm (the kernel's ASM path)
_LD_BF16 = tl.constexpr("ld.global.nc.u16 $0, [$1]; shl.b32 $0, $0, 16;") if tl else None
_LD_F16 = tl.constexpr("{ .reg .b16 h; ld.global.nc.b16 h, [$1]; cvt.f32.f16 $0, h; }") if tl else None
_LD_F32 = tl.constexpr("ld.global.nc.b32 $0, [$1];") if tl else None


@jit
def _ld_scale(ptrs, ASM: tl.constexpr):
    """The values at ``ptrs`` as float32 in ``ptrs``' own register layout. tl.load would give a
    [BLOCK_N] tensor a layout of its own (no lane repeats a row) and convert it through shared
    memory: a store, two barriers and a load a tile, right behind the load's latency."""
    if not ASM:
        return tl.load(ptrs).to(tl.float32)
    ty: tl.constexpr = ptrs.dtype.element_ty
    if ty == tl.bfloat16:
        ld: tl.constexpr = _LD_BF16
    elif ty == tl.float16:
        ld: tl.constexpr = _LD_F16
    else:
        ld: tl.constexpr = _LD_F32
    return tl.inline_asm_elementwise(ld, "=r,l", [ptrs], dtype=tl.float32, is_pure=True, pack=1)


@jit(do_not_specialize=("SPLITS",))
def _wq_gemv_kernel(
    x_ptr, q_ptr, s_ptr, b_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, stride_xm, stride_qn, stride_sn,
    stride_om, SPLITS, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
    ASM: tl.constexpr = False, XVEC: tl.constexpr = False,
):
    """1 to 4 rows on the CUDA cores (module docstring). q_ptr: the packed weight as int32 words
    (stride_qn in words). Program (i, j) owns BLOCK_N outputs over split j of K's tiles; with
    SPLIT (more than one split) the splits add into ws (fp32 [M, N], zero) and the last to count
    in at cnt[i] writes the output and leaves ws and cnt zero again: no launch or allocation a call."""
    wait_for_producer(USE_PDL)
    PER: tl.constexpr = 8 if BITS == 4 else 4  # weights a word
    BLOCK_K: tl.constexpr = BLOCK_KW * PER
    NG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1  # groups a tile
    pid_n = tl.program_id(0)
    tiles = K // BLOCK_K  # whole tiles (_gemv_fits)
    per_split = tl.cdiv(tiles, SPLITS)
    t0 = tl.program_id(1) * per_split
    t1 = tl.minimum(t0 + per_split, tiles)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_KW)
    offs_g = tl.arange(0, NG)
    n_mask = offs_n < N
    # no masks in the loop: rows past N read row N - 1 (never stored), a split past the end a
    # real tile (never summed)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    if NG == 1:
        s_ptrs = s_ptr + rows * stride_sn
        b_ptrs = b_ptr + rows * stride_sn
    else:
        s_ptrs = s_ptr + rows[:, None] * stride_sn + offs_g[None, :]
        b_ptrs = b_ptr + rows[:, None] * stride_sn + offs_g[None, :]
    q_ptrs = q_ptr + rows[:, None] * stride_qn + offs_w[None, :]
    SASM: tl.constexpr = ASM and NG == 1
    cols = offs_w * PER
    acc0 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
    w = tl.load(q_ptrs + tl.minimum(t0, tiles - 1) * BLOCK_KW).to(tl.uint32, bitcast=True)
    for t in range(t0, t1):
        # the next tile's words in flight while this one is summed
        w_next = tl.load(q_ptrs + tl.minimum(t + 1, t1 - 1) * BLOCK_KW).to(tl.uint32, bitcast=True)
        g = t * BLOCK_K // GROUP
        s = _ld_scale(s_ptrs + g, SASM)
        if BITS == 4:
            bb = _ld_scale(b_ptrs + g, SASM)
        else:
            bb = -128.0 * s
        s = s * 2.0 ** -_P
        xr = x_ptr + t * BLOCK_K
        acc0 = _gemv_row(acc0, xr, cols, w, s, bb, BITS, NG, BLOCK_N, BLOCK_KW, XVEC)
        if M > 1:
            acc1 = _gemv_row(acc1, xr + stride_xm, cols, w, s, bb, BITS, NG, BLOCK_N, BLOCK_KW, XVEC)
        if M > 2:
            acc2 = _gemv_row(acc2, xr + 2 * stride_xm, cols, w, s, bb, BITS, NG, BLOCK_N, BLOCK_KW, XVEC)
        if M > 3:
            acc3 = _gemv_row(acc3, xr + 3 * stride_xm, cols, w, s, bb, BITS, NG, BLOCK_N, BLOCK_KW, XVEC)
        w = w_next
    _gemv_store(acc0, 0, offs_n, n_mask, bias_ptr, out_ptr, ws_ptr, N, stride_om, HAS_BIAS, SPLIT)
    if M > 1:
        _gemv_store(acc1, 1, offs_n, n_mask, bias_ptr, out_ptr, ws_ptr, N, stride_om, HAS_BIAS, SPLIT)
    if M > 2:
        _gemv_store(acc2, 2, offs_n, n_mask, bias_ptr, out_ptr, ws_ptr, N, stride_om, HAS_BIAS, SPLIT)
    if M > 3:
        _gemv_store(acc3, 3, offs_n, n_mask, bias_ptr, out_ptr, ws_ptr, N, stride_om, HAS_BIAS, SPLIT)
    if SPLIT:
        tl.debug_barrier()  # every thread's adds issued before the count (released by the atomic)
        if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel") == SPLITS - 1:
            for row in tl.static_range(M):
                _gemv_fixup(row, offs_n, n_mask, bias_ptr, out_ptr, ws_ptr, N, stride_om, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed")


# The swapped kernel (2 rows and more): out^T = W x^T, so the weight tile is the dot's first
# operand, which Hopper's wgmma reads from registers (the dequantized tile never goes through
# shared memory; x^T, the second operand, is staged there by the pipeliner). BLOCK_K divides the
# group, so each tile's dot runs on the raw integers and its scale is applied to the dot's
# [BLOCK_N, BLOCK_M] result, not per weight: acc += s dot(q, x) + b sum(x). A nibble ORed into
# bf16's 0x4300 is 128 + q exactly (fp16: 0x6400, 1024 + q), so int4 needs no conversion
# instruction; the 128 comes out with the bias, b - 128 s.
SWAP_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@jit
def _nibble_pairs(w, shift: tl.constexpr, MAGIC: tl.constexpr):
    """Nibbles ``shift / 4`` and ``shift / 4 + 4`` of int32 words as 16-bit halves with the magic ORed in:
    one shift and one LOP3 for two weights."""
    r = ((w >> shift) & 0x000F000F) | (MAGIC * 65537)
    return r.to(tl.int16), (r >> 16).to(tl.int16)


@jit
def _swapped_columns(BITS: tl.constexpr, BLOCK_K: tl.constexpr, PERM: tl.constexpr):
    """x's column for each of the dot's K positions. PERM: wgmma's A fragment gives lane c of a
    quad positions 2c + e and 2c + 8 + e of every 16 (e in 0, 1: one 32-bit register); the
    positions are mapped so that a lane's BLOCK_K / 4 columns of a row are contiguous bytes of
    the packed weight (int4: 4 words, read as int32 and split by _nibble_pairs, whose register
    holds nibbles i and i + 4; int8: BLOCK_K / 4 bytes), and x is read in that order."""
    p = tl.arange(0, BLOCK_K)
    if not PERM:
        return p
    c = (p // 2) % 4
    if BITS == 4:  # p = 32 wi + 16 x2 + 8 x1 + 2 c + x0 -> nibble x1 + 2 x2 + 4 x0 of the lane's word wi
        return (BLOCK_K // 4) * c + 8 * (p // 32) + 2 * ((p // 16) % 2) + (p // 8) % 2 + 4 * (p % 2)
    return (BLOCK_K // 4) * c + 4 * (p // 16) + 2 * ((p // 8) % 2) + p % 2  # p = 16 j + 8 h + 2 c + e


@jit
def _swapped_weights(q, dtype: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     MAGIC: tl.constexpr, PERM: tl.constexpr):
    """The tile's integers (int4: 128 + q with the bf16 magic) as the dot's [BLOCK_N, BLOCK_K] operand, in
    _swapped_columns' order."""
    if BITS == 4:
        if PERM:  # q: int32 words [BLOCK_N, BLOCK_K / 8]
            a0, a1 = _nibble_pairs(q, 0, MAGIC)
            b0, b1 = _nibble_pairs(q, 4, MAGIC)
            c0, c1 = _nibble_pairs(q, 8, MAGIC)
            d0, d1 = _nibble_pairs(q, 12, MAGIC)
            # [BLOCK_N, words (c, wi), x0, x1, x2] -> positions (wi, x2, x1, c, x0)
            t = tl.join(tl.join(tl.join(a0, a1), tl.join(b0, b1)), tl.join(tl.join(c0, c1), tl.join(d0, d1)))
            t = tl.permute(tl.reshape(t, [BLOCK_N, 4, BLOCK_K // 32, 2, 2, 2]), [0, 2, 5, 4, 1, 3])
            w = tl.reshape(t, [BLOCK_N, BLOCK_K]).to(dtype, bitcast=True)
        else:
            q = tl.interleave(q & 0x0F, q >> 4)  # byte j holds columns 2j (low) and 2j + 1 (high)
            if MAGIC:
                w = (q.to(tl.int16) | MAGIC).to(dtype, bitcast=True)
            else:
                w = q.to(dtype)
    else:
        if PERM:  # bytes [BLOCK_N, (c, j, h, e)] -> positions (j, h, c, e)
            q = tl.reshape(tl.permute(tl.reshape(q, [BLOCK_N, 4, BLOCK_K // 16, 2, 2]), [0, 2, 3, 1, 4]),
                           [BLOCK_N, BLOCK_K])
        w = q.to(dtype)
    return w


@jit
def _wq_swapped_kernel(
    x_ptr, q_ptr, s_ptr, b_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_qn, stride_sn,
    stride_om, ROWS_KEY, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    PERM: tl.constexpr, XSUM_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (i, j, s) owns out[j BLOCK_M:, i BLOCK_N:] (transposed in registers) over split s of K's
    tiles (whole tiles, each in one group). ROWS_KEY: the autotuner's row bucket (unused here).
    SPLIT_K > 1: the splits add into ws (fp32 [M, N], zero) and the last to count in at cnt[tile]
    stores and leaves ws and cnt zero again, as the GEMV does. PERM with int4 reads int32 words
    (_swap_perm_ok: the rows 4-byte aligned)."""
    wait_for_producer(USE_PDL)
    BLOCK_KQ: tl.constexpr = BLOCK_K // 8 if PERM and BITS == 4 else BLOCK_K // (2 if BITS == 4 else 1)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    tiles = K // BLOCK_K
    per_split = tl.cdiv(tiles, SPLIT_K)
    t0 = tl.program_id(2) * per_split
    t1 = tl.minimum(t0 + per_split, tiles)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # no masks in the loop: edge rows re-read row N - 1 (never stored)
    xt_ptrs = (x_ptr + tl.minimum(offs_m, M - 1)[None, :].to(tl.int64) * stride_xm
               + _swapped_columns(BITS, BLOCK_K, PERM)[:, None])
    if PERM and BITS == 4:  # int32 words
        q_ptrs = q_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_qn // 4) + tl.arange(0, BLOCK_KQ)[None, :]
    else:
        q_ptrs = q_ptr + rows[:, None] * stride_qn + tl.arange(0, BLOCK_KQ)[None, :]
    s_ptrs = s_ptr + rows * stride_sn
    b_ptrs = b_ptr + rows * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # each tile's scale (and int4 bias) loaded a tile ahead: loaded in the tile, their latency
    # was exposed behind the dot
    TPG: tl.constexpr = GROUP // BLOCK_K  # tiles a group
    g_last = (tl.minimum(tl.maximum(t1, t0 + 1), tiles) - 1) // TPG  # an empty split reads the last group
    s = tl.load(s_ptrs + tl.minimum(t0 // TPG, g_last))
    bb = tl.load(b_ptrs + tl.minimum(t0 // TPG, g_last)) if BITS == 4 else s
    for t in range(t0, t1):
        g_next = tl.minimum((t + 1) // TPG, g_last)
        s_next = tl.load(s_ptrs + g_next)
        bb_next = tl.load(b_ptrs + g_next) if BITS == 4 else s_next
        xt = tl.load(xt_ptrs + t * BLOCK_K)
        w = _swapped_weights(tl.load(q_ptrs + t * BLOCK_KQ), xt.dtype, BITS, BLOCK_N, BLOCK_K, MAGIC, PERM)
        part = tl.dot(w, xt, input_precision=DOT_PRECISION)
        sf = s.to(tl.float32)
        acc += part * sf[:, None]
        if BITS == 4:  # + (b - OFFSET s) sum(x): the bias, less the magic's constant
            bf = bb.to(tl.float32) - OFFSET * sf
            if XSUM_DOT:  # sum(x) on the tensor cores, already in acc's layout
                acc += bf[:, None] * tl.dot(tl.full([BLOCK_N, BLOCK_K], 1.0, tl.float32).to(xt.dtype), xt,
                                            input_precision=DOT_PRECISION)
            else:
                acc += bf[:, None] * tl.sum(xt.to(tl.float32), axis=0)[None, :]
        s = s_next
        bb = bb_next
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_m < M)[None, :]
    ws_ptrs = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
    if SPLIT_K > 1:
        tl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()  # every thread's adds issued before the count (released by the atomic)
        tile = pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:
            # as int32: the interpreter swaps no floats
            acc = tl.atomic_xchg(ws_ptrs.to(tl.pointer_type(tl.int32)), tl.zeros([BLOCK_N, BLOCK_M], tl.int32),
                                 mask=mask, sem="relaxed").to(tl.float32, bitcast=True)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
            tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


# The dequantize pass's unpacking: a field ANDed out at bit p of a word and ORed into the
# exponent of 2^(23 - p) is the float 2^(23 - p) + q exactly (unit 1), and the constant comes out
# in the one FMA with the scale: w = v s + (b - 2^(23 - p) s). Fields lie in bits 8-22: from bit
# 8 the constant is at most 2^15, its fp32 rounding at most 2^-9 s (bf16's rounding of w is ~2^-6
# s); bit 23 is the exponent's lowest. int4's nibbles 0-1 are shifted to bits 8-15 (w << 8), 5-7
# to bits 8-19 (w >> 12), 2-4 stay in place; int8's bytes go to bits 8-15, the sign bit flipped in
# the same LOP3 (q + 128). The exponent is made opaque to the compiler (0x47000000 + min(N, 0)):
# as an immediate, ptxas spent an AND and an OR a field (a LOP3 takes one immediate); in a
# register, one LOP3. sm_90 SASS, a 32 x 256 tile: 5.9 (int4) / 5.8 (int8) instructions a weight,
# no conversion (the shifts-and-I2F kernel before: 7.8 / 6.2, plus an I2F a weight at a quarter
# of the issue rate); about half of it the tile's addresses and its store's layout conversion.


@jit
def _field(v, mask: tl.constexpr, bits):
    """(v & mask) ^ bits read as float32 (bits: the exponent, and int8's flipped sign bit)."""
    return ((v & mask) ^ bits).to(tl.float32, bitcast=True)


@jit
def _dequantize_kernel(q_ptr, s_ptr, b_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_on,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of W = q s (+ b) in out's dtype, q read as int32 words (rows 4-byte
    aligned) and unpacked by the exponent trick above. BLOCK_K divides K (unused here), and the
    group or is a multiple of it."""
    wait_for_producer(USE_PDL)
    PER: tl.constexpr = 8 if BITS == 4 else 4  # weights a word
    NG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1  # groups a tile
    WPG: tl.constexpr = BLOCK_K // NG // PER  # words a group's share of the tile
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N read row N - 1 (never stored)
    k0 = tl.program_id(1) * BLOCK_K
    offs_g = k0 // GROUP + tl.arange(0, NG)
    offs_w = tl.arange(0, NG)[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [NG, WPG]
    q_words = q_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None, None] * (stride_qn // 4)
    w = tl.load(q_words + k0 // PER + offs_w[None, :, :]).to(tl.uint32, bitcast=True)
    sg = rows[:, None] * stride_sn + offs_g[None, :]
    s = tl.load(s_ptr + sg).to(tl.float32)[:, :, None]  # [BLOCK_N, NG, 1]
    e15 = (0x47000000 + tl.minimum(N, 0)).to(tl.uint32, bitcast=True)  # 2^15 in a register; 2^11, 2^7 below
    if BITS == 4:
        e11, e7 = e15 - 0x02000000, e15 - 0x04000000
        b = tl.load(b_ptr + sg).to(tl.float32)[:, :, None]
        c15, c11, c7 = b - 32768.0 * s, b - 2048.0 * s, b - 128.0 * s
        lo = w << 8  # nibbles 0, 1 at bits 8-15
        hi = w >> 12  # nibbles 5, 6, 7 at bits 8-19
        v0 = _field(lo, 0xF00, e15) * s + c15
        v1 = _field(lo, 0xF000, e11) * s + c11
        v2 = _field(w, 0xF00, e15) * s + c15
        v3 = _field(w, 0xF000, e11) * s + c11
        v4 = _field(w, 0xF0000, e7) * s + c7
        v5 = _field(hi, 0xF00, e15) * s + c15
        v6 = _field(hi, 0xF000, e11) * s + c11
        v7 = _field(hi, 0xF0000, e7) * s + c7
        # tl.join's new dimension is the last: [BLOCK_N, NG, WPG, i, j, l] holds nibble 4i + 2j + l
        t = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    else:
        e = e15 | 0x8000  # the sign bit flipped: q + 128
        c = -32896.0 * s  # 2^15 + 128
        v0 = _field(w << 8, 0xFF00, e) * s + c
        v1 = _field(w, 0xFF00, e) * s + c
        v2 = _field(w >> 8, 0xFF00, e) * s + c
        v3 = _field(w >> 16, 0xFF00, e) * s + c
        t = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [BLOCK_N, NG, WPG, i, j]: byte 2i + j
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :],
             tl.reshape(t, [BLOCK_N, BLOCK_K]).to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None])


def _dequantize_block_k(group: int, k: int) -> int:
    """The dequantize pass's K tile: up to 256 columns, whole groups or within one, dividing K."""
    block_k = 256
    while k % block_k or (block_k > group and block_k % group):
        block_k //= 2
    return block_k


@jit
def _dequantize_tiles_kernel(w_ptr, sb_ptr, out_ptr, N, stride_wn, stride_sn, stride_on, TPG: tl.constexpr,
                             BITS: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    """One [BLOCK_N, 128] tile of W = q s + b from kernels/wq_gluon.py's tiled form (TiledWeight),
    (s, b) packed in one int32 a group (TPG tiles a group; int8: s alone, one int16). int4: a row's
    16 words of the tile, word 4 c + i's nibble s + 4 e holding column 32 i + 8 s + 2 c + e
    (INT4_TILE_ORDER); int8: 32 words, word 8 c + j's bytes (u = q + 128) columns 16 j + 2 c +
    (0, 8, 1, 9) (INT8_TILE_ORDER).
    Computed in float32, q s + b, as QuantizedWeight.dequantize."""
    wait_for_producer(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N read row N - 1 (never stored)
    tile = tl.program_id(1)
    sb = tl.load(sb_ptr + rows * stride_sn + tile // TPG).to(tl.int32)
    s = (sb << 16).to(tl.float32, bitcast=True)[:, None, None]
    b = (sb & -65536).to(tl.float32, bitcast=True)[:, None, None] if BITS == 4 else 0.0
    four = tl.arange(0, 4)
    if BITS == 8:
        eight = tl.arange(0, 8)
        words = tl.load(w_ptr + rows[:, None, None] * stride_wn + tile * 32
                        + (8 * four[:, None] + eight[None, :])[None, :, :])  # [n, c, j]
        v0 = ((words & 0xFF) - 128).to(tl.float32) * s + b
        v1 = (((words >> 8) & 0xFF) - 128).to(tl.float32) * s + b
        v2 = (((words >> 16) & 0xFF) - 128).to(tl.float32) * s + b
        v3 = (((words >> 24) & 0xFF) - 128).to(tl.float32) * s + b
        t = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [n, c, j, e, h]: bytes (0, 2, 1, 3) = (e, h) (0, 1, 0, 1)
        t = tl.reshape(tl.permute(t, (0, 2, 4, 1, 3)), [BLOCK_N, 128])  # column 16 j + 8 h + 2 c + e
    else:
        words = tl.load(w_ptr + rows[:, None, None] * stride_wn + tile * 16
                        + (4 * four[:, None] + four[None, :])[None, :, :])  # [n, c, i]
        v0 = tl.join(((words >> 0) & 0xF).to(tl.float32) * s + b, ((words >> 16) & 0xF).to(tl.float32) * s + b)
        v1 = tl.join(((words >> 4) & 0xF).to(tl.float32) * s + b, ((words >> 20) & 0xF).to(tl.float32) * s + b)
        v2 = tl.join(((words >> 8) & 0xF).to(tl.float32) * s + b, ((words >> 24) & 0xF).to(tl.float32) * s + b)
        v3 = tl.join(((words >> 12) & 0xF).to(tl.float32) * s + b, ((words >> 28) & 0xF).to(tl.float32) * s + b)
        t = tl.join(tl.join(v0, v1), tl.join(v2, v3))  # [n, c, i, e, s0, s1]: s = s0 + 2 s1
        t = tl.reshape(tl.permute(t, (0, 2, 5, 4, 1, 3)), [BLOCK_N, 128])  # column 32 i + 16 s1 + 8 s0 + 2 c + e
    offs_k = tile * 128 + tl.arange(0, 128)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :], t.to(out_ptr.dtype.element_ty),
             mask=(offs_n < N)[:, None])


def dequantize(weight: QuantizedWeight | TiledWeight, dtype: torch.dtype) -> torch.Tensor:
    """``weight.dequantize(dtype)`` in one pass on the device: [N, K] in ``dtype``."""
    if isinstance(weight, TiledWeight):
        check_launchable(weight.words)
        n, k = weight.shape
        out = torch.empty(n, k, dtype=dtype, device=weight.device)
        block_n = 32
        _dequantize_tiles_kernel[(triton.cdiv(n, block_n), k // wq_gluon.BLOCK_K)](
            weight.words, weight.sb, out, n, weight.words.stride(0), weight.sb.stride(0), out.stride(0),
            TPG=weight.group_size // wq_gluon.BLOCK_K, BITS=weight.bits, BLOCK_N=block_n, **pdl_launch(weight.device))
        return out
    check_launchable(weight.qweight)
    n, k = weight.shape
    g = weight.group_size
    q = weight.qweight
    words = not (q.stride(0) % 4 or q.storage_offset() % 4 or q.data_ptr() % 4 or k % (8 if weight.bits == 4 else 4))
    if g & (g - 1) or not words:  # a group of a whole row that is no power of two (per channel); odd views
        return weight.dequantize(dtype)
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    block_n, block_k = 32, _dequantize_block_k(g, k)
    _dequantize_kernel[(triton.cdiv(n, block_n), k // block_k)](
        q, weight.scales, weight.scales if weight.biases is None else weight.biases, out, n, k,
        q.stride(0), weight.scales.stride(0), out.stride(0), BITS=weight.bits, GROUP=g,
        BLOCK_N=block_n, BLOCK_K=block_k, **pdl_launch(weight.device))
    return out


def _fits(group: int, k: int, block_k: int) -> bool:
    """A tile lies in one group, or holds whole groups."""
    return group % block_k == 0 or (block_k % group == 0 and block_k <= k)


def _decode_configs() -> list:
    # (BLOCK_N, BLOCK_K, warps, stages); deeper pipelines and 1024-wide K tiles were tried on an
    # H200 and measured no better (docs/BENCHMARKS.md)
    shapes = [(16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3),
              (64, 128, 4, 4), (64, 256, 4, 3)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes]


def _prune(configs, named_args, **kwargs):
    group, k = named_args["GROUP"] if "GROUP" in named_args else kwargs["GROUP"], named_args["K"]
    kept = [c for c in configs if _fits(group, k, c.kwargs["BLOCK_K"])]
    return kept or configs[:1]


_tuned = (triton.autotune(configs=_decode_configs(), key=["N", "K", "BITS", "GROUP", "HAS_BIAS"],
                          prune_configs_by={"early_config_prune": _prune}, cache_results=True)(_wq_matmul_kernel)
          if triton else None)


GEMV_MAX_ROWS = 4  # the GEMV kernel's limit
GEMV_SPLITS = (1, 2, 4, 8, 16)
GEMV_ASM = True  # scales (and bf16 x) loaded by inline asm on a GPU (_ld_scale, _gemv_x8); off: tl.load


# (BLOCK_N, words a tile, warps) per format: 8 rows a thread (BLOCK_N / (8 lanes x warps) with
# 4 words a thread along K), or 4 (256 x 16 on 8 warps: chosen for o and down on an H200); 16 rows
# spilled registers (sm_90 compile)
GEMV_TILES = {4: [(256, 16, 4), (128, 16, 4), (512, 16, 8), (256, 8, 4), (256, 16, 8)],
              8: [(256, 16, 4), (256, 32, 8), (128, 32, 4), (128, 16, 4), (256, 16, 8)]}


def _gemv_configs() -> list:
    # the split of K is tried per shape (GEMV_SPLITS)
    shapes = sorted({t for tiles in GEMV_TILES.values() for t in tiles})
    return [triton.Config({"BLOCK_N": n, "BLOCK_KW": kw, "SPLITS": s}, num_warps=w, num_stages=1)
            for n, kw, w in shapes for s in GEMV_SPLITS]


def _gemv_fits(group: int, k: int, bits: int, block_kw: int) -> bool:
    """Whole words a group, a tile in one group or of whole groups, and whole tiles along K."""
    block_k = block_kw * (8 if bits == 4 else 4)
    return group % (8 if bits == 4 else 4) == 0 and _fits(group, k, block_k) and k % block_k == 0


def _gemv_prune(configs, named_args, **kwargs):
    group, k, n, bits = kwargs["GROUP"], named_args["K"], named_args["N"], kwargs["BITS"]
    per = 8 if bits == 4 else 4
    kept = []
    for c in configs:
        tiles = -(-k // (c.kwargs["BLOCK_KW"] * per))
        programs = -(-n // c.kwargs["BLOCK_N"]) * c.kwargs["SPLITS"]
        # a split of at least 2 tiles, and splits only while the blocks are few (~8 waves on 132 SMs)
        split_ok = c.kwargs["SPLITS"] == 1 or (tiles >= 2 * c.kwargs["SPLITS"] and programs <= 1056)
        tile = (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_KW"], c.num_warps)
        if tile in GEMV_TILES[bits] and _gemv_fits(group, k, bits, c.kwargs["BLOCK_KW"]) and split_ok:
            kept.append(c)
    return kept or configs[:1]


_gemv_tuned = (triton.autotune(configs=_gemv_configs(), key=["N", "K", "BITS", "GROUP", "HAS_BIAS", "M", "ASM"],
                               prune_configs_by={"early_config_prune": _gemv_prune}, warmup=5, rep=25,
                               cache_results=True)(
    triton.heuristics({"SPLIT": lambda args: args["SPLITS"] > 1})(_wq_gemv_kernel)) if triton else None)

# The swapped kernel's tiles: (BLOCK_N, BLOCK_M, warps, stages, PERM, XSUM_DOT) (PERM:
# _swapped_columns; XSUM_DOT: int4's sum(x) as a second dot), each with the K splits below where
# the rows fit the workspace; BLOCK_K is the group, or 128 where the group is larger. BLOCK_M 16
# is the least a dot takes (2-16 rows pad to it). benchmarks/quant_gpu.py --swap-sweep times more.
SWAP_TILES = [(64, 16, 4, 3, True, False), (64, 16, 4, 3, False, False), (128, 16, 8, 3, True, False),
              (64, 32, 4, 3, True, False), (64, 32, 4, 3, False, False), (128, 64, 8, 3, True, True),
              (64, 64, 4, 3, False, False), (64, 128, 4, 3, False, False), (128, 128, 8, 4, False, False)]
SWAP_SPLITS = (1, 2, 4, 8)
SWAP_MAX_BLOCK_K = 128
WORKSPACE_ROWS = 64  # the split kernels' rows at most (GEMV_MAX_ROWS, and the swapped kernel's splits)


def swap_rows_key(m: int) -> int:
    """The autotuner's bucket of rows: tiles are tuned per power of two from 16."""
    return max(16, 1 << (m - 1).bit_length())


def _swap_configs() -> list:
    return [triton.Config({"BLOCK_N": n, "BLOCK_M": bm, "SPLIT_K": sk, "PERM": perm, "XSUM_DOT": xs},
                          num_warps=w, num_stages=st)
            for n, bm, w, st, perm, xs in SWAP_TILES for sk in SWAP_SPLITS if sk == 1 or bm <= WORKSPACE_ROWS]


def _swap_prune(configs, named_args, **kwargs):
    rows, n, k, bits = named_args["ROWS_KEY"], named_args["N"], named_args["K"], kwargs["BITS"]
    block_k = kwargs["BLOCK_K"]
    kept = []
    for c in configs:
        bm, sk = c.kwargs["BLOCK_M"], c.kwargs["SPLIT_K"]
        if bm > rows or (rows >= 64 and bm < min(rows, 256) // 4):  # tiles near the rows
            continue
        # splits only for rows that fit the workspace, at least 2 tiles each, while the blocks are few
        if sk > 1 and (rows > WORKSPACE_ROWS or k // block_k < 2 * sk or -(-n // c.kwargs["BLOCK_N"]) * sk > 1056):
            continue
        if bits == 8 and c.kwargs["XSUM_DOT"]:  # no sum(x) for int8: the same kernel without the switch
            c = triton.Config({**c.kwargs, "XSUM_DOT": False}, num_warps=c.num_warps, num_stages=c.num_stages)
        if c.kwargs["PERM"] and not _swap_perm_ok(named_args["q_ptr"], kwargs["MAGIC"], block_k, bits):
            c = triton.Config({**c.kwargs, "PERM": False}, num_warps=c.num_warps, num_stages=c.num_stages)
        if all(c.all_kwargs() != d.all_kwargs() for d in kept):
            kept.append(c)
    return kept or configs[:1]


_swap_tuned = (triton.autotune(configs=_swap_configs(), key=["N", "K", "ROWS_KEY", "BITS", "GROUP", "HAS_BIAS"],
                               prune_configs_by={"early_config_prune": _swap_prune}, warmup=5, rep=25,
                               cache_results=True)(
    _wq_swapped_kernel) if triton else None)


def _swap_block_k(group: int, k: int) -> int | None:
    """The swapped kernel's K tile: the group (or 128 of a larger one), dividing K; None if none fits."""
    block_k = min(group, SWAP_MAX_BLOCK_K)
    if block_k < 16 or block_k & (block_k - 1) or group % block_k or k % block_k:
        return None
    return block_k


def _swap_perm_ok(q: torch.Tensor, magic: int, block_k: int, bits: int) -> bool:
    """Whether the PERM order can take this weight: x in a 16-bit dtype (the magic), tiles of whole
    lane blocks, and int4 rows of whole int32 words."""
    if not magic or block_k < 32:
        return False
    return bits == 8 or not (q.stride(0) % 4 or q.storage_offset() % 4 or q.data_ptr() % 4)


_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_retired: list[torch.Tensor] = []  # replaced workspaces: a captured graph may still point at one


def _workspace(device: torch.device, n: int, counters: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernels' fp32 sums [WORKSPACE_ROWS, n] and at least ``counters`` block counters
    (a 16-wide block of n each by default), zero between calls; grown (never shrunk or freed) at
    warm-up, before any CUDA graph is captured."""
    counters = max(counters, -(-n // 16))
    ws, cnt = _workspaces.get(device, (None, None))
    if ws is None or ws.numel() < WORKSPACE_ROWS * n or cnt.numel() < counters:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), \
            "wq_matmul: a split shape first met inside CUDA-graph capture (warm up first)"
        if ws is not None:
            _retired.extend((ws, cnt))
        size = max(n, 0 if ws is None else ws.numel() // WORKSPACE_ROWS)
        ws = torch.zeros(WORKSPACE_ROWS * size, dtype=torch.float32, device=device)
        cnt = torch.zeros(max(counters, -(-size // 16), 0 if cnt is None else cnt.numel()), dtype=torch.int32,
                          device=device)
        _workspaces[device] = (ws, cnt)
    return ws, cnt


def _gemv_words(weight: QuantizedWeight, k: int) -> torch.Tensor | None:
    """The packed weight as int32 words, or None where the GEMV cannot take it."""
    q = weight.qweight
    if q.shape[1] % 4 or q.stride(0) % 4 or q.storage_offset() % 4:
        return None
    if not any(_gemv_fits(weight.group_size, k, weight.bits, kw) for kw in (4, 8, 16, 32)):
        return None
    return q.view(torch.int32)


# Where each path is chosen, by rows of x and bits (benchmarks/quant_gpu.py --parts decode, H200,
# bf16, µs a layer of Llama-3.1-8B's projections; docs/BENCHMARKS.md): the GEMV won at 1 row, and
# for int4 at 2 (85.4 against the swapped kernel's 94.3; int8 at 2: 98.9 against 92.4); the
# swapped kernel won against dequantize + cuBLAS up to 64 rows for int4 (194.5 against 301.1;
# 392.2 against 311.4 at 128) and up to 128 for int8 (225.5 against 324.4; the LM head 355 against
# 771). int8 at 256 rows measured a near tie alone (345.5 against 363.5) but cost workload (b)
# 11% in the engine (6,533 output tok/s against 7,358 with 128 here), so 128.
GEMV_ROWS = {8: 1, 4: 2}
SWAP_MAX_ROWS = {8: 128, 4: 64}
# the Gluon kernel (kernels/wq_gluon.py: async wgmma chain, sm_90): the rows a natural weight takes
# it at (first, last), by bits; a tiled one from 1 row; GLUON = False turns it off. H200, µs a
# layer (docs/BENCHMARKS.md): int4 at 16 rows 53 against the swapped kernel's 96, at 64 82 against
# 194, at 128 128 against dense 295, at 512 392 against dense 436; at 1024 901 against dense 815;
# int8 at 1 row 75.5 against the GEMV's 85.4, at 2 78 against 109, at 16 80 (swapped ~96), at 64
# 100 (swapped ~149); int8 tiled at 256 rows 253-258 against dense 352-367, at 512 549-580 against
# dense 483-494 (crossing near 400: int8's unpacking is twice int4's a weight once the MMAs bind);
# with the two-consumer tiles (wq_gluon_tune.py's NS) int8 at 512 rows 410 against dense 469 (2026-11-28)
GLUON = os.environ.get("KVCASCADE_GLUON", "1") != "0"  # off: natural weights, slower at 1-512 rows
GLUON_ROWS = {4: (3, 512), 8: (2, 512)}


def _capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's compute capability; None elsewhere."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def tiles_fit(weight: QuantizedWeight) -> bool:
    """Whether the Gluon kernel can run this weight (and so it is kept in its tiled form): sm_90
    (wgmma), int4 or int8 with bf16 scales in groups of whole 128-column tiles, an even number of them."""
    if not (GLUON and wq_gluon.HAS_GLUON and weight.bits in GLUON_ROWS) or interpreting():
        return False
    return (_capability(weight.device) == (9, 0) and weight.scales.dtype == torch.bfloat16
            and weight.group_size % wq_gluon.BLOCK_K == 0 and weight.shape[1] % (2 * wq_gluon.BLOCK_K) == 0)


def _gluon_ok(weight: QuantizedWeight, rows: int, dtype: torch.dtype) -> bool:
    """Whether the Gluon kernel takes this call of a natural weight (x's alignment for TMA is
    checked at the launch)."""
    lo, hi = GLUON_ROWS.get(weight.bits, (1, 0))
    return lo <= rows <= hi and dtype == torch.bfloat16 and tiles_fit(weight)


def prepare(weight: QuantizedWeight) -> TiledWeight | None:
    """The weight's form for this device's kernels, built at load (QuantizedLinearWeight.finalize)
    before the KV pool is sized: where the Gluon kernel runs, the tiled form (kernels/wq_gluon.py),
    which then replaces the natural nibbles (int4's bytes once); else None (the natural form)."""
    return wq_gluon.tile_weight(weight) if tiles_fit(weight) else None


def decode_path(weight: QuantizedWeight | TiledWeight, rows: int, dtype: torch.dtype, gluon: bool = True) -> str:
    """Which kernel takes ``rows`` rows of x: "gemv", "gluon" (kernels/wq_gluon.py), "swapped",
    "dequant" (the older decode kernel, up to DECODE_MAX_ROWS) or "dense" (dequantize + cuBLAS);
    module docstring. A tiled weight has two: the Gluon kernel from 1 row to GLUON_ROWS' last,
    dequantize + cuBLAS above (and for x of another dtype)."""
    if isinstance(weight, TiledWeight):
        return "gluon" if gluon and rows <= GLUON_ROWS[weight.bits][1] and dtype == torch.bfloat16 else "dense"
    k = weight.shape[1]
    # float32 activations stay on the tensor cores (the GEMV takes them exactly, but was not timed so)
    if rows <= GEMV_ROWS[weight.bits] and dtype != torch.float32 and _gemv_words(weight, k) is not None:
        return "gemv"
    if gluon and _gluon_ok(weight, rows, dtype):
        return "gluon"
    if rows <= SWAP_MAX_ROWS[weight.bits] and _swap_block_k(weight.group_size, k) is not None:
        return "swapped"
    return "dequant" if rows <= DECODE_MAX_ROWS else "dense"


def wq_matmul(x: torch.Tensor, weight: QuantizedWeight | TiledWeight, bias: torch.Tensor | None = None,
              config: dict | None = None, path: str | None = None, rms: RmsHandoff | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dequantize(x.dtype), bias)``: x [M, K] -> [M, N]. ``path`` ("gemv",
    "gluon", "swapped", "dequant", "dense") and ``config`` (the kernel's tile: BLOCK_N and BLOCK_KW,
    SPLITS for the GEMV; num_warps, BLOCK_M, STAGES, SPLIT_K for gluon; BLOCK_N, BLOCK_M, SPLIT_K,
    PERM, XSUM_DOT for the swapped kernel; BLOCK_M, BLOCK_N, BLOCK_K for dequant; num_warps,
    num_stages) override the choice (sweeps, tests). A TiledWeight takes "gluon" or "dense" only.
    ``rms``: x is wq_matmul_norm's x, and the sums are scaled by the norm's 1 / rms before the bias
    (in the Gluon kernel; on other paths after it, by ``rms.apply``)."""
    tiled = isinstance(weight, TiledWeight)
    check_launchable(x, weight.words if tiled else weight.qweight)
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1
    assert tiled or (weight.qweight.stride(1) == 1 and weight.scales.stride(1) == 1
                     and (weight.biases is None or weight.biases.stride() == weight.scales.stride()))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if path is None:  # routing checked the weight, the rows and x's dtype; x's layout here
        path = decode_path(weight, m, x.dtype)
        if path == "gluon" and not wq_gluon.x_fits(x):  # x as TMA cannot read it
            if tiled:  # no other kernel below 512 rows: an aligned copy of x
                x = x.clone(memory_format=torch.contiguous_format)
            else:
                path = decode_path(weight, m, x.dtype, gluon=False)
    elif path == "gluon":
        assert wq_gluon.gluon_fits(x, weight), "wq_matmul: the Gluon kernel cannot take this call"
    if rms is not None and (path != "gluon" or m != 1 or rms.parts.numel() > wq_gluon_tune.RMS_MAX_PARTS):
        return rms.apply(wq_matmul(x, weight, None, config, path), k, bias)
    if path == "gluon":
        ws, cnt = _workspace(x.device, n, _split_counters(n))
        tiles = wq_gluon.gluon_weight(weight)
        cfg = config or wq_gluon_tune.tuned_config(x, tiles, out, bias, ws, cnt, WORKSPACE_ROWS)
        wq_gluon_tune.wq_gluon(x, tiles, out, bias, ws, cnt, cfg, norm_in=None if rms is None else (rms.parts, rms.eps))
        return out
    if path == "dense":  # cuBLAS on a transient dense copy (module docstring)
        return torch.nn.functional.linear(x, dequantize(weight, x.dtype), bias)
    assert not tiled, f"wq_matmul: a tiled weight has no {path} path"
    g = weight.group_size
    biases = weight.scales if weight.biases is None else weight.biases
    opts = dict(BITS=weight.bits, GROUP=g, HAS_BIAS=bias is not None, **pdl_launch(x.device))
    bias_arg = weight.scales if bias is None else bias
    if path == "gemv":
        assert m <= GEMV_MAX_ROWS
        words = _gemv_words(weight, k)
        ws, cnt = _workspace(x.device, n)
        asm = GEMV_ASM and not interpreting()
        # x read 16 bytes a word: bf16, and every row 16-byte aligned
        opts.update(ASM=asm, XVEC=asm and x.dtype == torch.bfloat16 and x.data_ptr() % 16 == 0
                    and (m == 1 or x.stride(0) % 8 == 0))
        args = (x, words, weight.scales, biases, bias_arg, out, ws, cnt, n, k, x.stride(0), words.stride(0),
                weight.scales.stride(0), out.stride(0))
        if config is None and interpreting():
            kw = next(kw for kw in (8, 4, 16, 32) if _gemv_fits(g, k, weight.bits, kw))
            config = dict(BLOCK_N=16, BLOCK_KW=kw, SPLITS=2 if k // (kw * (8 if weight.bits == 4 else 4)) >= 2 else 1)
        if config is None:
            _gemv_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLITS"])](*args, **opts, M=m)
        else:
            cfg = dict(config)
            cfg.setdefault("SPLITS", 1)
            _wq_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLITS"])](*args, **opts, M=m, SPLIT=cfg["SPLITS"] > 1,
                                                                            **cfg)
        return out
    opts["DOT_PRECISION"] = "ieee" if x.dtype == torch.float32 else "tf32"
    if path == "swapped":
        _swapped(x, weight, out, bias_arg, biases, opts, config)
        return out
    args = (x, weight.qweight, weight.scales, biases, bias_arg, out, m, n, k, x.stride(0), weight.qweight.stride(0),
            weight.scales.stride(0), out.stride(0))
    assert path == "dequant", path
    if config is not None:
        cfg = dict(config)
        bm = cfg.pop("BLOCK_M", 16)
        while not _fits(g, k, cfg["BLOCK_K"]) and cfg["BLOCK_K"] > 16:
            cfg["BLOCK_K"] //= 2
        _wq_matmul_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, bm))](*args, **opts, BLOCK_M=bm, **cfg)
    elif interpreting():
        cfg = dict(INTERPRETER_CONFIG)
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], g) if g % cfg["BLOCK_K"] else cfg["BLOCK_K"]
        _wq_matmul_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, 16))](*args, **opts, BLOCK_M=16, **cfg)
    else:
        _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, 16))](*args, **opts, BLOCK_M=16)
    return out


def _tiled_gluon_call(x: torch.Tensor, weight: QuantizedWeight | TiledWeight) -> bool:
    """Whether a tiled weight's Gluon kernel takes x as it is (the epilogue variants' condition:
    wq_matmul_silu, wq_matmul_norm)."""
    return (isinstance(weight, TiledWeight) and x.is_cuda and decode_path(weight, x.shape[0], x.dtype) == "gluon"
            and wq_gluon.x_fits(x))


def _split_counters(n: int) -> int:
    """The Gluon kernel's split counters for n output columns: one a 64-column block of WORKSPACE_ROWS rows."""
    return -(-n // 64) * -(-WORKSPACE_ROWS // 16)


# A gated MLP's SiLU in the gate|up projection's epilogue where the Gluon kernel takes it
# (wq_matmul_silu), up to SILU_MAX_ROWS rows: H100, dummy Llama-3.1-8B (docs/BENCHMARKS.md), int8
# batch 1 3.57-3.59 -> 3.55 ms, but batch 64 slower (int4 4.12 -> 4.22: the pairs' second tiles read
# back and write BLOCK_M rows each, where the SiLU kernel spreads them over the chip).
# KVCASCADE_GLUON_SILU=0: never (the A/B: the matmul, then kernels/activation.py's kernel)
GLUON_SILU = os.environ.get("KVCASCADE_GLUON_SILU", "1") != "0"
SILU_MAX_ROWS = 16


def wq_matmul_silu(x: torch.Tensor, weight: QuantizedWeight | TiledWeight, config: dict | None = None,
                   rms: RmsHandoff | None = None, early_next: bool = False) -> torch.Tensor | None:
    """``silu_and_mul(wq_matmul(x, weight))`` in one launch, weight a gate|up projection ([2I, K],
    gate first): x [M, K] -> [M, I], written by the Gluon kernel's epilogue (kernels/wq_gluon.py's
    _silu_pair), so no kernel runs between this projection and the down projection. None where that
    kernel does not take the call (not a tiled weight, past SILU_MAX_ROWS rows, the tile's BLOCK_N
    not dividing I, GLUON_SILU off): the caller runs the two. ``config``: the tile (tests). ``rms``:
    as wq_matmul's (the SiLU then applies to the scaled sums). ``early_next``: the next kernel may be
    scheduled right after this one's wait (kernels/wq_gluon.py's late_launch: one row only)."""
    if rms is not None and (x.shape[0] != 1 or rms.parts.numel() > wq_gluon_tune.RMS_MAX_PARTS):
        return None
    m, k = x.shape
    n = weight.shape[0]
    if not (GLUON_SILU and 0 < m <= SILU_MAX_ROWS and n % 2 == 0 and _tiled_gluon_call(x, weight)):
        return None
    assert weight.shape[1] == k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # gate|up, read back by the pairs' second tiles
    # the split counters, then a counter a pair of output tiles (BLOCK_N 64 and BLOCK_M 8 at most)
    ws, cnt = _workspace(x.device, n, max(_split_counters(n), -(-m // 8) * -(-n // 64) * 3 // 2))
    cfg = config or wq_gluon_tune.tuned_config(x, weight, out, None, ws, cnt, WORKSPACE_ROWS)
    if n % (2 * wq_gluon_tune.block_n(cfg)):
        return None
    act = torch.empty(m, n // 2, dtype=x.dtype, device=x.device)
    wq_gluon_tune.wq_gluon(x, weight, out, None, ws, cnt, cfg, act=act,
                           norm_in=None if rms is None else (rms.parts, rms.eps), early_next=early_next)
    return act


# An add-RMS norm's work left to the two projections around it at one row of x (wq_matmul_norm):
# KVCASCADE_NORM_HANDOFF=0 runs the norm kernel between them instead (the A/B)
NORM_HANDOFF = os.environ.get("KVCASCADE_NORM_HANDOFF", "1") != "0"


def wq_matmul_norm(x: torch.Tensor, weight: QuantizedWeight | TiledWeight, residual: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, config: dict | None = None,
                   early_next: bool = False) -> tuple[torch.Tensor, torch.Tensor, RmsHandoff] | None:
    """``rms_norm(wq_matmul(x, weight), norm_weight, eps, residual)`` at one row of x, with no norm
    kernel: the Gluon kernel's epilogue writes h = x W^T + residual (the new residual, over
    ``residual``: the model reads the old one no more) and the next
    projection's x, norm_weight * h, and sums h^2 over each of its output tiles (kernels/wq_gluon.py's
    _norm_out; kernels/reference.py's norm_handoff_ref says the same in torch); the next projection,
    called with the returned RmsHandoff (wq_matmul's or wq_matmul_silu's ``rms``), adds those up and
    scales its sums by 1 / rms. Returns (x for the next projection, h, the handoff), or None where
    the kernel does not take the call (not a tiled weight, more than one row, a CPU tensor,
    NORM_HANDOFF off): the caller runs the projection and the norm kernel. ``early_next``: as
    wq_matmul_silu's."""
    m, n = x.shape[0], weight.shape[0]
    if not (NORM_HANDOFF and m == 1 and _tiled_gluon_call(x, weight)):
        return None
    if residual.shape != (m, n) or residual.dtype != x.dtype or not residual.is_contiguous() \
            or norm_weight.shape != (n, ) or not norm_weight.is_contiguous():
        return None
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, n, _split_counters(n))
    cfg = config or wq_gluon_tune.tuned_config(x, weight, out, None, ws, cnt, WORKSPACE_ROWS)
    tiles = triton.cdiv(n, wq_gluon_tune.block_n(cfg))
    if cfg.get("NS", 1) > 1 or tiles > wq_gluon_tune.RMS_MAX_PARTS:
        return None
    parts = torch.empty(tiles, dtype=torch.float32, device=x.device)
    wq_gluon_tune.wq_gluon(x, weight, out, None, ws, cnt, cfg, norm_out=(residual, norm_weight, parts),
                           early_next=early_next)
    return out, residual, RmsHandoff(parts, eps)


def _swapped(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor, bias_arg: torch.Tensor,
             biases: torch.Tensor, opts: dict, config: dict | None) -> None:
    (m, k), n = x.shape, weight.shape[0]
    block_k = _swap_block_k(weight.group_size, k)
    assert block_k is not None, "the swapped kernel takes groups of a power of two >= 16 that divide K"
    q = weight.qweight
    magic, offset = SWAP_MAGIC.get(x.dtype, (0, 0.0))
    perm_ok = _swap_perm_ok(q, magic, block_k, weight.bits)
    opts.update(BLOCK_K=block_k, MAGIC=magic, OFFSET=offset)
    ws, cnt = _workspace(x.device, n, -(-n // 16) * (WORKSPACE_ROWS // 16))  # a counter a tile, any rows
    args = (x, q, weight.scales, biases, bias_arg, out, ws, cnt, m, n, k, x.stride(0), q.stride(0),
            weight.scales.stride(0), out.stride(0), swap_rows_key(m))
    if config is None and interpreting():
        config = dict(BLOCK_N=16, BLOCK_M=16, SPLIT_K=2 if k // block_k >= 2 and m <= WORKSPACE_ROWS else 1,
                      PERM=True, XSUM_DOT=True)
    if config is None:
        _swap_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]), meta["SPLIT_K"])](
            *args, **opts)
        return
    cfg = dict(config)
    cfg.setdefault("SPLIT_K", 1)
    cfg.setdefault("XSUM_DOT", False)
    cfg["PERM"] = bool(cfg.get("PERM", False)) and perm_ok
    cfg["XSUM_DOT"] = bool(cfg["XSUM_DOT"]) and weight.bits == 4
    assert cfg["SPLIT_K"] == 1 or m <= WORKSPACE_ROWS
    _wq_swapped_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), cfg["SPLIT_K"])](
        *args, **opts, **cfg)
