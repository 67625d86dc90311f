"""Dense bf16 CPU projections held packed for oneDNN (worker/models/dense_packed.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import PROMPTS
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models.dense_packed import PackedDenseWeight, packable
from worker.models.quantization import weight_bytes

pytestmark = pytest.mark.skipif(not packable(torch.zeros(1, 1, dtype=torch.bfloat16)),
                                reason="no oneDNN bf16 on this CPU")


@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (8960, 1536), (1536, 8960)])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(shape):
    """Up to 11 rows a call (a batch-1 verification of up to 10 drafts), on SmolLM2's and
    Qwen2.5-1.5B's projection shapes; and the product is F.linear's within bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=gen) * shape[1] ** -0.5).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16()
    packed = PackedDenseWeight(weight)
    x = torch.randn(11, shape[1], generator=gen).bfloat16()
    alone = torch.cat([packed.matmul(x[i:i + 1], bias) for i in range(11)])
    for rows in range(2, 12):
        assert torch.equal(packed.matmul(x[:rows], bias), alone[:rows]), rows
    ref = F.linear(x.float(), weight.float(), bias.float())
    assert (alone.float() - ref).norm() / ref.norm() < 1e-2
    assert packed.matmul(x.view(1, 11, -1), bias).shape == (1, 11, shape[0])  # leading dims kept


def test_a_bf16_cpu_model_holds_its_projections_packed(smollm2, monkeypatch):
    """Every projection and the tied LM head packed (the embedding keeps its plain rows), the
    bytes counted, and the logits those of the plain bf16 weights within rounding; the switch
    ``KVCASCADE_CPU_PACK=0`` keeps the plain weights, and float32 is never packed."""
    engine = LLMEngine(EngineConfig(model="smollm2-135m", quantization="none", dtype="bfloat16"),
                       tokenizer=smollm2.tokenizer)
    monkeypatch.setenv("KVCASCADE_CPU_PACK", "0")
    plain = LLMEngine(EngineConfig(model="smollm2-135m", quantization="none", dtype="bfloat16"),
                      tokenizer=smollm2.tokenizer)
    model, layer = engine.model, engine.model.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                 model.lm_head):
        assert isinstance(proj.weight, PackedDenseWeight)
    assert isinstance(model.model.embed_tokens.weight, torch.nn.Parameter)  # tied: looked up plainly
    assert not isinstance(plain.model.lm_head.weight, PackedDenseWeight)
    assert not isinstance(smollm2.model.lm_head.weight, PackedDenseWeight)  # float32
    # The tied head's packed copy is counted beside the embedding it was tied to.
    head = model.lm_head.weight.nbytes()
    assert weight_bytes(model) == weight_bytes(plain.model) + head
    prompt = smollm2.tokenize(prompt=PROMPTS[0])
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    got, ref = ([e.logprob for e in prompt_logprobs(e, prompt, params)] for e in (engine, plain))
    assert len(got) == len(prompt) - 1
    assert max(abs(a - b) for a, b in zip(got, ref)) < 0.25  # bf16 either way; rounding, not a wrong weight
    for e in (engine, plain):
        e.close()


def test_bf16_greedy_speculation_emits_the_plain_runs_tokens(smollm2):
    """With the projections packed, an n-gram verification's rows get a lone decode's bits, so
    greedy speculation in bf16 gives the plain run's tokens: one request at a time, and all at once."""
    plain = LLMEngine(EngineConfig(model="smollm2-135m", quantization="none", dtype="bfloat16"),
                      tokenizer=smollm2.tokenizer)
    spec = LLMEngine(EngineConfig(model="smollm2-135m", quantization="none", dtype="bfloat16", speculative="ngram",
                                  num_speculative_tokens=6), tokenizer=smollm2.tokenizer, model=plain.model)
    prompts = [plain.tokenize(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = [plain.generate([p], params)[0] for p in prompts]
    assert [spec.generate([p], params)[0] for p in prompts] == expected
    assert spec.generate(prompts, params) == plain.generate(prompts, params)
    assert spec.spec_stats.accepted > 0
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks
    for engine in (plain, spec):
        engine.close()


def prompt_logprobs(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list:
    rid = engine.add_request(prompt, params)
    entries = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.prompt_logprobs is not None:
                entries = out.prompt_logprobs
    return entries
