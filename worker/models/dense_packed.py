"""Dense bf16 projections on the CPU, held in oneDNN's packed layout.

``F.linear`` on a bf16 CPU weight hands it to oneDNN, which reorders the whole weight into its
blocked (AVX512-BF16 / AMX) layout on every call. Measured on a 2-core Xeon with AMX, Qwen2.5-1.5B's
gate_up (8960 x 1536, 27.5 MB): 0.85-0.97 ms at 1-16 rows, where reading the weight once takes
about 0.5 ms. Reordered once at load with PyTorch's own mkldnn ops (the ones Inductor's CPU
freezing uses), the same product takes 0.56-0.63 ms at any of 1-12 rows. That flat cost a row is
what speculative verification needs: k drafted rows cost about what one decode row does.

Each row's bits do not depend on how many rows share the call up to 11 rows on every projection
measured (tests/worker/test_dense_packed.py checks it), so a batch-1 greedy verification of up to
10 drafts gives the plain decode's tokens. oneDNN splits K across threads at some larger row
counts (12-23 rows of the 8960-deep down projection on 2 threads), which rounds differently there.
Where oneDNN has no AMX (an AMD EPYC with AVX512-BF16, 2026-11-29) its one-row kernel rounds
differently from the kernel of 2-24 rows, which agree among themselves on every row, on three of
SmolLM2's and Qwen2.5-1.5B's four projection shapes (the fp32 sums differ in their last bits, so
only some of a row's bf16 outputs show it, and not for every input: no cheap check at load sees it
reliably). Without AMX a lone row therefore runs as the first of two (``one_row_as_two``), at +0-20%
of a one-row call there (Qwen2.5-1.5B's gate_up 0.61 -> 0.73 ms, down 0.57 -> 0.57, SmolLM2's
head 2.28 -> 2.53).

``KVCASCADE_CPU_PACK=0`` keeps the plain weights (``F.linear``), for A/B runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn as nn


def packable(weight: object) -> bool:
    """A dense bf16 CPU weight that oneDNN can hold packed."""
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and os.environ.get("KVCASCADE_CPU_PACK", "1") != "0"
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedDenseWeight(nn.Module):
    """A [out, in] bf16 weight in oneDNN's blocked layout; ``matmul`` is ``F.linear`` without the
    per-call reorder. The plain tensor is not kept (a tied embedding keeps its own)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self._nbytes = weight.numel() * weight.element_size()
        # The batch-size hint only picks the reorder's blocking; 1 is what decode calls with.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.one_row_as_two = not torch.cpu._is_amx_tile_supported()  # module docstring

    def nbytes(self) -> int:
        return self._nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out_features, in_features = self.shape
        rows = x.numel() // in_features
        x2 = x.reshape(rows, in_features).to(self.dtype)
        if rows == 1 and self.one_row_as_two:
            x2 = x2.expand(2, in_features)
        out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, bias, "none", [], "")[:rows]
        return out.view(*x.shape[:-1], out_features).to(x.dtype)


def pack_dense_projections(projections: Iterable[nn.Module]) -> None:
    """Swap each projection's (a layer that calls ``linear`` on its ``weight``) dense bf16 CPU
    weight for its packed form; a tied LM head gets its own packed copy, the embedding keeps the
    plain rows."""
    for module in projections:
        if packable(module.weight):
            weight = module.weight
            del module.weight  # an nn.Parameter: unregister it before a module takes the name
            module.weight = PackedDenseWeight(weight)
