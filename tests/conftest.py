"""Shared fixtures: the bundled SmolLM2 loaded once per session, engines built around it."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# CI has no GPU: Triton kernels run in its interpreter (set before anything imports triton).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine

# Ten prompts of mixed lengths, as chat messages (the worker applies the chat template).
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about cats.",
    "hi",
    "List three primary colors.",
    "Explain in one sentence why the sky is blue.",
    "What is 12 plus 30?",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle and say why you chose it, in detail, with a short story about "
    "the turtle's first day at its new home near the lake behind the old mill.",
    "Who wrote Romeo and Juliet?",
    "def fibonacci(n):",
]


@pytest.fixture(scope="session")
def smollm2() -> LLMEngine:
    """The GGUF's weights dequantized to float32 (``quantization="none"``), the weights
    transformers loads for the reference; other engines share its loaded model and tokenizer."""
    return LLMEngine(EngineConfig(model="smollm2-135m", quantization="none"))


@pytest.fixture
def make_engine(smollm2):
    def make(**overrides) -> LLMEngine:
        return LLMEngine(EngineConfig(**{"model": "smollm2-135m", "quantization": "none", **overrides}),
                         tokenizer=smollm2.tokenizer, model=smollm2.model)

    return make


@pytest.fixture(scope="session")
def prompt_ids(smollm2) -> list[list[int]]:
    ids = [smollm2.tokenize(messages=[{"role": "user", "content": p}]) for p in PROMPTS[:-1]]
    ids.append(smollm2.tokenize(prompt=PROMPTS[-1]))  # one raw completion prompt too
    return ids


MAX_NEW = 16


@pytest.fixture(scope="session")
def hf_reference(smollm2, prompt_ids) -> list[list[int]]:
    """Greedy continuations from Hugging Face transformers on the same GGUF weights."""
    from transformers import AutoModelForCausalLM

    from contracts.models import resolve_model

    src = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32)
    refs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            # An explicit mask: the prompt holds <|im_end|>, which is also the pad id, and without
            # a mask transformers would treat those tokens as padding.
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=smollm2.tokenizer.pad_token_id)
            refs.append(out[0, len(ids):].tolist())
    del hf
    return refs
