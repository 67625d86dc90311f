"""``x @ weight.T (+ bias)`` for a few rows of x: the decode step's projections at small batch.

At batch 1 a projection is a matrix-vector product, bound by reading the weight once. cuBLAS
picks tiles 64 output columns wide for these shapes, so a 4096-column projection (Llama's
o_proj) runs 64 programs on a 132-SM H100 and reads its weight at ~55% of bandwidth. Here a
program owns BLOCK_N (16-64) output columns for all rows of x and walks K in pipelined tiles,
so even 4096 columns give 64-256 programs, each with several tiles in flight; the tile shape is
tuned per (N, K) on the device at first use (before CUDA-graph capture, in the warm-up).
"""

from __future__ import annotations

import torch

from kernels._triton import check_launchable, interpreting, jit, pdl_launch, tl, triton, wait_for_producer

MAX_ROWS = 16  # tl.dot's smallest tile; above this the GEMM is cuBLAS's business
# For the interpreter (CPU tests), which cannot autotune: one small config.
INTERPRETER_CONFIG = dict(BLOCK_N=16, BLOCK_K=32)


@jit
def _skinny_matmul_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _configs() -> list:
    shapes = [(16, 256, 4), (16, 512, 3), (32, 128, 4), (32, 256, 4), (32, 512, 3), (64, 128, 4), (64, 256, 3)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=4, num_stages=s) for n, k, s in shapes]


# Tuned per (N, K) at its first call for that shape (the choice kept in Triton's cache folder for
# the next start); None without Triton.
_tuned = (triton.autotune(configs=_configs(), key=["N", "K", "HAS_BIAS"], cache_results=True)(_skinny_matmul_kernel)
          if triton else None)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 1 to MAX_ROWS rows: x [M, K], weight [N, K] -> [M, N]."""
    check_launchable(x, weight, *(() if bias is None else (bias,)))
    num_rows, k = x.shape
    n = weight.shape[0]
    assert 0 < num_rows <= MAX_ROWS, f"skinny_matmul takes 1 to {MAX_ROWS} rows, got {num_rows}"
    assert weight.shape == (n, k) and weight.stride(1) == 1 and x.stride(1) == 1
    assert x.dtype == weight.dtype and (bias is None or (bias.shape == (n,) and bias.is_contiguous()))
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    args = (x, weight, weight if bias is None else bias, out, num_rows, n, k, x.stride(0), weight.stride(0),
            out.stride(0))
    opts = dict(HAS_BIAS=bias is not None, BLOCK_M=16,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **pdl_launch(x.device))
    if interpreting():
        cfg = INTERPRETER_CONFIG
        _skinny_matmul_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](*args, **opts, **cfg)
    else:
        _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **opts)
    return out

