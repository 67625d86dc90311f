"""The Llama family (SmolLM2, Llama 3.x, Qwen2/2.5 with qkv bias, Mistral) on our paged attention.

Projections are fused (q|k|v into one matmul, gate|up into another); ``load_weights`` takes
Hugging Face parameter names and stacks the pieces, so every weight source maps onto HF names.
Under tensor parallelism (worker/distributed) each rank builds the same model over its own heads,
MLP columns and vocab slice (parallel_layers.py); nothing else in the model changes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from kernels.reference import RmsHandoff
from worker.models.attention import get_forward_context
from worker.models.config import ModelConfig
from worker.models.dense_packed import pack_dense_projections
from worker.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from worker.models.quantization import LM_HEAD, QuantizedLinearWeight, QuantPlan, finalize_quantized, tiled
from worker.models.parallel_layers import (PROJECTIONS, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                           RowParallelLinear, VocabParallelEmbedding, default_weight_loader)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, quant: QuantPlan):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias,
                                          quant.spec(f"{prefix}.qkv_proj"))
        shard = self.qkv_proj.shard  # this rank's heads: all of them at tensor parallel size 1
        self.num_heads, self.num_kv_heads = shard.q_count, shard.kv_count
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        shard.q_start * cfg.head_dim, self.q_size, quant.spec(f"{prefix}.o_proj"))
        self.rotary = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.scale = self.head_dim**-0.5
        self.next_quantized = False  # o_proj is quantized (LlamaForCausalLM.mark_next_quantized)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, x))

    def attend(self, positions: torch.Tensor, x: torch.Tensor, rms: RmsHandoff | None = None) -> torch.Tensor:
        """The attention's output, o_proj's input [T, q_size]; ``rms``: x is a norm's handoff (qkv_proj's)."""
        q, k, v = self.qkv_proj(x, rms).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        meta = get_forward_context()
        kv = meta.kv_caches[self.layer_idx]
        o = meta.backend.forward(q, k, v, kv.k, kv.v, meta, self.scale, rope=(positions, self.rotary),
                                 kv_scales=kv.scales, next_quantized=self.next_quantized)
        return o.reshape(-1, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, quant: QuantPlan):
        super().__init__()
        prefix = f"model.layers.{layer_idx}.mlp"
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       quant.spec(f"{prefix}.gate_up_proj"))
        start, count = self.gate_up_proj.parts[0]
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, start, count,
                                           quant.spec(f"{prefix}.down_proj"))
        self.act = SiluAndMul()
        self.fused_act = False  # gate_up is tiled: its kernel may apply the SiLU too (mark_next_quantized)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(x))

    def activation(self, x: torch.Tensor, rms: RmsHandoff | None = None) -> torch.Tensor:
        """silu(gate) * up, down_proj's input; ``rms``: x is a norm's handoff (gate_up_proj's)."""
        if self.fused_act:
            act = _gate_up_silu(self.gate_up_proj, x, rms)
            if act is not None:
                return act
        return self.act(self.gate_up_proj(x, rms))


def _gate_up_silu(gate_up: MergedColumnParallelLinear, x: torch.Tensor,
                  rms: RmsHandoff | None = None) -> torch.Tensor | None:
    """silu(gate) * up from a tiled gate|up projection in one launch (kernels/wq_matmul.py's
    wq_matmul_silu: the SiLU in the Gluon kernel's epilogue), or None where that kernel does not
    take the call. A rank's gate|up holds its own halves of both, so tensor parallelism changes nothing.
    At one row down_proj is scheduled right after this kernel's wait (``early_next``): its first
    weight stages then stream under gate_up's tail (kernels/wq_gluon.py's late_launch)."""
    from kernels.wq_matmul import wq_matmul_silu

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    act = wq_matmul_silu(x2, gate_up.weight.data, rms=rms, early_next=True)
    return None if act is None else act.view(*x.shape[:-1], act.shape[-1])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, quant: QuantPlan):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, quant)
        self.mlp = LlamaMLP(cfg, layer_idx, quant)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # at one row, o_proj and down_proj take the norms after them into their epilogues, the
        # projections after those their 1 / rms (RowParallelLinear.project_norm; mark_next_quantized)
        self.norm_handoff = False

    def forward(self, positions, x, residual, rms: RmsHandoff | None = None, next_norm: RMSNorm | None = None):
        """-> (x, residual, rms): the MLP's output and the residual, or, where down_proj took
        ``next_norm`` (the next layer's input norm) into its epilogue, that norm's handoff: x its
        part done, ``rms`` the rest (the next layer's qkv_proj applies it). ``rms`` given: x is this
        layer's input norm's handoff so (``residual`` already the sum)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        elif rms is None:
            x, residual = self.input_layernorm(x, residual)
        handoff = self.norm_handoff and x.numel() == x.shape[-1]  # one row
        o = self.self_attn.attend(positions, x, rms)
        # o_proj schedules gate_up early (its weights stream from its start), down_proj leaves the
        # next qkv_proj late (kernels/wq_gluon.py's late_launch: each measured so)
        fused = (self.self_attn.o_proj.project_norm(o, residual, self.post_attention_layernorm, early_next=True)
                 if handoff else None)
        if fused is None:
            x, residual = self.post_attention_layernorm(self.self_attn.o_proj(o), residual)
            rms = None
        else:
            x, residual, rms = fused
        act = self.mlp.activation(x, rms)
        fused = self.mlp.down_proj.project_norm(act, residual, next_norm) if handoff and next_norm else None
        return (self.mlp.down_proj(act), residual, None) if fused is None else fused


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantPlan):
        super().__init__()
        # A tied embedding shares the LM head's weight, packed if the head is.
        tied_quant = quant.spec(LM_HEAD) if cfg.tie_word_embeddings else None
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tied_quant)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i, quant) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = rms = None
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
            x, residual, rms = layer(positions, x, residual, rms, next_norm)
        x, _ = self.norm(x, residual)
        return x


# HF name fragment -> (our fused parameter, which shard of it)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantPlan | None = None):
        """``quant``: which projections are packed (worker/models/quantization.py); None: all float."""
        super().__init__()
        quant = quant or QuantPlan()
        self.config = cfg
        self.model = LlamaModel(cfg, quant)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant.spec(LM_HEAD))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of every new token; ``compute_logits`` takes the rows to sample."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, vocab] on every rank (the LM head gathers its vocab slices)."""
        return self.lm_head(hidden)

    @property
    def kv_heads(self) -> int:
        """KV heads this rank stores per layer: its share of the KV pool."""
        return self.model.layers[0].self_attn.num_kv_heads

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors, one at a time, each parameter keeping its rank's part;
        fails loudly on a missing or unexpected one. A tensor may come packed (a quantized
        checkpoint's kernels.wquant.QuantizedWeight); a packed projection takes float ones too."""
        params = self._weight_slots()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for piece, (fused, idx) in _STACKED.items():
                if f".{piece}." in name:
                    target, shard = name.replace(piece, fused), idx
                    break
            if target not in params:
                raise KeyError(f"unexpected weight {name!r} for this model")
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            loaded.add(target if shard is None else f"{target}#{shard}")
        missing = self.expected_weights() - loaded
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {sorted(missing)[:8]}")
        finalize_quantized(self)
        pack_dense_projections(m for m in self.modules() if isinstance(m, PROJECTIONS))
        self.mark_next_quantized()

    def mark_next_quantized(self) -> None:
        """Tell each small kernel that feeds a projection in the Gluon kernel's tiled form so (the
        norms, the attention, the SiLU): it then lets that projection start two kernels ahead
        (kernels/_triton.py's early_next); each MLP whose gate|up is tiled that its kernel
        may apply the SiLU (LlamaMLP.fused_act); and each layer whose projections are all tiled
        that at one row its norms go into them (LlamaDecoderLayer.norm_handoff)."""
        for layer in self.model.layers:
            layer.input_layernorm.next_quantized = tiled(layer.self_attn.qkv_proj)
            layer.self_attn.next_quantized = tiled(layer.self_attn.o_proj)
            layer.post_attention_layernorm.next_quantized = tiled(layer.mlp.gate_up_proj)
            layer.mlp.act.next_quantized = tiled(layer.mlp.down_proj)
            layer.mlp.fused_act = tiled(layer.mlp.gate_up_proj)
            layer.norm_handoff = all(tiled(p) for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                        layer.mlp.gate_up_proj, layer.mlp.down_proj))
        self.model.norm.next_quantized = tiled(self.lm_head)

    def _weight_slots(self) -> dict[str, nn.Parameter | QuantizedLinearWeight]:
        """Every weight by name: Parameters, and packed projections' weights."""
        slots: dict = dict(self.named_parameters())
        slots.update((n, m) for n, m in self.named_modules() if isinstance(m, QuantizedLinearWeight))
        return slots

    def expected_weights(self) -> set[str]:
        """Our parameter names, a fused one once per HF piece (``qkv_proj.weight#1`` is k_proj)."""
        pieces = {"qkv_proj": 3, "gate_up_proj": 2}
        expected = set()
        for pname in self._weight_slots():
            fused = pname.split(".")[-2] if pname.count(".") >= 2 else ""
            if fused in pieces:
                expected.update(f"{pname}#{i}" for i in range(pieces[fused]))
            else:
                expected.add(pname)
        return expected
