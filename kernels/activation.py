"""SiLU-and-multiply, the gated MLP's activation: silu(gate) * up from one [T, 2I] projection."""

from __future__ import annotations

import torch

from kernels._triton import cdiv, check_launchable, early_next, jit, next_power_of_2, pdl_launch, tl, wait_for_producer

_BLOCK = 1024


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                         EARLY: tl.constexpr = False):
    wait_for_producer(USE_PDL, EARLY)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_inter
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + n_inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu is rounded to x's dtype before the product, as the torch math does.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, next_quantized: bool = False) -> torch.Tensor:
    """x: [T, 2I] (gate then up) -> [T, I]. ``next_quantized``: a quantized projection reads the
    output (kernels/_triton.py's early_next)."""
    check_launchable(x)
    num_tokens, two_i = x.shape
    assert two_i % 2 == 0 and x.stride(-1) == 1
    n_inter = two_i // 2
    out = torch.empty(num_tokens, n_inter, dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(next_power_of_2(n_inter), _BLOCK)
        _silu_and_mul_kernel[(num_tokens, cdiv(n_inter, block))](
            x, out, x.stride(0), out.stride(0), n_inter, BLOCK=block, num_warps=4, **pdl_launch(x.device),
            **early_next(next_quantized, num_tokens),
        )
    return out
