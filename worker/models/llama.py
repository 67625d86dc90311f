"""The Llama family (SmolLM2, Llama 3.x, Qwen2/2.5 with qkv bias, Mistral) on our paged attention.

Projections are fused (q|k|v into one matmul, gate|up into another); ``load_weights`` takes
Hugging Face parameter names and stacks the pieces, so every weight source maps onto HF names.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from worker.models.attention import get_forward_context
from worker.models.config import ModelConfig
from worker.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.scale = self.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        meta = get_forward_context()
        k_cache, v_cache = meta.kv_caches[self.layer_idx]
        o = meta.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of every new token; ``compute_logits`` takes the rows to sample."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; fails loudly on a missing or unexpected one."""
        params = dict(self.named_parameters())
        cfg = self.config
        shard_sizes = {
            "qkv_proj": [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim],
            "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            target, shard = name, None
            for piece, (fused, idx) in _STACKED.items():
                if f".{piece}." in name:
                    target, shard = name.replace(piece, fused), idx
                    break
            if target not in params:
                raise KeyError(f"unexpected weight {name!r} for this model")
            param = params[target]
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.copy_(tensor)
            else:
                sizes = shard_sizes[target.split(".")[-2]]
                start = sum(sizes[:shard])
                dst = param.narrow(0, start, sizes[shard])
                if dst.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
                dst.copy_(tensor)
                target = f"{target}#{shard}"
            loaded.add(target)
        expected = set()
        for pname in params:
            fused = pname.split(".")[-2] if pname.count(".") >= 2 else ""
            if fused in shard_sizes:
                expected.update(f"{pname}#{i}" for i in range(len(shard_sizes[fused])))
            else:
                expected.add(pname)
        if cfg.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = expected - loaded
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {sorted(missing)[:8]}")
