"""Paged attention in Triton: decode (flash-decoding) and prefill/extend (varlen, causal).

Both read K/V straight from the engine's pool, ``[num_blocks, block_size, KVH, D]``, through
int32 block tables, and both are GQA-aware: a program owns one KV head and every query head of its
group, so each K/V tile is loaded once per group rather than once per query head.

Decode: the grid is (sequence, KV head, split). Each split walks its share of the context and
writes a partial (output normalised by its own sum, and log-sum-exp); a second small kernel
merges the splits, launched with PDL so its launch overlaps the first. With one split the first
kernel writes the output directly. (Merging in the last split to finish, found by a ticket
counter, saved that launch but measured slower at batch 1: the merging program walks its group's
heads one after another, where the merge kernel takes them all at once.) Two options, both from
H100 measurements (docs/BENCHMARKS.md): ``order`` starts the sequences in a given order (the
engine's: longest first, so short ones fill the tail of the grid), and ``rope_store`` takes the
step's unrotated q, k and v and does the rotary embedding and the KV store in the same launch.

Prefill: the new tokens of all sequences are flattened into one batch. A program takes a tile of
BLOCK_Q consecutive query tokens of one sequence; the rows of its Q tile are (token, head) pairs
of the group. Query token i of a sequence with ``q_len`` new tokens sits at position
``context_len - q_len + i``, which makes chunked prefill and prefix-cache hits the same case:

    keys:   | cached prefix (earlier chunks, prefix hits) | this step's tokens |
    query:                                                 i=0 ... q_len-1
    query i sees keys at positions <= context_len - q_len + i

Keys before the tile's first position are seen by every row and need no causal mask.

An int8 or fp8 pool (kernels/kv_quant.py: a scale per token and KV head beside the data, one
head's scales of a block contiguous) is dequantized in registers, never as a whole tile: the raw
K tile, exact in q's dtype, goes into the dot and each token's K scale multiplies its column of
scores; each token's V scale multiplies its column of p before the PV dot. ``KV_QMAX`` (0 for a
float pool) makes it a compile-time variant, so a float pool's kernels are as they were. Decode with
a bf16/fp16 q reads such a pool's tiles as uint16 byte pairs (DECODE_QUANT_DOTS "pairs"), so they
reach the dots the way a bf16 pool's do.
"""

from __future__ import annotations

import torch

from kernels._triton import (cdiv, check_launchable, early_next, interpreting, jit, launch_next_early, next_power_of_2,
                             pdl_launch, sm_count, tl, wait_for_producer)
from kernels.kv_store import kv_scale, kv_scale_args, quantize, scale_offsets
from kernels.rotary import _rotate

# The kernels use exp2: the softmax scale is multiplied by log2(e) once.
_LOG2E = 1.4426950408889634

