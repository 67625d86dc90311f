"""The GPU attention path (Triton kernels behind the same interface) against the torch one, run
by the Triton interpreter on CPU at a tiny shape: same greedy tokens through prefix-cache hits,
chunked prefill and mixed decode + prefill steps. (The GPU run is benchmarks/gpu_check.py.)"""

from __future__ import annotations

import pytest

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

kernels = pytest.importorskip("kernels")
if not kernels.HAS_TRITON:
    pytest.skip("triton is not installed (it comes with the dev extra: pip install -e .[dev])",
                allow_module_level=True)


def test_triton_backend_matches_torch_backend():
    prompts = [list(range(1, 12)), [5, 6, 7], [9] * 20, list(range(1, 14)), [3]]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, detokenize=False)
    common = dict(model="dummy:tiny", num_kv_blocks=32, max_num_batched_tokens=24, block_size=4)
    ref_engine = LLMEngine(EngineConfig(**common, attention_backend="torch"))
    ref = ref_engine.generate(prompts, sp)
    fast_engine = LLMEngine(EngineConfig(**common, attention_backend="triton"), tokenizer=ref_engine.tokenizer,
                            model=ref_engine.model)
    mixed_steps = 0
    original = fast_engine.runner.run

    def spy(batch, *rest):
        nonlocal mixed_steps
        sizes = {s.num_new_tokens == 1 for s in batch}
        mixed_steps += sizes == {True, False}
        return original(batch, *rest)

    fast_engine.runner.run = spy
    assert fast_engine.generate(prompts, sp) == ref
    assert mixed_steps > 0, "no step mixed decodes with a prefill chunk"
    assert fast_engine.stats().prefix_hits > 0
    fast_engine.check_integrity()
