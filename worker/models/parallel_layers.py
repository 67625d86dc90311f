"""Tensor-parallel linear and embedding layers (Megatron-style), each rank holding its shard.

    column-parallel (qkv, gate|up): each rank computes its own output columns, no communication
    row-parallel (o, down):         each rank multiplies its input slice, then one all-reduce
    vocab-parallel embedding:       each rank looks up its own rows, zeros elsewhere, one all-reduce
    vocab-parallel LM head:         each rank computes its vocab slice, one all-gather

Every parameter carries a ``weight_loader(param, full_tensor, shard_id)`` that copies this rank's
part of a full checkpoint tensor, so weights arrive one tensor at a time and a rank never holds
the whole model. At tensor parallel size 1 the layers are plain linear layers and embeddings.

Every projection goes through ``linear``: on a GPU, a few rows (decode at small batch) take the
Triton skinny matmul (kernels/skinny.py), which reads the weight near bandwidth where
cuBLAS's tiles leave SMs idle; everything else is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.reference import RmsHandoff
from worker.distributed.group import get_tp
from worker.distributed.partition import head_shard, split_evenly, vocab_shard
from worker.models.dense_packed import PackedDenseWeight
from worker.models.quantization import QuantizedLinearWeight, QuantSpec, make_weight


# Rows up to which a CUDA projection takes the skinny matmul (kernels.skinny.MAX_ROWS at most).
# Measured on an H100 (benchmarks/kernels_gpu.py --only-skinny, docs/BENCHMARKS.md): at 1 row it
# beats cuBLAS on every Llama-3.1-8B projection (o_proj 20.9 vs 23.2 us, LM head 351 vs 391 us);
# at 8 and 16 rows cuBLAS wins on qkv and o_proj, so those stay with cuBLAS.
SKINNY_MAX_ROWS = 1


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedLinearWeight | PackedDenseWeight,
           bias: torch.Tensor | None = None, rms: RmsHandoff | None = None) -> torch.Tensor:
    """x W^T + bias; ``rms``: x is a norm's handoff (QuantizedLinearWeight.matmul_norm), whose 1 /
    rms scales the sums before the bias."""
    if isinstance(weight, QuantizedLinearWeight):
        return weight.matmul(x, bias, rms)
    if rms is not None:
        return rms.apply(linear(x, weight), x.shape[-1], bias)
    if isinstance(weight, PackedDenseWeight):
        return weight.matmul(x, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.is_cuda and 0 < rows <= SKINNY_MAX_ROWS and x.dtype == weight.dtype:
        from kernels import HAS_TRITON, skinny_matmul

        if HAS_TRITON:
            out = skinny_matmul(x.reshape(rows, x.shape[-1]), weight, bias)
            return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """dst, src: float tensors or packed weights (kernels.wquant.QuantizedWeight) in any pairing."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
    if isinstance(dst, torch.Tensor) and not isinstance(src, torch.Tensor):
        src = src.dequantize(dst.dtype)  # a packed checkpoint tensor into a float parameter
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, full: torch.Tensor, shard_id: int | None = None) -> None:
    """Replicated parameters (norms): every rank holds all of it."""
    _copy_checked(param.data, full, "replicated weight")


def _full_rows(full: torch.Tensor, expected: int, what: str) -> None:
    if full.shape[0] != expected:
        raise ValueError(f"{what}: checkpoint has {full.shape[0]} rows, the model config says {expected}")


