"""A model's tokenizer (transformers' fast tokenizers, with the chat template): what the router
tokenizes and hashes, and what a worker's front end tokenizes and detokenizes. No torch."""

from __future__ import annotations

import os
from pathlib import Path

from contracts.models import ModelSource, cache_dir, resolve_model


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
    cached = cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
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