# Tile sizes; module-level so tests can shrink them to exercise many tiles at tiny shapes.
# Decode tile, warps and stages as swept on an H100 (benchmarks/kernels_gpu.py --sweep-decode,
# docs/BENCHMARKS.md). A grid of many programs a SM (large batches) reads fastest with 128 tokens
# a step in 3 stages (95.8% of copy bandwidth at batch 256, against 93.7% for 64 in 2); a smaller
# grid, with fewer programs resident a SM, with DECODE_NARROW. At head_dim > 128 the tile is halved
# to fit shared memory.
DECODE_BLOCK_N = 128  # context tokens per inner step
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
DECODE_NARROW = (64, 4, 2)  # (tokens a step, warps, stages) below WIDE_MIN_PROGRAMS_PER_SM
WIDE_MIN_PROGRAMS_PER_SM = 8
# An int8/fp8 pool takes one config at any grid size: an H100 sweep (benchmarks/kv_cache_gpu.py
# --tokenizer .tok --sweep-decode, docs/BENCHMARKS.md; batch 64 x 4,096 tokens, 8 KV heads) found
# 128 tokens, 4 warps, 3 stages best for both fp8 and int8: fp8 0.301 ms, against 0.428 ms with
# DECODE_NARROW, which that grid would otherwise get.
DECODE_QUANT = (128, 4, 3)
# The dot operands of decode over an int8/fp8 pool with a bf16 or fp16 q (a float32 q always
# runs its dots in float32). H200, batch 64 x 4,096 tokens, 8 KV heads (docs/BENCHMARKS.md):
#   "q"      q's dtype: each K/V element converted to it, p * scale rounded to it. fp8 0.286 ms.
#   "fp16"   q converted to fp16 once a program, each K/V element straight to fp16, p * scale
#            rounded to fp16; accumulation stays fp32. Exact for the K/V bytes (int8 and e4m3
#            values are fp16 values) and for q with 2^-14 <= |q| <= 65504 (a bf16 value in that
#            range is an fp16 value; smaller ones lose bits, larger ones overflow). The assumption:
#            a real model's q stays far below 65504 (Llama-style q, after RoPE, in the tens to
#            hundreds). p * scale under 2^-14 rounds as an fp16 subnormal: an absolute error under
#            2^-25 of a V scale's unit, negligible against the sum (l >= 1). fp8 0.256 ms, int8 0.285.
#   "pairs"  as "fp16", but the tiles are read as uint16 pairs of bytes (_attend_tile_pairs): an
#            8-bit tile goes from shared memory to a dot's operand a byte or two a load, with
#            address arithmetic for each, where a 16-bit one goes by ldmatrix (.trans for V), and
#            one prmt and two converts (_split_pairs) turn two pairs into fp16 operands. The same
#            operands and so the same results as "fp16" (the dot over D runs as two over D / 2).
#            fp8 0.184 ms, int8 0.191; with the register cap below 0.148 / 0.149 (bf16's pool: 0.290).
#   "8bit"   the bytes go into the dots as stored, SageAttention / FA3-FP8 style: q quantized once
#            a program to the pool's type with a scale per query head (amax / QMAX, as a K/V
#            token's) and S^T = K q^T an e4m3 (or s8) wgmma, with tokens as the dot's M (a 16-row
#            q as M gets mma.sync, which takes no e4m3 on sm_90: Triton converts to fp16); the scales
#            after the dot. For an fp8 pool PV is an e4m3 wgmma too, p * v_scale over the tile's
#            largest V scale times 448 rounded to e4m3; Triton transposes V for it byte by byte
#            through shared memory. fp8 0.659 ms, max error 26x "fp16"'s on normal K/V.
#   "8bit_qk" as "8bit" with PV on fp16 operands: fp8 0.233 ms, error 21x; int8 0.253 ms, 8x.
#            (int8 p would round every p under 1/254 of the tile's largest to zero: no int8 PV.)
DECODE_QUANT_DOTS = "pairs"
# A register cap for decode over an int8/fp8 pool (None: the compiler's choice). "pairs" takes 152-164
# registers a thread, 3 programs (4 warps) a SM; at 128 (a few spills outside the loop), 4. At
# batch 64 x 8 KV heads (512 programs, 132 SMs) that is one wave instead of 1.3: 0.184 -> 0.148 ms.
DECODE_QUANT_MAXNREG = 128
# Prefill tiles as swept on an H100 (benchmarks/kernels_gpu.py --sweep-prefill, 54 configs): a Q tile
# of 64 rows (16 tokens x 4 heads), 64 keys a step, 2 stages took an 8,192-token admission step
# in 0.241 ms a layer and 4 x 512 tokens after cached prefixes in 0.232 ms, against 0.270 / 0.267
# for the previous 128 rows, 8 warps, 3 stages.
PREFILL_BLOCK_M = 64  # Q tile rows: BLOCK_M // group query tokens x the group's heads
PREFILL_BLOCK_N = 64
PREFILL_NUM_WARPS = 8  # for Q tiles of 128 rows or more; smaller ones take 4
PREFILL_NUM_STAGES = 2
# Flash-decoding heuristic: aim for this many programs per SM, but give a split at least
# MIN_SPLIT_TOKENS of context (below that the merge costs more than the parallelism gains).
SPLIT_PROGRAMS_PER_SM = 2
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 64


