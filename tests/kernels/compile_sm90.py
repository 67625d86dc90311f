"""Compile every kernel for an H100 (sm_90) without a GPU: ``python -m tests.kernels.compile_sm90``.

The interpreter runs kernels as Python, so it misses what only the compiler sees (types that
change across a loop, layouts, shared memory). This lowers each kernel, at Llama-3.1-8B shapes
in bf16, through Triton's own pipeline to a cubin with the bundled ptxas, and prints one line
per kernel with its shared memory and whether its K/V loads were software-pipelined. The kernels
that read or write the KV pool are also lowered for an int8 and an fp8 (e4m3) pool with bf16 q.

Must run without TRITON_INTERPRET (the kernels must be decorated for compilation).
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import activation, argmax, kv_store, matmul, paged_attention, rmsnorm, rotary, skinny, wq_matmul
from kernels.kv_quant import QMAX

TARGET = GPUTarget("cuda", 90, 32)
P = "*bf16"
# A pool's element type -> its kernels' KV_QMAX (0: a float pool, no scales)
POOLS = {P: 0.0, "*i8": QMAX[torch.int8], "*fp8e4nv": QMAX[torch.float8_e4m3fn]}


class C:
    """A constexpr argument's value."""

    def __init__(self, value):
        self.value = value


def compile_kernel(fn, args: dict, num_warps: int = 4, num_stages: int = 3):
    args = {**args, "USE_PDL": C(True)}  # as launched on an H100: each kernel waits for its producer
    if "EARLY" in fn.arg_names:  # kernels/_triton.py's early_next: off unless the case turns it on
        args.setdefault("EARLY", C(False))
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = args[name]
        if isinstance(value, C):
            signature[name], constexprs[name] = "constexpr", value.value
        else:
            signature[name] = value
            if value.startswith("*") or name.startswith("stride") or name in ("N", "K"):
                # What a real launch specialises: pointers, strides and matrix sizes divisible by 16.
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET,
                          options={"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": True})


def _scale_args(pool: str) -> dict:
    """A quantized pool's scale pointers and strides; a float pool's launch passes its caches."""
    scales = "*fp32" if POOLS[pool] else P
    return dict(ks_ptr=scales, vs_ptr=scales, stride_sb="i32", stride_sh="i32", KV_QMAX=C(POOLS[pool]))


def _decode_args(splits: int, block_n: int = paged_attention.DECODE_BLOCK_N, pool: str = P) -> dict:
    part = "*fp32" if splits > 1 else P
    return dict(
        q_ptr=P, k_ptr=pool, v_ptr=pool, bt_ptr="*i32", ctx_ptr="*i32", order_ptr="*i32", out_ptr=P,
        part_o_ptr=part, part_lse_ptr=part, HAS_ORDER=C(True), ROPE_STORE=C(True),  # as a decode graph launches it
        **_scale_args(pool),
        pos_ptr="*i64", kn_ptr=P, vn_ptr=P, cos_ptr="*fp32", sin_ptr="*fp32", slot_ptr="*i64", stride_knb="i32",
        stride_knh="i32", stride_vnb="i32", stride_vnh="i32", stride_cos="i32", stride_sin="i32",
        qk_scale="fp32", stride_qb="i32", stride_qh="i32", stride_kb="i32", stride_kt="i32", stride_kh="i32",
        stride_bt="i32", stride_ob="i32", stride_oh="i32", NUM_HEADS=C(32), GROUP=C(4), BLOCK_G=C(16),
        HEAD_DIM=C(128), BLOCK_D=C(128), BLOCK_SIZE=C(16), BLOCK_N=C(block_n),
        NUM_SPLITS=C(splits), DOT_PRECISION=C("tf32"),
        # as paged_decode_attention launches a bf16 q over a quantized pool
        DOTS=C(paged_attention._decode_dots(torch.bfloat16, POOLS[pool])),
    )


