"""Weight-only quantization in the model (``--quantization``): which projections are packed and
how (the plan), the weight such a projection holds in place of a float Parameter, and its matmul.

    plan (QuantSpec per projection)  ->  QuantizedLinearWeight buffers (kernels/wquant.py's layout)
      -> load: each full checkpoint tensor, float or packed, narrowed to this rank's shard and copied
      -> finalize: the device's form (CPU: torch's packed int4/int8 kernels' layout; sm_90, int4
         and int8 in groups of 128 or more: the Gluon kernel's tiles, kernels/wq_gluon.py)
      -> matmul: CUDA: the Triton W4A16/W8A16 kernel; CPU: torch's kernels; else dequantize + F.linear

The LM head is int8 whenever anything is quantized (llama.cpp's Q4_K_M keeps it at 6 bits: its
error lands on every logit). A tied embedding then looks its rows up in those packed rows.

On CPU the packed matmuls are PyTorch's own (``aten._weight_int4pack_mm_for_cpu``, which
torchao's int4 CPU layout also calls, and ``aten._weight_int8pack_mm``): they run bf16
activations (float32 ones take a scalar path ~15x slower, measured), so a quantized projection
rounds its input to bf16 and returns the model's dtype. ``_weight_int8pack_mm`` takes one scale
per output channel, so int8 on CPU is per channel; the int4 kernel takes groups of 32 to 256.
Those kernels multiply at one rate whatever the rows (~80 G multiply-adds/s on 2 AVX-512 cores):
right for decode, where the weight's bytes are the cost, 2.5-3x slower than oneDNN's bf16 GEMM for a
prefill chunk. From ``CPU_UNPACK_ROWS`` rows (256), where oneDNN has bf16, a projection is unpacked
to bf16 a slab of outputs at a time and multiplied by oneDNN (``_matmul_unpacked``): the packed
bytes stay the only copy (docs/BENCHMARKS.md, "Prefill on the CPU from packed weights").
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import HAS_TRITON
from kernels.reference import RmsHandoff, norm_handoff_ref
from kernels.wquant import QuantizedWeight, empty_quantized
from worker.models.dense_packed import PackedDenseWeight

if TYPE_CHECKING:
    from kernels.wq_gluon import TiledWeight

LM_HEAD = "lm_head"
CPU_INT4_GROUPS = (32, 64, 128, 256)
# rows from which a CPU projection is unpacked to bf16 for oneDNN. Measured on 2 AVX-512 cores,
# Qwen2.5-1.5B's projections (benchmarks/cpu_quant_rows.py), unpacked against packed: int4 0.63-0.66x
# at 512 rows, 0.90-0.92x at 256, 2.5x at 64; int8 0.26-0.46x at 256, 0.34-0.57x at 64. int8 pays
# from fewer rows, but a row's bits then depend on the rows beside it (oneDNN's blocking), and below
# 256 rows that would part a decode batch's or a speculative verification's tokens from a lone
# request's; a step of 256 rows holds a prefill chunk. KVCASCADE_CPU_UNPACK=0: never (the A/B)
CPU_UNPACK_ROWS = 256 if os.environ.get("KVCASCADE_CPU_UNPACK", "1") != "0" else 0
CPU_UNPACK_SLAB = 1024  # output rows unpacked at a time (a multiple of int4's blocks of 64): ~3 MB at 1,536 inputs


@functools.cache
def bf16_gemm() -> bool:
    """oneDNN multiplies bf16 natively on this CPU (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int  # preferred; ``layer_format`` fits it to a layer's input columns and device


@dataclass(frozen=True)
class QuantPlan:
    """A spec per projection (``model.layers.3.mlp.down_proj``, ``lm_head``); absent: dense."""

    default: QuantSpec | None = None
    per_layer: dict[str, QuantSpec] = field(default_factory=dict)

    def spec(self, name: str) -> QuantSpec | None:
        return self.per_layer.get(name, self.default)


def uniform_plan(bits: int, group_size: int) -> QuantPlan:
    """Every projection in ``bits``; the LM head int8."""
    return QuantPlan(QuantSpec(bits, group_size), {LM_HEAD: QuantSpec(8, group_size)})


def layer_format(spec: QuantSpec, in_features: int, device: torch.device | str) -> tuple[int, int]:
    """(bits, group size) of one projection on ``device``: the preferred group halved until it
    divides the inputs; int8 on CPU per output channel (torch's kernel's form)."""
    cpu = torch.device(device).type == "cpu"
    if cpu and spec.bits == 8:
        return 8, in_features
    group = spec.group_size
    while in_features % group and group > 16:
        group //= 2
    if in_features % group or (cpu and group not in CPU_INT4_GROUPS):
        raise ValueError(f"no int{spec.bits} group size fits a projection of {in_features} input columns "
                         f"(preferred {spec.group_size}); serve it with --quantization none")
    return spec.bits, group


class QuantizedLinearWeight(nn.Module):
    """What a quantized projection holds where a dense one has ``weight``: the packed buffers of
    kernels/wquant.py. ``.data`` is a QuantizedWeight over them (narrowed and ``copy_``'d by the
    layers' shard loaders as a dense weight is), ``finalize`` readies them for the device."""

    def __init__(self, out_features: int, in_features: int, spec: QuantSpec, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        device = torch.empty(0, device=device).device  # the construction context's device (torch.device(...) block)
        self.bits, self.group_size = layer_format(spec, in_features, device)
        w = empty_quantized(out_features, in_features, self.bits, self.group_size, dtype or torch.get_default_dtype(),
                            device)
        self.register_buffer("qweight", w.qweight)
        self.register_buffer("scales", w.scales)
        self.register_buffer("biases", w.biases)
        self.shape = (out_features, in_features)
        self._cpu: tuple[torch.Tensor, torch.Tensor] | None = None  # torch's CPU kernel's (weight, scales)
        self._tiles: TiledWeight | None = None  # the Gluon kernel's form (sm_90), after finalize

    @property
    def data(self) -> QuantizedWeight | TiledWeight:
        if self._tiles is not None:  # the natural nibbles are gone (finalize)
            return self._tiles
        return QuantizedWeight(self.qweight, self.scales, self.biases, self.bits, self.group_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def nbytes(self) -> int:
        if self._cpu is not None:
            return sum(t.numel() * t.element_size() for t in self._cpu)
        return self.data.nbytes()

    def finalize(self) -> None:
        """After loading: on CPU, build torch's packed form (the int4 one replaces the generic
        nibbles; int8's weight is the generic one, kept for embedding lookups); on a GPU, the form
        its kernels want (kernels/wq_matmul.prepare: on sm_90, int4 and int8 repacked into
        the Gluon kernel's tiles, which replace the natural nibbles), before the KV pool is sized."""
        if self.qweight.device.type != "cpu":
            if self.qweight.is_cuda and HAS_TRITON and self._tiles is None:
                from kernels.wq_matmul import prepare

                self.keep_tiles(prepare(self.data))
            return
        if self.bits == 8:
            self._cpu = (self.qweight, self.scales.squeeze(1).to(torch.bfloat16).contiguous())
            return
        from kernels.wquant import unpack_int4

        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(self.qweight).to(torch.int32), 2)
        # torch's form: w = (q - 8) * scale + zero, per group, [K // group, N, 2]
        zeros = self.biases + 8 * self.scales
        sz = torch.stack((self.scales, zeros), dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
        self._cpu = (packed, sz)
        self.qweight = torch.empty(0, dtype=torch.uint8)  # the nibbles live on in `packed` only
        self.scales = self.biases = torch.empty(0, dtype=self.scales.dtype)

    @property
    def tiled(self) -> bool:
        """In the Gluon kernel's tiled form (sm_90, after finalize)."""
        return self._tiles is not None

    def keep_tiles(self, tiles: TiledWeight | None) -> None:
        """The weight in the Gluon kernel's tiled form from now on, the natural buffers freed
        (none: kept as it is)."""
        if tiles is None:
            return
        self._tiles = tiles
        device = self.qweight.device
        self.qweight = torch.empty(0, dtype=torch.uint8, device=device)
        self.scales = self.biases = torch.empty(0, dtype=self.scales.dtype, device=device)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, rms: RmsHandoff | None = None) -> torch.Tensor:
        """x W^T + bias; ``rms``: x is ``matmul_norm``'s, and the sums are scaled by its norm's 1 / rms."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if rms is not None and not (x.is_cuda and HAS_TRITON):  # (wq_matmul takes it on the GPU)
            return rms.apply(self.matmul(x), k, bias)
        if self._cpu is not None:
            xb = x2.to(torch.bfloat16)
            if self.unpacks(xb.shape[0]):
                out = self._matmul_unpacked(xb)
            elif self.bits == 4:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self._cpu[0], self.group_size, self._cpu[1])
            else:
                out = torch.ops.aten._weight_int8pack_mm(xb, *self._cpu)
            out = out.to(x.dtype)
            if bias is not None:
                out = out + bias
        elif x.is_cuda:
            from kernels.wq_matmul import wq_matmul

            out = (wq_matmul(x2.contiguous(), self.data, bias, rms=rms) if HAS_TRITON
                   else F.linear(x2, self.data.dequantize(x.dtype), bias))  # (no tiles without Triton)
        else:
            out = F.linear(x2, self.data.dequantize(x.dtype), bias)
        return out.view(*lead, self.shape[0])

    def unpacks(self, rows: int) -> bool:
        """Whether a CPU matmul of ``rows`` rows goes through ``_matmul_unpacked`` (module docstring)."""
        return (self._cpu is not None and 0 < CPU_UNPACK_ROWS <= rows
                and (self.bits == 8 or self.shape[0] % 64 == 0) and bf16_gemm())

    def _matmul_unpacked(self, xb: torch.Tensor) -> torch.Tensor:
        """x W^T for bf16 rows ``xb``, W unpacked from torch's CPU form to bf16 ``CPU_UNPACK_SLAB``
        output rows at a time, each slab multiplied by ``F.linear`` (oneDNN)."""
        n, k = self.shape
        packed, scales = self._cpu
        out = torch.empty(xb.shape[0], n, dtype=torch.bfloat16)
        for start in range(0, n, CPU_UNPACK_SLAB):
            end = min(start + CPU_UNPACK_SLAB, n)
            if self.bits == 8:  # [N, K] int8, one scale an output: the scale applied to the sums
                out[:, start:end] = F.linear(xb, packed[start:end].to(torch.bfloat16)) * scales[start:end]
                continue
            # torch's int4 form: [N / 64, K, 32] bytes, a byte's low nibble an output of the block's
            # first 32, its high nibble the same one of the last 32; [K / group, N, 2] (scale, zero
            # point) with w = (q - 8) * scale + zero
            blocks = packed.view(n // 64, k, 32)[start // 64:end // 64]
            q = torch.cat((blocks & 15, blocks >> 4), dim=2).permute(0, 2, 1).reshape(end - start, -1, self.group_size)
            scale, zero = (scales[:, start:end, i].t().contiguous().unsqueeze(-1) for i in (0, 1))
            w = torch.addcmul(zero - 8 * scale, q.to(torch.bfloat16), scale).view(end - start, k)
            out[:, start:end] = F.linear(xb, w)
        return out

    def matmul_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    early_next: bool = False) -> tuple[torch.Tensor, torch.Tensor, RmsHandoff] | None:
        """``rms_norm(self.matmul(x), norm_weight, eps, residual)`` for one row of x, the norm left
        to this projection's epilogue and the next projection (kernels/wq_matmul.py's wq_matmul_norm):
        (the next projection's x, the new residual, the handoff its ``matmul`` takes as ``rms``), or
        None where the Gluon kernel does not take it. On the CPU the same contract in torch
        (kernels/reference.py's norm_handoff_ref): no faster there, it lets the model's wiring be
        tested where there is no GPU. ``early_next``: wq_matmul_norm's (the GPU's launch order only)."""
        if x.is_cuda:
            if not HAS_TRITON:
                return None
            from kernels.wq_matmul import wq_matmul_norm

            return wq_matmul_norm(x.reshape(-1, x.shape[-1]).contiguous(), self.data, residual, norm_weight, eps,
                                  early_next=early_next)
        if x.numel() != x.shape[-1]:
            return None
        return norm_handoff_ref(self.matmul(x), residual, norm_weight, eps)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows from an int8 weight (a tied LM head's)."""
        assert self.bits == 8, "embedding lookups read int8 rows"
        return self.data.rows(ids, self.dtype)


def make_weight(out_features: int, in_features: int, spec: QuantSpec | None) -> nn.Parameter | QuantizedLinearWeight:
    """A projection's weight: a float Parameter (filled by loading), or packed buffers."""
    if spec is None:
        return nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
    return QuantizedLinearWeight(out_features, in_features, spec)


def finalize_quantized(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, QuantizedLinearWeight):
            module.finalize()


def tiled(projection: nn.Module) -> bool:
    """Whether ``projection`` (a linear layer) runs the Gluon kernel: its weight tiled at finalize."""
    weight = getattr(projection, "weight", None)
    return isinstance(weight, QuantizedLinearWeight) and weight.tiled


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as they sit on the device, packed ones as packed."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, (QuantizedLinearWeight, PackedDenseWeight)) and id(module) not in seen:
            seen.add(id(module))
            total += module.nbytes()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",)}


def checkpoint_plan(formats: dict[str, tuple[int, int] | None], num_layers: int, tied: bool) -> QuantPlan | None:
    """``--quantization auto``: each projection as its checkpoint stores it, given each HF weight
    name's exact repacking (bits, group) or None. A fused projection takes its widest part (Q4_K_M
    stores v_proj at 6 bits beside 4-bit q and k: qkv becomes int8) and its smallest group; one
    float part keeps it float. None: nothing in the checkpoint is quantized."""
    per_layer: dict[str, QuantSpec | None] = {}
    for i in range(num_layers):
        for fused, parts in _FUSED.items():
            found = [formats.get(f"model.layers.{i}.{p}.weight") for p in parts]
            per_layer[f"model.layers.{i}.{fused}"] = (
                None if None in found else QuantSpec(max(b for b, _ in found), min(g for _, g in found)))
    head = formats.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    per_layer[LM_HEAD] = None if head is None else QuantSpec(8, head[1])
    if all(s is None for s in per_layer.values()):
        return None
    return QuantPlan(None, per_layer)


def _warn_if_regrouped(source, group_size: int) -> None:
    """``--quantization int4`` over a checkpoint already 4-bit in finer groups (a GGUF's Q4 types,
    GPTQ, AWQ): logs what rounding it again costs and the two ways out."""
    from worker.models.loader import checkpoint_quantization, gguf_formats

    if source.kind == "gguf":
        groups = {f[1] for f in gguf_formats(source.path).values() if f is not None and f[0] == 4}
    else:  # GPTQ / AWQ: (method, group), every projection 4-bit
        packed = checkpoint_quantization(source)
        groups = set() if packed is None else {packed[1]}
    finer = sorted(g for g in groups if g < group_size)
    if finer:
        logging.getLogger(__name__).warning(
            "--quantization int4 rounds this checkpoint's 4-bit weights (groups of %s) again, onto groups "
            "of %d: they land between the two grids (the Qwen2.5-Coder-1.5B's Q4_K_M: perplexity +53%%). "
            "--quantization auto serves them as they ship; --quantization-group-size %d keeps their grid",
            "/".join(map(str, finer)), group_size, finer[0])


def quant_plan(mode: str, group_size: int, source, num_layers: int, tied: bool) -> QuantPlan | None:
    """The plan ``--quantization mode`` makes for a model ``source`` (contracts.models.ModelSource);
    ``auto`` on a float checkpoint (or dummy weights) is None: served as it is."""
    if mode == "none":
        return None
    from worker.models.loader import checkpoint_quantization, gguf_formats

    if mode in ("int8", "int4"):
        if mode == "int4":
            _warn_if_regrouped(source, group_size)
        return uniform_plan(int(mode[3:]), group_size)

    if source.kind == "gguf":
        return checkpoint_plan(gguf_formats(source.path), num_layers, tied)
    packed = checkpoint_quantization(source)  # GPTQ / AWQ: every projection int4 in the checkpoint's groups
    return None if packed is None else uniform_plan(4, packed[1])