@jit
def _attend_tile(
    q, m_i, l_i, acc,  # running state of the Q tile: [M, D] input, [M] max (log2 units), [M] sum, [M, D]
    k_ptr, v_ptr, bt_row, kv_head_off,
    n_start, kv_end,  # this tile covers context positions [n_start, n_start + BLOCK_N) clipped to kv_end
    q_pos,  # [M] position of each row's query token
    qk_scale, stride_kb, stride_kt, offs_d, d_mask,
    ks_ptr, vs_ptr, stride_sb,  # KV_QMAX > 0: the scales, pointers at this KV head's (a block's contiguous)
    q_rs,  # KV_QMAX > 0: qk_scale, or with 8-bit QK dots [M] q's row scales times it
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_QMAX: tl.constexpr,
    DOTS: tl.constexpr,  # KV_QMAX > 0: see DECODE_QUANT_DOTS ("fp16": q arrives in fp16)
):
    """One online-softmax step over BLOCK_N context tokens gathered through the block table."""
    pos = n_start + tl.arange(0, BLOCK_N)
    p_mask = pos < kv_end
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_mask, other=0).to(tl.int64)
    tok = blk * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kt + kv_head_off
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    QK8: tl.constexpr = DOTS == "8bit" or DOTS == "8bit_qk"  # q arrives in the pool's dtype
    PV8: tl.constexpr = DOTS == "8bit" and KV_QMAX == 448.0
    if KV_QMAX > 0:  # a token's K scale multiplies its column of scores: [BLOCK_N], not [BLOCK_N, D]
        tok_scale = blk * stride_sb + (pos % BLOCK_SIZE).to(tl.int64)
        ks = tl.load(ks_ptr + tok_scale, mask=p_mask, other=0.0)
        if QK8:  # S^T = K q^T, the bytes as stored: tokens are the dot's M (wgmma wants 64 and up)
            if KV_QMAX == 127.0:
                s = tl.trans(tl.dot(k, tl.trans(q), out_dtype=tl.int32).to(tl.float32))
            else:
                s = tl.trans(tl.dot(k, tl.trans(q)))
            s = s * q_rs[:, None] * ks[None, :]  # q's scales (qk_scale in them) and K's after the dot
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * (ks * q_rs)[None, :]
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        s = tl.where(p_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if KV_QMAX > 0:  # and its V scale its column of p (l_i above sums p unscaled)
        vs = tl.load(vs_ptr + tok_scale, mask=p_mask, other=0.0)
        if PV8:  # O^T = V^T (p x vs)^T; p * vs over the tile's largest vs is <= 1 (p is): x 448 fits e4m3
            w = tl.maximum(tl.max(vs, 0), 1e-30)
            pv = (p * (vs * (448.0 / w))[None, :]).to(v.dtype)
            acc = acc * alpha[:, None] + tl.trans(tl.dot(tl.trans(v), tl.trans(pv))) * (w / 448.0)
        else:
            op: tl.constexpr = tl.float16 if QK8 else q.dtype
            acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(op), v.to(op), input_precision=DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@jit
def _bytes_to_fp16(x, DTYPE: tl.constexpr):
    """One byte of int8 or e4m3 bits (x, an integer) as fp16."""
    if DTYPE == tl.int8:
        return x.to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float16)
    return x.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@jit
