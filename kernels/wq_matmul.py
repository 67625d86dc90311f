"""``x @ W.T (+ bias)`` with W stored packed (kernels/wquant.py): W8A16 and W4A16 in one kernel.

Each program owns a BLOCK_M x BLOCK_N tile of the output and walks K: it loads BLOCK_N rows of
packed weight (BLOCK_K bytes for int8, BLOCK_K / 2 for int4), unpacks and scales them in
registers (q * s + b, a group's s and b shared by GROUP columns), and feeds the float tile to a
tensor-core dot with x's tile. The weight is read once and never written out dense.

Two regimes:
- decode, 1 to 16 rows (BLOCK_M 16): each packed weight read once, the tile tuned per (N, K,
  format) at first use (the engine's warm-up and CUDA-graph capture, before serving);
- more rows: the weight dequantized in one pass to a transient copy in x's dtype, then cuBLAS.
  Dequantizing in this kernel's main loop measured 2.5-3x cuBLAS's time at 512-2048 rows and 2-6x
  at 64 on an H200 (benchmarks/quant_gpu.py --sweep-prefill, docs/BENCHMARKS.md): the loop is
  bound by the unpacking instructions, not by bytes. The copy costs a write and a read of the
  dense weight per call, which caps what int4 saves on large batches.
"""

from __future__ import annotations

import torch

from kernels._triton import check_launchable, interpreting, jit, pdl_launch, tl, triton, wait_for_producer
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


@jit
def _dequantize_kernel(q_ptr, s_ptr, b_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_on,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of W = q * s (+ b), written in out's dtype."""
    wait_for_producer(USE_PDL)
    PACK: tl.constexpr = 2 if BITS == 4 else 1
    NG: tl.constexpr = BLOCK_K // GROUP
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_kq = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    n_mask = offs_n < N
    q = tl.load(q_ptr + offs_n[:, None].to(tl.int64) * stride_qn + offs_kq[None, :],
                mask=n_mask[:, None] & (offs_kq < K // PACK)[None, :], other=0)
    if BITS == 4:
        q = tl.interleave(q & 0x0F, q >> 4)
    offs_g = k0 // GROUP + tl.arange(0, NG)
    sg = offs_n[:, None].to(tl.int64) * stride_sn + offs_g[None, :]
    sg_mask = n_mask[:, None] & (offs_g < K // GROUP)[None, :]
    w = tl.reshape(q.to(tl.float32), [BLOCK_N, NG, GROUP]) * tl.load(s_ptr + sg, mask=sg_mask, other=0.0).to(
        tl.float32)[:, :, None]
    if BITS == 4:
        w += tl.load(b_ptr + sg, mask=sg_mask, other=0.0).to(tl.float32)[:, :, None]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :],
             tl.reshape(w, [BLOCK_N, BLOCK_K]).to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (offs_k < K)[None, :])


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``weight.dequantize(dtype)`` in one pass on the device: [N, K] in ``dtype``."""
    check_launchable(weight.qweight)
    n, k = weight.shape
    g = weight.group_size
    if g & (g - 1):  # a group of a whole row that is no power of two (per channel)
        return weight.dequantize(dtype)
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    block_n, block_k = 32, max(g, 128)  # whole groups in a tile
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight.qweight, weight.scales, weight.scales if weight.biases is None else weight.biases, out, n, k,
        weight.qweight.stride(0), weight.scales.stride(0), out.stride(0), BITS=weight.bits, GROUP=g,
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
                          prune_configs_by={"early_config_prune": _prune})(_wq_matmul_kernel) if triton else None)

def wq_matmul(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
              config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dequantize(x.dtype), bias)``: x [M, K] -> [M, N]. ``config``
    (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) overrides the choice (sweeps)."""
    check_launchable(x, weight.qweight)
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.qweight.stride(1) == 1
    assert weight.scales.stride(1) == 1 and (weight.biases is None or weight.biases.stride() == weight.scales.stride())
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    g = weight.group_size
    args = (x, weight.qweight, weight.scales, weight.scales if weight.biases is None else weight.biases,
            weight.scales if bias is None else bias, out, m, n, k, x.stride(0), weight.qweight.stride(0),
            weight.scales.stride(0), out.stride(0))
    opts = dict(BITS=weight.bits, GROUP=g, HAS_BIAS=bias is not None,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **pdl_launch(x.device))
    if m > DECODE_MAX_ROWS and config is None:
        # more rows: cuBLAS on a transient dense copy (module docstring)
        return torch.nn.functional.linear(x, dequantize(weight, x.dtype), bias)
    if config is not None:
        bm, bn, bk, warps, stages = config
        while not _fits(g, k, bk) and bk > 16:
            bk //= 2
        _wq_matmul_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
            *args, **opts, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    elif interpreting():
        cfg = dict(INTERPRETER_CONFIG)
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], g) if g % cfg["BLOCK_K"] else cfg["BLOCK_K"]
        _wq_matmul_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), 1)](*args, **opts, BLOCK_M=16, **cfg)
    else:
        _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), 1)](*args, **opts, BLOCK_M=16)
    return out
