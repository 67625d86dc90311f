"""Each supported architecture against transformers, from a safetensors folder, and dummy loading."""

from __future__ import annotations

import pytest
import torch

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _hf_model(arch: str):
    import transformers as tf

    if arch == "llama3":
        cfg = tf.LlamaConfig(**SMALL, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        return tf.LlamaForCausalLM(cfg)
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, tie_word_embeddings=True))
    if arch == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=None))
    raise ValueError(arch)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "mistral"])
def test_safetensors_architectures_match_transformers(arch, tmp_path, smollm2):
    torch.manual_seed(0)
    hf = _hf_model(arch).eval()
    for p in hf.parameters():  # peaky logits, so greedy choices are far from ties
        p.data.normal_(0, 0.2) if p.dim() > 1 else None
    if arch == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias is not None
        for layer in hf.model.layers:
            layer.self_attn.q_proj.bias.data.normal_(0, 0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    smollm2.tokenizer.save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path)))
    assert engine.model_config.architecture == hf.config.model_type
    prompt = list(range(1000, 1100, 3)) + list(range(7, 90, 4))  # 55 tokens: past one rope octave
    with torch.no_grad():
        x = torch.tensor([prompt])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        ref_logits = hf(x).logits[0, -1].log_softmax(-1)
    [ours] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert ours == ref
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    first = engine.step()
    top = first[0].logprobs[0].top
    assert [t for t, _ in top] == ref_logits.topk(5).indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in top]), ref_logits.topk(5).values, atol=1e-4)


def test_dummy_weights_build_any_preset():
    engine = LLMEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=16))
    assert engine.model_id == "dummy:tiny"
    [out] = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out) == 4 and all(0 <= t < engine.model_config.vocab_size for t in out)


def test_unknown_model_is_refused_with_the_choices():
    from contracts.models import resolve_model

    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="tiny"):
        resolve_model("dummy:no-such-preset")
