"""A model's tokenizer (transformers' fast tokenizers, with the chat template): what the router
tokenizes and hashes, and what a worker's front end tokenizes and detokenizes.

A tokenizer never needs torch, but transformers imports torch at its own import whenever it is
installed (a second and about 200 MB). A process that only tokenizes, the router, calls
``hide_torch`` first; the one step that does need torch, building a tokenizer from a GGUF file's
metadata, then runs in a child process that leaves the result in the on-disk cache.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from contracts.models import ModelSource, cache_dir, resolve_model

# A short prompt (up to this many characters: about 2,000 tokens, 1-2 ms of tokenizing) is tokenized
# on the event loop that received it while its process has fewer than INLINE_TOKENIZE_BELOW other
# requests in flight; otherwise in a thread (the tokenizer lets go of the GIL). At low load the thread's
# round trip costs more than the tokenizing: two wake-ups of threads that were asleep, 0.2-1 ms on
# an idle host, all of it on the request's time to first token. Under load, and for long prompts,
# the threads tokenize side by side while the loop relays the other streams (a burst of 256
# arrivals tokenized one after another on the loop would reach the engine later).
INLINE_TOKENIZE_CHARS = 8192
INLINE_TOKENIZE_BELOW = 4


def tokenize_inline(prompt: str | None, messages: list[dict] | None, in_flight: int) -> bool:
    """Whether to tokenize a prompt (text, or chat messages' contents) on the loop, its process
    having ``in_flight`` other requests under way."""
    if in_flight >= INLINE_TOKENIZE_BELOW:
        return False
    chars = len(prompt or "") + sum(len(str(m.get("content") or "")) for m in messages or ())
    return chars <= INLINE_TOKENIZE_CHARS


async def tokenize_prompt(tokenize: Callable[..., list[int]], prompt: str | None, messages: list[dict] | None,
                          in_flight: int, tools: list[dict] | None = None) -> list[int]:
    """``tokenize(prompt=..., messages=..., tools=...)`` on this event loop, or in a thread when the
    prompt is long or the process busy (``tokenize_inline``)."""
    kwargs = {"tools": tools} if tools else {}  # only when given: callers' tokenize may not take it
    if tokenize_inline(prompt, messages, in_flight):
        return tokenize(prompt=prompt, messages=messages, **kwargs)
    return await asyncio.to_thread(tokenize, prompt=prompt, messages=messages, **kwargs)


# One load at a time in a process: transformers resolves its lazy imports on first use, which is
# not thread-safe (two of serve's replicas starting at once failed "cannot import name
# 'AutoTokenizer'"). Re-entrant: a dummy model loads SmolLM2's tokenizer through here.
_LOADING = threading.RLock()


def load_tokenizer(src: ModelSource, tokenizer: str | None = None):
    """The HF tokenizer (with chat template) for a source; None for a dummy model without one.
    ``tokenizer`` (``--tokenizer``): a tokenizer folder, a tokenizer.json or a .gguf to take it
    from instead of the model's (so a ``dummy:`` model can serve text where no GGUF is installed)."""
    with _LOADING:
        return _load_tokenizer(src, tokenizer)


def _load_tokenizer(src: ModelSource, tokenizer: str | None):
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


def hide_torch() -> bool:
    """Make torch look absent to this process (sys.modules["torch"] = None: transformers then sees
    no torch and an ``import torch`` fails at once), for a process that only tokenizes. Only before
    transformers or torch is imported; True when torch is hidden."""
    if "torch" not in sys.modules and "transformers" not in sys.modules:
        sys.modules["torch"] = None
    return _torch_hidden()


def _torch_hidden() -> bool:
    return "torch" in sys.modules and sys.modules["torch"] is None


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
    if _torch_hidden():  # transformers' GGUF reader needs torch: a child process converts
        return AutoTokenizer.from_pretrained(str(_convert_in_child(path, cached)), clean_up_tokenization_spaces=False)
    tok = _build(path)
    _save(tok, cached)
    return tok


def _build(path: Path):
    """The tokenizer from a GGUF file's metadata (seconds, and transformers needs torch for it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, clean_up_tokenization_spaces=False)


def _save(tok, cached: Path) -> bool:
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached) if not cached.exists() else None
        return True
    except OSError:
        return False  # a read-only home is fine: just slower starts


def _convert_in_child(path: Path, cached: Path) -> Path:
    """Where a child process (torch visible) left the tokenizer built from ``path``: the cache, or a
    temporary folder when the cache cannot be written."""
    target = cached
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass
    if not os.access(cached.parent, os.W_OK):
        target = Path(tempfile.mkdtemp(prefix="kvcascade-tokenizer-")) / cached.name
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", "contracts.tokenizers", str(path), str(target)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return target


if __name__ == "__main__":  # python -m contracts.tokenizers GGUF TARGET: build and save (_convert_in_child)
    target = Path(sys.argv[2])
    built = _build(Path(sys.argv[1]))
    target.parent.mkdir(parents=True, exist_ok=True)
    if not _save(built, target):
        sys.exit(f"could not write the tokenizer to {target}")