def _split_pairs(x, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """uint16 pairs of int8 / e4m3 bytes -> (low bytes, high bytes) as fp16. ASM: two pairs a
    32-bit register, one prmt gathers the low bytes and the high bytes, and each gathered pair is one
    cvt (e4m3x2 -> f16x2) or, for int8, the fp16 0x64XX trick (bits 0x6400 | (b ^ 0x80) are the
    value 1152 + b: one prmt, one sub each); plain Triton spends masks, shifts and a convert each."""
    if not ASM:
        return _bytes_to_fp16(x & 0xFF, DTYPE), _bytes_to_fp16(x >> 8, DTYPE)
    if DTYPE == tl.int8:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, lo, hi; xor.b32 t, $2, 0x80808080;"
            " prmt.b32 lo, t, 0x64646464, 0x6240; prmt.b32 hi, t, 0x64646464, 0x6341;"
            " mov.b32 t, 0x64806480; sub.f16x2 $0, lo, t; sub.f16x2 $1, hi, t; }",
            "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t;"
        " cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@jit
def _attend_tile_pairs(
    q_lo, q_hi, m_i, l_i, acc_lo, acc_hi,  # q's and the output's even and odd dims: [M, D / 2] each
    k_ptr, v_ptr, bt_row, kv_head_off, n_start, kv_end, q_rs, stride_kb, stride_kt, offs_d2, d2_mask,
    ks_ptr, vs_ptr, stride_sb,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
):
    """_attend_tile over an int8/fp8 pool, reading its bytes two at a time as uint16: 16-bit tiles
    go from shared memory to the dots' operands by ldmatrix (.trans for V), where 8-bit ones take a
    load per element; each pair's low byte (even dim) and high byte (odd dim) become fp16 operands of
    two dots of D / 2."""
    DTYPE: tl.constexpr = k_ptr.dtype.element_ty
    k16 = k_ptr.to(tl.pointer_type(tl.uint16))
    v16 = v_ptr.to(tl.pointer_type(tl.uint16))
    pos = n_start + tl.arange(0, BLOCK_N)
    p_mask = pos < kv_end
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_mask, other=0).to(tl.int64)
    tok = (blk * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kt + kv_head_off) // 2
    kv_mask = p_mask[:, None] & d2_mask[None, :]
    k = tl.load(k16 + tok[:, None] + offs_d2[None, :], mask=kv_mask, other=0)
    tok_scale = blk * stride_sb + (pos % BLOCK_SIZE).to(tl.int64)
    ks = tl.load(ks_ptr + tok_scale, mask=p_mask, other=0.0)
    k_lo, k_hi = _split_pairs(k, DTYPE, ASM)
    s = tl.dot(q_lo, tl.trans(k_lo))
    s = tl.dot(q_hi, tl.trans(k_hi), s)
    s = s * (ks * q_rs)[None, :]
    s = tl.where(p_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v16 + tok[:, None] + offs_d2[None, :], mask=kv_mask, other=0)
    vs = tl.load(vs_ptr + tok_scale, mask=p_mask, other=0.0)
    pv = (p * vs[None, :]).to(tl.float16)
    v_lo, v_hi = _split_pairs(v, DTYPE, ASM)
    acc_lo = tl.dot(pv, v_lo, acc_lo * alpha[:, None])
    acc_hi = tl.dot(pv, v_hi, acc_hi * alpha[:, None])
    return m_new, l_i, acc_lo, acc_hi


