"""``x @ weight.T (+ bias)`` for decode batches of 64-256 rows: a tiled GEMM to race cuBLAS.

At these batch sizes a Llama-3.1-8B projection is still close to memory-bound: the weight
(32-235 MB in bf16) dwarfs x, so the kernel must read the weight from HBM once and keep enough
tiles in flight to cover 132 SMs. Each program owns a BLOCK_M x BLOCK_N output tile and walks
its share of K in pipelined tiles. Program ids run over M fastest, so the (at most a few) M
tiles that need one weight tile are scheduled side by side and all but the first find it in L2.

Where N gives too few tiles (o_proj: 4096 columns, 64-128 tiles on 132 SMs), SPLIT_K programs
share one tile's K range; each stores an fp32 partial and a second small kernel sums them.

Not on the engine's path: benchmarks/gemm_sweep.py raced CANDIDATES against cuBLAS on an H100
at 128-256 rows and cuBLAS won 10 of 12 cases (docs/BENCHMARKS.md); the kernel and the sweep
stay as the place to try faster tiles (TMA, warp specialisation) against it.
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, check_launchable, interpreting, jit, pdl_launch, tl, wait_for_producer

# (block_m, block_n, block_k, split_k, num_warps, num_stages), for the sweep on an H100 at M of
# 64-256 and N x K of 6144/4096/28672/4096 x 4096 and 4096 x 14336. BLOCK_M is 64 or more so the
# dot runs on wgmma (one warpgroup per 64 rows); the shared memory for the pipelined operands,
# (BM + BN) * BK * 2 bytes * stages, stays within the 227 KB a block may take.
CANDIDATES = [
    # one pass over K: 64-row tiles give 4 M tiles at M=256 and 96-448 N tiles at M=64
    (64, 64, 128, 1, 4, 4),
    (64, 64, 256, 1, 4, 3),
    (64, 128, 64, 1, 4, 4),
    (64, 128, 128, 1, 4, 3),
    (64, 128, 128, 1, 4, 4),
    (64, 128, 128, 1, 8, 3),
    (64, 256, 64, 1, 4, 4),
    (64, 256, 64, 1, 8, 3),
    (128, 64, 128, 1, 4, 4),
    (128, 128, 64, 1, 4, 4),
    (128, 128, 64, 1, 8, 4),
    (128, 128, 128, 1, 8, 3),
    (128, 256, 64, 1, 8, 3),  # the usual Hopper tile for large GEMMs (gate_up at M=256)
    (128, 256, 64, 1, 8, 4),
    (256, 128, 64, 1, 8, 3),  # all of M=256 in one tile: each weight tile is read by one program
    (256, 64, 64, 1, 8, 4),
    # split-K, for the 4096-column projections (o_proj, down) where tiles are fewer than SMs
    (64, 64, 128, 2, 4, 4),
    (64, 128, 128, 2, 4, 3),
    (128, 64, 128, 2, 4, 4),
    (128, 128, 64, 2, 8, 4),
    (128, 128, 128, 2, 8, 3),
    (64, 64, 128, 4, 4, 4),
    (64, 128, 128, 4, 4, 3),
    (128, 128, 64, 4, 8, 4),
    (128, 128, 128, 4, 8, 3),
]
# For the interpreter (CPU tests): small tiles, one program instance costs ~1 ms.
INTERPRETER_CONFIG = (16, 16, 16, 1, 4, 1)
REDUCE_BLOCK = 1024  # output elements per program of the split-K sum


@jit
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m_tiles  # M fastest: the programs sharing a weight tile run together
    pid_n = pid // num_m_tiles
    # This program's K range: k_per_split is a multiple of BLOCK_K, so a tile never crosses into
    # the next split's range and only K itself needs masking. A split past K stores zeros.
    k_start = tl.multiple_of(tl.program_id(1) * k_per_split, BLOCK_K)  # aligned: 16-byte loads, pipelined
    k_end = tl.minimum(k_start + k_per_split, K)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # partials [SPLIT_K, M, N], contiguous
        part_ptrs = (part_ptr + tl.program_id(1).to(tl.int64) * M * N
                     + offs_m[:, None].to(tl.int64) * N + offs_n[None, :])
        tl.store(part_ptrs, acc, mask=mask)


@jit
def _split_k_sum_kernel(
    part_ptr, b_ptr, out_ptr, M, N, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)  # the partials are the previous kernel's writes
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    part_ptrs = part_ptr + offs
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptrs, mask=mask, other=0.0)
        part_ptrs += M * N  # the next split's plane
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=mask)


def tiled_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    block_m: int, block_n: int, block_k: int, split_k: int = 1, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [M, K], weight [N, K] -> [M, N], any M >= 1."""
    check_launchable(x, weight, *(() if bias is None else (bias,)))
    num_rows, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.stride(1) == 1 and x.stride(1) == 1
    assert x.dtype == weight.dtype and (bias is None or (bias.shape == (n,) and bias.is_contiguous()))
    assert split_k >= 1
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    # Split K evenly in whole BLOCK_K tiles; with more splits than tiles the last ones are empty.
    k_per_split = cdiv(cdiv(k, block_k), split_k) * block_k
    even_k = k % block_k == 0
    if split_k > 1:
        part = torch.empty(split_k, num_rows, n, dtype=torch.float32, device=x.device)
    else:
        part = out  # unused
    b = weight if bias is None else bias  # a pointer the kernels never read without HAS_BIAS
    # Triton 3.6's interpreter keeps bf16 as uint16 and its tl.dot multiplies those integers;
    # there bf16 operands go to the dot as fp32 (their products are exact either way).
    upcast = interpreting() and x.dtype == torch.bfloat16
    pdl = pdl_launch(x.device)
    grid = (cdiv(num_rows, block_m) * cdiv(n, block_n), split_k)
    _matmul_kernel[grid](
        x, weight, b, out, part, num_rows, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=even_k, SPLIT_K=split_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    if split_k > 1:
        _split_k_sum_kernel[(cdiv(num_rows * n, REDUCE_BLOCK),)](
            part, b, out, num_rows, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=REDUCE_BLOCK, num_warps=4, **pdl,
        )
    return out

