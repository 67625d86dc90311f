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
differently from the kernel of 2-24 rows, which agree among themselves on every row, at the
projections 1,536 or 8,960 deep, not at those 576 deep (benchmarks/dense_packed_rows.py). The fp32
sums differ in their last bits, so only ~1 bf16 output in 10^4 shows it: the first weight of each
shape compares 2 x 10^5 outputs of one-row calls with two-row calls at load (``_one_row_agrees``, a
few ms a shape), and where they differ a lone row runs as the first of two (``one_row_as_two``;
there +0-19% a one-row call, three runs: Qwen2.5-1.5B's gate_up 0.42-0.44 -> 0.47-0.51 ms, down
0.40-0.47 -> 0.43-0.49, SmolLM2's down 0.049 either way).

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
        self.one_row_as_two = False  # the check below calls matmul with the one-row kernel
        self.one_row_as_two = not _one_row_agrees(self)

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


_one_row_kernel_agrees: dict[tuple[int, int], bool] = {}  # by (out, in): oneDNN picks kernels by shape


def _one_row_agrees(weight: PackedDenseWeight, outputs: int = 200_000) -> bool:
    """Whether ``weight``'s shape gets the same bits from a one-row call as from a two-row one
    (module docstring): ~``outputs`` outputs compared, in pairs of rows, once a shape a process."""
    shape = weight.shape
    if shape not in _one_row_kernel_agrees:
        rows = min(512, 2 * -(-outputs // (2 * shape[0])))
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(rows)])
        pairs = torch.cat([weight.matmul(x[i:i + 2]) for i in range(0, rows, 2)])
        _one_row_kernel_agrees[shape] = torch.equal(alone, pairs)
    return _one_row_kernel_agrees[shape]


def pack_dense_projections(projections: Iterable[nn.Module]) -> None:
    """Swap each projection's (a layer that calls ``linear`` on its ``weight``) dense bf16 CPU
    weight for its packed form; a tied LM head gets its own packed copy, the embedding keeps the
    plain rows."""
    for module in projections:
        if packable(module.weight):
            weight = module.weight
            del module.weight  # an nn.Parameter: unregister it before a module takes the name
            module.weight = PackedDenseWeight(weight)