def _prefill_args(group: int, pool: str = P) -> dict:
    return dict(
        q_ptr=P, k_ptr=pool, v_ptr=pool, out_ptr=P, bt_ptr="*i32", qsl_ptr="*i32", ctx_ptr="*i32", num_seqs="i32",
        **_scale_args(pool),
        qk_scale="fp32", stride_qt="i32", stride_qh="i32", stride_kb="i32", stride_kt="i32", stride_kh="i32",
        stride_bt="i32", stride_ot="i32", stride_oh="i32", GROUP=C(group),
        BLOCK_Q=C(paged_attention.PREFILL_BLOCK_M // group), BLOCK_M=C(paged_attention.PREFILL_BLOCK_M),
        HEAD_DIM=C(128), BLOCK_D=C(128), BLOCK_SIZE=C(16), BLOCK_N=C(paged_attention.PREFILL_BLOCK_N),
        DOT_PRECISION=C("tf32"),
    )


def _prefill_launch() -> tuple[int, int]:
    """Warps and stages as paged_prefill_attention launches the kernel."""
    warps = paged_attention.PREFILL_NUM_WARPS if paged_attention.PREFILL_BLOCK_M >= 128 else 4
    return warps, paged_attention.PREFILL_NUM_STAGES


def _rotary_args(pool: str, store: bool = True) -> dict:
    return dict(
        pos_ptr="*i64", q_ptr=P, k_ptr=P, v_ptr=P, cos_ptr="*fp32", sin_ptr="*fp32", k_cache_ptr=pool,
        v_cache_ptr=pool, **_scale_args(pool), slot_ptr="*i64", stride_qt="i32", stride_qh="i32", stride_kt="i32",
        stride_kh="i32", stride_vt="i32", stride_vh="i32", stride_cos="i32", stride_sin="i32", num_q_heads="i32",
        num_k_heads="i32", HEAD_DIM=C(128), HALF=C(64), BLOCK_HALF=C(64), BLOCK_HQ=C(32), BLOCK_HK=C(8),
        STORE_KV=C(store), BLOCK_SIZE=C(16 if POOLS[pool] else 1),
    )


def quantized_cases() -> list[tuple]:
    """The pool's readers and writers for int8 and fp8 pools (bf16 q, k, v)."""
    cases = []
    for pool, name in (("*i8", "int8"), ("*fp8e4nv", "fp8")):
        cases += [
            (f"decode {name}, 1 split", paged_attention._decode_kernel,
             _decode_args(1, paged_attention.DECODE_QUANT[0], pool), *paged_attention.DECODE_QUANT[1:], True),
            (f"decode {name}, 8 splits", paged_attention._decode_kernel,
             _decode_args(8, paged_attention.DECODE_QUANT[0], pool), *paged_attention.DECODE_QUANT[1:], True),
            (f"decode {name}, 8-bit dots", paged_attention._decode_kernel,
             {**_decode_args(1, paged_attention.DECODE_QUANT[0], pool), "DOTS": C("8bit")},
             *paged_attention.DECODE_QUANT[1:], True),
            (f"prefill {name}, group 4", paged_attention._prefill_kernel, _prefill_args(4, pool), *_prefill_launch(),
             True),
            (f"store_kv {name}", kv_store._store_kv_quant_kernel, dict(
                k_ptr=P, v_ptr=P, k_cache_ptr=pool, v_cache_ptr=pool, ks_ptr="*fp32", vs_ptr="*fp32",
                slot_ptr="*i64", stride_kt="i32", stride_vt="i32", NUM_KV_HEADS=C(8), HEAD_DIM=C(128),
                BLOCK_SIZE=C(16), BLOCK_H=C(8), BLOCK_D=C(128), QMAX=C(POOLS[pool])), 4, 3, False),
            (f"rotary + store_kv {name}", rotary._rotary_kernel, _rotary_args(pool), 4, 3, False),
        ]
    return cases


def weight_quant_cases() -> list[tuple]:
    """The W8A16 / W4A16 matmul (decode tiles and the prefill tile), the 1-row GEMV and the dequantize
    pass, group 128."""
    cases = []
    for bits, q in ((8, "*i8"), (4, "*u8")):
        args = dict(x_ptr=P, q_ptr=q, s_ptr=P, b_ptr=P, bias_ptr=P, out_ptr=P, M="i32", N="i32", K="i32",
                    stride_xm="i32", stride_qn="i32", stride_sn="i32", stride_om="i32", BITS=C(bits), GROUP=C(128),
                    HAS_BIAS=C(False), DOT_PRECISION=C("tf32"))
        cases += [(f"w{bits}a16 {c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']}", wq_matmul._wq_matmul_kernel,
                   {**args, "BLOCK_M": C(16), "BLOCK_N": C(c.kwargs["BLOCK_N"]), "BLOCK_K": C(c.kwargs["BLOCK_K"])},
                   c.num_warps, c.num_stages, True) for c in wq_matmul._decode_configs()]
        bm, bn, bk, warps, stages = 64, 128, 128, 4, 3  # a sweep's tile (benchmarks/quant_gpu.py)
        cases.append((f"w{bits}a16 64-row tile", wq_matmul._wq_matmul_kernel,
                      {**args, "BLOCK_M": C(bm), "BLOCK_N": C(bn), "BLOCK_K": C(bk)}, warps, stages, True))
        # the 1-row GEMV as a GPU runs it: scales and x by inline asm, which the interpreter never sees
        cases.append((f"gemv int{bits}, split", wq_matmul._wq_gemv_kernel, dict(
            x_ptr=P, q_ptr="*i32", s_ptr=P, b_ptr=P, bias_ptr=P, out_ptr=P, ws_ptr="*fp32", cnt_ptr="*i32", N="i32",
            K="i32", stride_xm="i32", stride_qn="i32", stride_sn="i32", stride_om="i32", SPLITS="i32", BITS=C(bits),
            GROUP=C(128), HAS_BIAS=C(False), M=C(1), BLOCK_N=C(256), BLOCK_KW=C(16), SPLIT=C(True), ASM=C(True),
            XVEC=C(True)), 4, 1, False))
        cases.append((f"dequantize int{bits}", wq_matmul._dequantize_kernel, dict(
            q_ptr=q, s_ptr=P, b_ptr=P, out_ptr=P, N="i32", K="i32", stride_qn="i32", stride_sn="i32",
            stride_on="i32", BITS=C(bits), GROUP=C(128), BLOCK_N=C(32), BLOCK_K=C(128)), 4, 3, False))
    return cases


# kernels that read their static inputs before griddepcontrol.wait
READS_BEFORE_WAIT = (rmsnorm._rms_norm_kernel, paged_attention._decode_kernel)


def main() -> int:
    assert not os.environ.get("TRITON_INTERPRET"), "unset TRITON_INTERPRET: the kernels must be compiled"
    cases = [
        ("decode, 1 split", paged_attention._decode_kernel, _decode_args(1), paged_attention.DECODE_NUM_WARPS,
         paged_attention.DECODE_NUM_STAGES, True),
        ("decode, 8 splits", paged_attention._decode_kernel, _decode_args(8, paged_attention.DECODE_NARROW[0]),
         *paged_attention.DECODE_NARROW[1:], True),
        ("decode merge", paged_attention._decode_merge_kernel, dict(
            part_o_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=P, stride_ob="i32", stride_oh="i32",
            NUM_HEADS=C(32), NUM_SPLITS=C(8), BLOCK_S=C(8), HEAD_DIM=C(128), BLOCK_D=C(128)), 4, 3, False),
        ("prefill, group 4", paged_attention._prefill_kernel, _prefill_args(4), *_prefill_launch(), True),
        ("prefill, group 7", paged_attention._prefill_kernel, _prefill_args(7), *_prefill_launch(), True),
        ("store_kv", kv_store._store_kv_kernel, dict(
            k_ptr=P, v_ptr=P, k_cache_ptr=P, v_cache_ptr=P, slot_ptr="*i64", stride_kt="i32", stride_vt="i32",
            ROW=C(1024), BLOCK=C(1024)), 4, 3, False),
        ("rms_norm + residual", rmsnorm._rms_norm_kernel, dict(
            x_ptr=P, res_ptr=P, w_ptr=P, out_ptr=P, res_out_ptr=P, stride_x="i32", stride_r="i32",
            stride_o="i32", stride_ro="i32", n_cols="i32", eps="fp32", HAS_RESIDUAL=C(True), BLOCK=C(4096)), 8, 3, False),
        *((label, rotary._rotary_kernel, _rotary_args(P, store), 4, 3, False)
          for label, store in (("rotary", False), ("rotary + store_kv", True))),
        *(("skinny matmul %dx%d" % (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]), skinny._skinny_matmul_kernel,
            dict(x_ptr=P, w_ptr=P, b_ptr=P, out_ptr=P, M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32",
                 stride_om="i32", HAS_BIAS=C(False), BLOCK_M=C(16), BLOCK_N=C(c.kwargs["BLOCK_N"]),
                 BLOCK_K=C(c.kwargs["BLOCK_K"]), DOT_PRECISION=C("tf32")), c.num_warps, c.num_stages, True)
          for c in skinny._configs()),
        *(("tiled matmul %dx%dx%d split %d" % cfg[:4], matmul._matmul_kernel, dict(
            x_ptr=P, w_ptr=P, b_ptr=P, out_ptr=P, part_ptr="*fp32", M="i32", N="i32", K="i32", k_per_split="i32",
            stride_xm="i32", stride_wn="i32", stride_om="i32", HAS_BIAS=C(False), EVEN_K=C(True),
            SPLIT_K=C(cfg[3]), BLOCK_M=C(cfg[0]), BLOCK_N=C(cfg[1]), BLOCK_K=C(cfg[2]), DOT_PRECISION=C("tf32"),
            UPCAST=C(False)), cfg[4], cfg[5], True) for cfg in ((128, 128, 64, 1, 8, 4), (64, 128, 128, 2, 4, 3))),
        ("split-K sum", matmul._split_k_sum_kernel, dict(
            part_ptr="*fp32", b_ptr=P, out_ptr=P, M="i32", N="i32", stride_om="i32", HAS_BIAS=C(False),
            SPLIT_K=C(2), BLOCK=C(matmul.REDUCE_BLOCK)), 4, 3, False),
        ("argmax", argmax._argmax_kernel, dict(
            x_ptr=P, out_ptr="*i64", key_ptr="*i64", ticket_ptr="*i32", stride_x="i32", n_cols="i32",
            BLOCK=C(argmax.ARGMAX_BLOCK), NUM_CHUNKS=C(63)), 4, 3, False),
        ("silu_and_mul", activation._silu_and_mul_kernel, dict(
            x_ptr=P, out_ptr=P, stride_x="i32", stride_o="i32", n_inter="i32", BLOCK=C(1024)), 4, 3, False),
        # before a tiled projection: the next kernel scheduled before the wait (kernels/_triton.py)
        ("silu_and_mul, early", activation._silu_and_mul_kernel, dict(
            x_ptr=P, out_ptr=P, stride_x="i32", stride_o="i32", n_inter="i32", BLOCK=C(1024), EARLY=C(True)), 4, 3,
         False),
        ("rms_norm, early", rmsnorm._rms_norm_kernel, dict(
            x_ptr=P, res_ptr=P, w_ptr=P, out_ptr=P, res_out_ptr=P, stride_x="i32", stride_r="i32",
            stride_o="i32", stride_ro="i32", n_cols="i32", eps="fp32", HAS_RESIDUAL=C(True), BLOCK=C(4096),
            EARLY=C(True)), 8, 3, False),
        ("decode merge, early", paged_attention._decode_merge_kernel, dict(
            part_o_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=P, stride_ob="i32", stride_oh="i32",
            NUM_HEADS=C(32), NUM_SPLITS=C(8), BLOCK_S=C(8), HEAD_DIM=C(128), BLOCK_D=C(128), EARLY=C(True)), 4, 3,
         False),
        ("decode, 1 split, early", paged_attention._decode_kernel, {**_decode_args(1), "EARLY": C(True)},
         paged_attention.DECODE_NUM_WARPS, paged_attention.DECODE_NUM_STAGES, True),
        *quantized_cases(),
        *weight_quant_cases(),
    ]
    failed = 0
    for label, fn, args, num_warps, num_stages, must_pipeline in cases:
        kernel = compile_kernel(fn, args, num_warps, num_stages)
        pipelined = "async_copy_global_to_local" in kernel.asm["ttgir"]
        ptx = kernel.asm["ptx"]
        waits = "griddepcontrol.wait" in ptx
        # EARLY: the next kernel scheduled before the wait, else after it (kernels/_triton.py's early_next)
        want = args.get("EARLY") is not None and args["EARLY"].value
        early = "griddepcontrol.launch_dependents" in ptx and (
            ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")) == want
        # what no kernel writes (a norm's weight; decode's context lengths, positions, cos/sin and
        # slots) is read before the wait, overlapping the kernel before (docs/BENCHMARKS.md)
        early_reads = "ld.global" in ptx[:ptx.index("griddepcontrol.wait")] if waits else False
        reads_ok = early_reads or fn not in READS_BEFORE_WAIT
        ok = (pipelined or not must_pipeline) and waits and early and reads_ok
        failed += not ok
        print(f"{'ok' if ok else 'FAIL':4} {label:26} shared={kernel.metadata.shared:6d} pipelined={pipelined} "
              f"waits_for_producer={waits} next_scheduled_as_asked={early} reads_before_wait={early_reads}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
