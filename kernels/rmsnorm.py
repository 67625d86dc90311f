"""Fused RMSNorm: optional residual add, the norm and the weight in one pass over each row."""

from __future__ import annotations

import torch

from kernels._triton import check_launchable, early_next, jit, next_power_of_2, pdl_launch, tl, wait_for_producer


@jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr = False,
):
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    # The weight is no kernel's output: asked for before the wait, so its read (from DRAM: a step's
    # weights stream through the L2 between two uses) overlaps the kernel before, not the
    # reduction's end (after the reduction's barrier it was a round trip of its own).
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    wait_for_producer(USE_PDL, EARLY)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # The sum is rounded to the residual stream's dtype before the norm, as the model does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    h = (xf * inv_rms).to(x.dtype)
    out = w.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # like x
    next_quantized: bool = False,  # a quantized projection reads the output (kernels/_triton.py's early_next)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * norm(x)``; with ``residual``, normalises ``x + residual`` and returns (out, x + residual)."""
    check_launchable(x, weight, *(() if residual is None else (residual,)))
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,) and weight.is_contiguous()
    x2 = x.reshape(-1, n_cols)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device)
    if residual is not None:
        assert residual.shape == x.shape
        r2 = residual.reshape(-1, n_cols)
        res_out = torch.empty(x2.shape, dtype=sum_dtype, device=x.device)
    else:
        r2 = res_out = x2  # unused
    assert x2.stride(-1) == 1 and r2.stride(-1) == 1
    if x2.shape[0]:
        block = next_power_of_2(n_cols)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 512, 1), 16),
            **pdl_launch(x.device), **early_next(next_quantized, x2.shape[0]),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))