class QKVParallelLinear(nn.Module):
    """q|k|v in one matmul over this rank's query and KV heads (head_shard)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant: QuantSpec | None = None):
        super().__init__()
        tp = get_tp()
        self.shard = head_shard(num_heads, num_kv_heads, tp.size, tp.rank)
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        rows = (self.shard.q_count + 2 * self.shard.kv_count) * head_dim
        self.weight = make_weight(rows, hidden_size, quant)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self._load

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id: int) -> None:
        s, hd = self.shard, self.head_dim
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)[shard_id]
        _full_rows(full, heads * hd, ("q_proj", "k_proj", "v_proj")[shard_id])
        start, count = (s.q_start, s.q_count) if shard_id == 0 else (s.kv_start, s.kv_count)
        offset = (0, s.q_count, s.q_count + s.kv_count)[shard_id] * hd
        _copy_checked(param.data.narrow(0, offset, count * hd), full.narrow(0, start * hd, count * hd),
                      ("q_proj", "k_proj", "v_proj")[shard_id])

    def forward(self, x: torch.Tensor, rms: RmsHandoff | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, rms)


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel outputs (gate|up) in one matmul, each split evenly over ranks."""

    def __init__(self, in_features: int, out_sizes: list[int], quant: QuantSpec | None = None):
        super().__init__()
        tp = get_tp()
        self.out_sizes = out_sizes
        self.parts = [split_evenly(n, tp.size, tp.rank) for n in out_sizes]
        self.weight = make_weight(sum(c for _, c in self.parts), in_features, quant)
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id: int) -> None:
        _full_rows(full, self.out_sizes[shard_id], f"merged part {shard_id}")
        start, count = self.parts[shard_id]
        offset = sum(c for _, c in self.parts[:shard_id])
        _copy_checked(param.data.narrow(0, offset, count), full.narrow(0, start, count), f"merged part {shard_id}")

    def forward(self, x: torch.Tensor, rms: RmsHandoff | None = None) -> torch.Tensor:
        return linear(x, self.weight, rms=rms)


class RowParallelLinear(nn.Module):
    """Input columns [in_start, in_start + in_count) on this rank; partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, in_start: int, in_count: int,
                 quant: QuantSpec | None = None):
        super().__init__()
        self.in_features, self.in_start, self.in_count = in_features, in_start, in_count
        self.weight = make_weight(out_features, in_count, quant)
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id: int | None = None) -> None:
        if full.shape[1] != self.in_features:
            raise ValueError(f"row-parallel weight: checkpoint has {full.shape[1]} columns, expected {self.in_features}")
        _copy_checked(param.data, full.narrow(1, self.in_start, self.in_count), "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_tp().all_reduce(linear(x, self.weight))

    def project_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                     early_next: bool = False) -> tuple[torch.Tensor, torch.Tensor, RmsHandoff] | None:
        """``norm(self(x), residual)`` left to this projection's epilogue and the next projection
        (QuantizedLinearWeight.matmul_norm), or None (then the caller runs the two): at one tensor
        parallel rank only (the epilogue sees this rank's partial sums, not the all-reduced ones).
        ``early_next``: the next kernel may be scheduled early (kernels/wq_gluon.py's late_launch)."""
        if get_tp().size > 1 or not isinstance(self.weight, QuantizedLinearWeight):
            return None
        return self.weight.matmul_norm(x, residual, norm.weight, norm.eps, early_next=early_next)


class VocabParallelEmbedding(nn.Module):
    """``quant`` (int8): the rows packed, as a quantized LM head tied to this embedding has them."""

    def __init__(self, vocab_size: int, hidden_size: int, quant: QuantSpec | None = None):
        super().__init__()
        tp = get_tp()
        self.vocab_size = vocab_size
        self.start, self.count, padded = vocab_shard(vocab_size, tp.size, tp.rank)
        self.weight = (nn.Parameter(torch.zeros(padded, hidden_size), requires_grad=False) if quant is None
                       else make_weight(padded, hidden_size, quant))
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id: int | None = None) -> None:
        _full_rows(full, self.vocab_size, "vocabulary")
        _copy_checked(param.data.narrow(0, 0, self.count), full.narrow(0, self.start, self.count), "vocabulary")

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedLinearWeight):
            return self.weight.rows(ids)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp = get_tp()
        if tp.size == 1:
            return self._lookup(ids)
        mine = (ids >= self.start) & (ids < self.start + self.count)
        out = self._lookup(torch.where(mine, ids - self.start, 0))
        return tp.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of this rank's vocab slice, gathered so every rank ends with the full [n, vocab].
    Tied to the embedding, it shares that weight (the same rows of the same slice)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = get_tp().all_gather_last(linear(hidden, self.weight))
        return logits[..., : self.vocab_size]


# The layers whose ``weight`` goes through ``linear`` (worker/models/dense_packed.py packs them).
PROJECTIONS = (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, ParallelLMHead)