# The block table's width (stride_bt) follows the step's longest sequence, and a mixed step's
# decode rows' tables and lengths are the first rows of the step's: see jit.
@jit(do_not_specialize=("stride_bt",))
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, order_ptr, out_ptr, part_o_ptr, part_lse_ptr, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ob, stride_oh,
    # ROPE_STORE: the step's new token (unrotated q, k, and v) is rotated here and its K/V stored
    pos_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, slot_ptr, stride_knb, stride_knh, stride_vnb, stride_vnh,
    stride_cos, stride_sin,
    ks_ptr, vs_ptr, stride_sb, stride_sh,  # KV_QMAX > 0: the pool's scales [num_blocks, KVH, block_size]
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_ORDER: tl.constexpr, ROPE_STORE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QMAX: tl.constexpr,  # 0: a float pool; else an int8/fp8 pool's QMAX
    DOTS: tl.constexpr,  # KV_QMAX > 0: the dots' operands, see DECODE_QUANT_DOTS
    USE_PDL: tl.constexpr,
    EARLY: tl.constexpr = False,  # kernels/_triton.py's early_next
):
    launch_next_early(USE_PDL, EARLY)  # not delayed behind the reads below
    # Before the wait: what no kernel of the step writes (the step's inputs, copied in before it,
    # and the rotary tables), so the chains order -> context and position -> cos/sin overlap the
    # kernel before. The KV pool and q are read after it.
    b = tl.program_id(0)
    if HAS_ORDER:  # programs start in the given order of sequences (the engine's: longest first)
        b = tl.load(order_ptr + b)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    # Splits start on tile boundaries; trailing splits of a short context are empty.
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    if ROPE_STORE:
        pos = tl.load(pos_ptr + b).to(tl.int64)
        c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)
        s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=d_mask, other=0.0)
        slot = tl.load(slot_ptr + b).to(tl.int64)
    wait_for_producer(USE_PDL, EARLY, LAUNCHED=True)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    qo_mask = g_mask[:, None] & d_mask[None, :]
    q_row = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_row + offs_d[None, :], mask=qo_mask, other=0.0)
    if ROPE_STORE:
        # The new token sits at position ctx - 1; its K/V are not in the pool yet. Every split
        # rotates q; the split whose range holds ctx - 1 stores the rotated k and v and attends to
        # them from registers, after its tiles (which stop short of ctx - 1): no read-back.
        HALF: tl.constexpr = HEAD_DIM // 2
        first = offs_d < HALF
        partner = tl.where(first, offs_d + HALF, offs_d - HALF)  # rotate_half's source column
        sign = tl.where(first, -1.0, 1.0)
        # every load before the first rotation (whose layout changes wait at barriers): one round trip
        q_partner = tl.load(q_row + partner[None, :], mask=qo_mask, other=0.0)
        kn_row = kn_ptr + b.to(tl.int64) * stride_knb + kvh * stride_knh
        k_new = tl.load(kn_row + offs_d, mask=d_mask, other=0.0)
        k_partner = tl.load(kn_row + partner, mask=d_mask, other=0.0)
        v_new = tl.load(vn_ptr + b.to(tl.int64) * stride_vnb + kvh * stride_vnh + offs_d, mask=d_mask, other=0.0)
        q = _rotate(q, q_partner, c[None, :], s[None, :], sign[None, :])
        k_new = _rotate(k_new, k_partner, c, s, sign)
        owner = (start <= ctx - 1) & (ctx - 1 < end)  # false for an idle row (context 0)
        keep = d_mask & owner & (slot >= 0)  # slot -1: a padding row (CUDA graphs)
        dst = tl.maximum(slot, 0) * stride_kt + kvh * stride_kh + offs_d  # the pool row of slot s: s * stride_kt
        if KV_QMAX > 0:
            # Stored quantized, and attended below as stored: this step's output is what a later
            # step reading the pool computes. k_new and v_new become the stored int8/fp8 values.
            k_scale = kv_scale(tl.max(tl.abs(k_new.to(tl.float32)), 0), KV_QMAX)
            v_scale = kv_scale(tl.max(tl.abs(v_new.to(tl.float32)), 0), KV_QMAX)
            k_new = quantize(k_new, k_scale, k_ptr.dtype.element_ty, KV_QMAX)
            v_new = quantize(v_new, v_scale, v_ptr.dtype.element_ty, KV_QMAX)
            scale_dst = scale_offsets(tl.maximum(slot, 0), kvh, NUM_HEADS // GROUP, BLOCK_SIZE)
            tl.store(ks_ptr + scale_dst, k_scale, mask=owner & (slot >= 0))
            tl.store(vs_ptr + scale_dst, v_scale, mask=owner & (slot >= 0))
        tl.store(k_ptr + dst, k_new.to(k_ptr.dtype.element_ty), mask=keep)
        tl.store(v_ptr + dst, v_new.to(v_ptr.dtype.element_ty), mask=keep)
        tiles_end = tl.minimum(end, ctx - 1)
    else:
        tiles_end = end
    q_rs = qk_scale  # with 8-bit QK dots, q's row scales times qk_scale
    QK8: tl.constexpr = DOTS == "8bit" or DOTS == "8bit_qk"
    if DOTS == "fp16":  # _attend_tile converts K, V and p * scale to q's dtype; the new token below follows
        q = q.to(tl.float16)
    elif QK8:  # q quantized as the pool stores a K/V token (kv_store.quantize), a scale per query head
        q_scale = kv_scale(tl.max(tl.abs(q.to(tl.float32)), 1), KV_QMAX)
        q = quantize(q, q_scale[:, None], k_ptr.dtype.element_ty, KV_QMAX)
        q_rs = q_scale * qk_scale
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    q_pos = tl.zeros([BLOCK_G], tl.int32) + (ctx - 1)
    if DOTS == "pairs" or DOTS == "pairs_asm":
        q_lo, q_hi = tl.split(tl.reshape(q, [BLOCK_G, BLOCK_D // 2, 2]))
        q_lo = q_lo.to(tl.float16)
        q_hi = q_hi.to(tl.float16)
        acc_lo = tl.zeros([BLOCK_G, BLOCK_D // 2], tl.float32)
        acc_hi = tl.zeros([BLOCK_G, BLOCK_D // 2], tl.float32)
        offs_d2 = tl.arange(0, BLOCK_D // 2)
        for n in range(start, tiles_end, BLOCK_N):
            m_i, l_i, acc_lo, acc_hi = _attend_tile_pairs(
                q_lo, q_hi, m_i, l_i, acc_lo, acc_hi, k_ptr, v_ptr, bt_row, kvh * stride_kh, n, tiles_end, q_rs,
                stride_kb, stride_kt, offs_d2, offs_d2 < HEAD_DIM // 2, ks_ptr + kvh * stride_sh,
                vs_ptr + kvh * stride_sh, stride_sb, BLOCK_SIZE, BLOCK_N, DOTS == "pairs_asm",
            )
        acc = tl.reshape(tl.join(acc_lo, acc_hi), [BLOCK_G, BLOCK_D])
    else:
        for n in range(start, tiles_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, kvh * stride_kh, n, tiles_end, q_pos,
                qk_scale, stride_kb, stride_kt, offs_d, d_mask, ks_ptr + kvh * stride_sh, vs_ptr + kvh * stride_sh,
                stride_sb, q_rs, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, KV_QMAX, DOTS,
            )
    if ROPE_STORE:  # the new token, one more online-softmax step (as _attend_tile rounds p for PV)
        if KV_QMAX > 0:  # scaled as _attend_tile scales a tile's scores and p (8-bit q: as the tiles saw it)
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * (k_scale * q_rs)
        else:
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale
        m_new = tl.maximum(m_i, s_new)
        p = tl.exp2(s_new - m_new)
        alpha = tl.exp2(m_i - m_new)
        if QK8:  # p * v_scale unrounded: one token, no dot
            pv = (p * v_scale)[:, None] * v_new.to(tl.float32)[None, :]
        elif KV_QMAX > 0:
            pv = (p * v_scale).to(q.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
        else:
            pv = p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
        m_i = tl.where(owner, m_new, m_i)
        l_i = tl.where(owner, l_i * alpha + p, l_i)
        acc = tl.where(owner, acc * alpha[:, None] + pv, acc)
    # An empty range (context 0, or a split past the end) leaves l = 0: its output is zeros.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=qo_mask,
        )
    else:
        row = (b.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split  # part_* are [B, H, S(, D)]
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=qo_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr = False,
):
    """Merges one (sequence, head)'s split partials, weighting each by exp2(lse - max lse)."""
    wait_for_producer(USE_PDL, EARLY)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row = (b.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    # asked for with the scores, not after their max: one round trip to the L2, not two
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # all -inf (context 0): all weights 0
    denom = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@jit
def _find_sequence(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile ``tile``: the last b with qsl[b] // BLOCK_Q + b <= tile.

    Sequence b's tiles are numbered from qsl[b] // BLOCK_Q + b on; that leaves room for its
    ceil(q_len / BLOCK_Q) tiles, so T // BLOCK_Q + B programs cover any batch (extras exit).
    """
    lo = tile * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


# A mixed step's prefill rows start at row nd of the step's tables, lengths and queries: their
# pointers' alignment and the sequence count change from step to step (see jit).
@jit(do_not_specialize=("num_seqs", "stride_bt"),
     do_not_specialize_on_alignment=("bt_ptr", "qsl_ptr", "ctx_ptr"))
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qsl_ptr, ctx_ptr, num_seqs, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    ks_ptr, vs_ptr, stride_sb, stride_sh,  # KV_QMAX > 0: the pool's scales [num_blocks, KVH, block_size]
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QMAX: tl.constexpr,  # 0: a float pool; else an int8/fp8 pool's QMAX
    USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = _find_sequence(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    tok0 = (tile - (q_start // BLOCK_Q + b)) * BLOCK_Q  # first query token of this tile
    if tok0 >= q_len:
        return
    ctx = tl.load(ctx_ptr + b)
    prefix = ctx - q_len

    # Rows are (token, head) pairs: row r is token tok0 + r // GROUP, head kvh * GROUP + r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    tok = tok0 + offs_m // GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    heads = kvh * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    qo_mask = row_mask[:, None] & d_mask[None, :]
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0)
    # Every row (padding rows too) sees key `prefix + tok0`, so no row's max stays -inf.
    q_pos = prefix + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_kh
    full_end = (prefix + tok0) // BLOCK_N * BLOCK_N  # keys every row sees: no causal mask
    for n in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, kv_head_off, n, full_end, q_pos,
            qk_scale, stride_kb, stride_kt, offs_d, d_mask, ks_ptr + kvh * stride_sh, vs_ptr + kvh * stride_sh,
            stride_sb, qk_scale, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, KV_QMAX, "q",
        )
    kv_end = tl.minimum(prefix + tok0 + BLOCK_Q, ctx)  # one past the tile's last query position
    for n in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, kv_head_off, n, kv_end, q_pos,
            qk_scale, stride_kb, stride_kt, offs_d, d_mask, ks_ptr + kvh * stride_sh, vs_ptr + kvh * stride_sh,
            stride_sb, qk_scale, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, KV_QMAX, "q",
        )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty), mask=qo_mask,
    )


def _check_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[int, tuple, float]:
    """Validates the shared layout assumptions; returns the GQA group size, the scale arguments
    (k_scales, v_scales, stride_sb, stride_sh) and KV_QMAX (0: a float pool)."""
    assert k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
    k_scales, v_scales, qmax = kv_scale_args(k_cache, v_cache, kv_scales)
    if qmax:  # an int8/fp8 tile converts to q's dtype exactly
        assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q must be a float dtype, got {q.dtype}"
    else:
        assert k_cache.dtype == v_cache.dtype == q.dtype, "q and the K/V pool must share a dtype"
    assert q.shape[-1] == k_cache.shape[3] and q.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert context_lens.dtype == torch.int32 and context_lens.is_contiguous()
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    return num_heads // num_kv_heads, (k_scales, v_scales, k_scales.stride(0), k_scales.stride(1)), qmax


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The kernels' output: ``out`` when given (any row stride; heads and dims contiguous, as q's)."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise run as TF32 on tensor cores (about 3 significant digits).
    return "ieee" if dtype == torch.float32 else "tf32"


def _decode_dots(q_dtype: torch.dtype, qmax: float) -> str:
    """Decode's dot operands (DECODE_QUANT_DOTS) for this q over this pool; "pairs" converts by
    inline PTX, which the interpreter cannot run, when compiled ("pairs_asm")."""
    assert DECODE_QUANT_DOTS in ("q", "fp16", "pairs", "8bit", "8bit_qk"), DECODE_QUANT_DOTS
    if not qmax or q_dtype == torch.float32:
        return "q"
    return "pairs_asm" if DECODE_QUANT_DOTS == "pairs" and not interpreting() else DECODE_QUANT_DOTS


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) so that small batches with long contexts fill the chip.

    ``max_context`` is a host-side bound (block table width x block size), so choosing never
    reads the device: no synchronisation, and the same choice inside a CUDA graph.
    """
    programs = batch * num_kv_heads
    target = SPLIT_PROGRAMS_PER_SM * sm_count(device)
    if programs >= target:
        return 1
    splits = max(1, min(cdiv(target, programs), cdiv(max_context, MIN_SPLIT_TOKENS), MAX_SPLITS))
    # A power of two (rounded down): NUM_SPLITS is a compile-time constant, and any count from 1 to
    # MAX_SPLITS would be a kernel variant compiled on first sight, stalling a server mid-load.
    return 1 << (splits.bit_length() - 1)


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded with 0
    context_lens: torch.Tensor,  # [B] int32; 0 gives a zero output row
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # written in place when given (rows of a larger batch's output)
    order: torch.Tensor | None = None,  # [B] int32, a permutation of the rows: programs start in it
    rope_store: tuple | None = None,  # (positions, k, v, cos, sin, slot_mapping): see below
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8/fp8 pool: [num_blocks, KVH, block_size] fp32
    next_quantized: bool = False,  # a quantized projection reads the output (kernels/_triton.py's early_next)
) -> torch.Tensor:
    """Attention of each row's query over its context. With ``rope_store``, ``q`` is not rotated
    yet and the step's new token is not in the pool: the kernel rotates q and k (as
    ``rotary_store_kv``: positions [B] int, k and v [B, KVH, D], the fp32 cos/sin tables), stores
    k and v at ``slot_mapping`` [B] int64 (-1: skip) and attends to them, in one launch. q and k
    are left as they were. An int8/fp8 pool stores them quantized and attends to them as stored."""
    extra = () if order is None else (order,)
    if rope_store is not None:
        extra += tuple(rope_store)
    check_launchable(q, k_cache, v_cache, block_tables, context_lens, *extra, *(kv_scales or ()))
    assert order is None or (order.dtype == torch.int32 and order.shape == context_lens.shape)
    group, scale_args, qmax = _check_inputs(q, k_cache, v_cache, block_tables, context_lens, kv_scales)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = _output(q, out)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, q.device)
    assert num_splits >= 1
    if num_splits > 1:
        part_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    block_d = next_power_of_2(head_dim)
    pdl = pdl_launch(q.device)
    early = early_next(next_quantized, batch)
    dots = _decode_dots(q.dtype, qmax)
    if qmax:
        block_n, num_warps, num_stages = DECODE_QUANT
    elif batch * num_kv_heads * num_splits >= WIDE_MIN_PROGRAMS_PER_SM * sm_count(q.device):
        block_n, num_warps, num_stages = DECODE_BLOCK_N, DECODE_NUM_WARPS, DECODE_NUM_STAGES
    else:
        block_n, num_warps, num_stages = DECODE_NARROW
    if rope_store is not None:
        positions, k_new, v_new, cos, sin, slots = rope_store
        assert k_new.shape == v_new.shape == (batch, num_kv_heads, head_dim) and head_dim % 2 == 0
        assert k_new.stride(2) == v_new.stride(2) == 1 and cos.stride(1) == sin.stride(1) == 1
        assert cos.shape[1] == head_dim and sin.shape == cos.shape and positions.shape == slots.shape == (batch,)
        assert slots.dtype == torch.int64 and k_cache.is_contiguous()
        rope_args = (positions, k_new, v_new, cos, sin, slots, k_new.stride(0), k_new.stride(1),
                     v_new.stride(0), v_new.stride(1), cos.stride(0), sin.stride(0))
    else:
        rope_args = (context_lens,) * 6 + (0,) * 6  # unused
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, context_lens if order is None else order,
        out, part_o, part_lse, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *rope_args, *scale_args,
        NUM_HEADS=num_heads, GROUP=group,
        BLOCK_G=max(16, next_power_of_2(group)),  # tl.dot needs at least 16 rows
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_N=block_n if block_d <= 128 else block_n // 2,  # K/V stages in shared memory
        NUM_SPLITS=num_splits, HAS_ORDER=order is not None, ROPE_STORE=rope_store is not None,
        DOT_PRECISION=_dot_precision(q.dtype), KV_QMAX=qmax,
        DOTS=dots,
        num_warps=num_warps, num_stages=num_stages, **pdl, **early,
        **({"maxnreg": DECODE_QUANT_MAXNREG} if dots == "pairs_asm" and DECODE_QUANT_MAXNREG else {}),
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
            HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=4, **pdl, **early,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D] new tokens of all sequences, flattened
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]; the new tokens' K/V already stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32: cached prefix + new tokens
    scale: float,
    out: torch.Tensor | None = None,  # written in place when given (rows of a larger batch's output)
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8/fp8 pool: [num_blocks, KVH, block_size] fp32
) -> torch.Tensor:
    check_launchable(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, *(kv_scales or ()))
    group, scale_args, qmax = _check_inputs(q, k_cache, v_cache, block_tables, context_lens, kv_scales)
    num_tokens, _, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    assert query_start_loc.dtype == torch.int32 and query_start_loc.is_contiguous()
    assert query_start_loc.shape[0] == num_seqs + 1
    out = _output(q, out)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = max(PREFILL_BLOCK_M, next_power_of_2(group))
    block_q = block_m // group
    block_d = next_power_of_2(head_dim)
    block_n = PREFILL_BLOCK_N if block_d <= 128 else PREFILL_BLOCK_N // 2  # keep K/V stages in shared memory
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens, num_seqs, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *scale_args,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype), KV_QMAX=qmax,
        num_warps=PREFILL_NUM_WARPS if block_m >= 128 else 4, num_stages=PREFILL_NUM_STAGES, **pdl_launch(q.device),
    )
    return out
