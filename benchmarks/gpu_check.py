"""GPU correctness of the engine's fast path: the Triton backend, fused kernels and CUDA graphs
give the same greedy tokens as the plain torch path on the same weights (fp32, so any difference
is a bug, not rounding), across mixed prompt lengths, shared prefixes, chunked prefill and
decode batches of several graph sizes; and speculative decoding's verify graphs against the same
reference.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.llm_engine import LLMEngine  # noqa: E402
from worker.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(70)]
    prompts = [shared + [rng.randrange(100, 40000) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    prompts += [[rng.randrange(100, 40000) for _ in range(n)] for n in (1, 5, 33, 300)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, detokenize=False)
    common = dict(model="dummy:smollm2-135m", device="cuda", dtype="float32", max_num_batched_tokens=256,
                  max_model_len=1024, max_num_seqs=16)
    t = time.perf_counter()
    ref_engine = LLMEngine(EngineConfig(**common, attention_backend="torch", cuda_graphs=False, num_kv_blocks=512,
                                        async_scheduling=False))
    # Both use the fused norm/rotary/activation kernels on CUDA (checked against their references
    # by benchmarks/kernels_gpu.py); what differs is the attention path and the CUDA graphs.
    ref = ref_engine.generate(prompts, sp)
    fast_engine = LLMEngine(EngineConfig(**common, attention_backend="triton", cuda_graphs=True, num_kv_blocks=512),
                            tokenizer=ref_engine.tokenizer, model=ref_engine.model)
    fast = fast_engine.generate(prompts, sp)
    same = sum(a == b for a, b in zip(ref, fast))
    print(f"greedy sequences equal: {same}/{len(prompts)} ({time.perf_counter() - t:.1f} s)")
    for i, (a, b) in enumerate(zip(ref, fast)):
        if a != b:
            first = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            print(f"  prompt {i} (len {len(prompts[i])}) differs at token {first}: {a[first:first+4]} vs {b[first:first+4]}")
    fast_engine.check_integrity()
    print("graph sizes:", fast_engine.runner.graphs.sizes if fast_engine.runner.graphs else None)
    # Seeded sampling, drawn on the device: the same tokens with the lookahead and without it.
    seeded = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=i, ignore_eos=True,
                             detokenize=False) for i in range(len(prompts))]
    fast_engine.config.async_scheduling = False
    plain = fast_engine.generate(prompts, seeded)
    fast_engine.config.async_scheduling = True
    ahead = fast_engine.generate(prompts, seeded)
    sampled_same = sum(a == b for a, b in zip(plain, ahead))
    print(f"seeded sampled sequences equal with and without the lookahead: {sampled_same}/{len(prompts)}")
    fast_engine.close()
    # Speculative decoding's verify graphs (one row per token): prompts that repeat themselves, so
    # that the n-gram drafter proposes at most steps; greedy, so the tokens are the reference's.
    loops = [(shared[:7 + i] * 6)[: 40 + 9 * i] for i in range(6)]
    loop_ref = ref_engine.generate(loops, sp)
    spec_engine = LLMEngine(EngineConfig(**common, attention_backend="triton", cuda_graphs=True, num_kv_blocks=512,
                                         speculative="ngram"), tokenizer=ref_engine.tokenizer, model=ref_engine.model)
    spec_out = spec_engine.generate(loops, sp)
    spec_same = sum(a == b for a, b in zip(loop_ref, spec_out))
    print(f"speculative (ngram, verify graphs {spec_engine.runner.verify_graphs is not None}): greedy sequences "
          f"equal {spec_same}/{len(loops)}")
    spec_engine.check_integrity()
    spec_engine.close()
    # A quantized KV pool: the Triton kernels (store, fused rotary+store, decode, prefill, in graphs)
    # against the torch path's quantize / dequantize on the same weights. Both quantize the same
    # fp32 K/V, so they agree but for a rotary rounding that moves a value across a rounding edge.
    kv_ok = True
    for kv in ("int8", "fp8"):
        kv_ref = LLMEngine(EngineConfig(**common, attention_backend="torch", cuda_graphs=False, num_kv_blocks=512,
                                        async_scheduling=False, kv_cache_dtype=kv),
                           tokenizer=ref_engine.tokenizer, model=ref_engine.model)
        a_out = kv_ref.generate(prompts, sp)
        kv_ref.close()
        kv_fast = LLMEngine(EngineConfig(**common, attention_backend="triton", cuda_graphs=True,
                                         num_kv_blocks=512, kv_cache_dtype=kv),
                            tokenizer=ref_engine.tokenizer, model=ref_engine.model)
        b_out = kv_fast.generate(prompts, sp)
        kv_fast.check_integrity()
        kv_fast.close()
        kv_same = sum(a == b for a, b in zip(a_out, b_out))
        vs_float = sum(a == b for a, b in zip(a_out, ref))
        print(f"kv {kv}: triton vs torch greedy sequences equal {kv_same}/{len(prompts)}; "
              f"torch {kv} vs float pool {vs_float}/{len(prompts)}")
        kv_ok = kv_ok and kv_same >= len(prompts) - 1
    # bf16 weights over a quantized pool: decode's dots on the "pairs" operands (the default) against
    # "fp16", the same operands dotted in another order, so near-ties aside the same tokens.
    from kernels import paged_attention

    bf16 = dict(common, dtype="bfloat16")
    bf16_model = LLMEngine(EngineConfig(**bf16, attention_backend="triton", cuda_graphs=False, num_kv_blocks=64,
                                        async_scheduling=False), tokenizer=ref_engine.tokenizer)
    for kv in ("int8", "fp8"):
        outs = {}
        for dots in ("fp16", "pairs"):
            paged_attention.DECODE_QUANT_DOTS = dots
            eng = LLMEngine(EngineConfig(**bf16, attention_backend="triton", cuda_graphs=True, num_kv_blocks=512,
                                         kv_cache_dtype=kv), tokenizer=ref_engine.tokenizer, model=bf16_model.model)
            outs[dots] = eng.generate(prompts, sp)
            eng.close()
        print(f"kv {kv}, bf16 model: decode dots pairs vs fp16 greedy sequences equal "
              f"{sum(a == b for a, b in zip(outs['fp16'], outs['pairs']))}/{len(prompts)}")
    paged_attention.DECODE_QUANT_DOTS = "pairs"
    bf16_model.close()
    handoff_ok = check_norm_handoff(prompts)
    return 0 if (same == len(prompts) and sampled_same == len(prompts) and spec_same == len(loops) and kv_ok
                 and handoff_ok) else 1


def check_norm_handoff(prompts: list[list[int]]) -> bool:
    """int4 weights in the Gluon kernels, one request at a time (one-row decode graphs): the norms
    handed from o_proj and down_proj to the projections after them (kernels/wq_matmul.py's
    wq_matmul_norm) against the norm kernel between them. Roundings differ (x rounded before 1 / rms,
    not after), so the check is the logprobs of the chosen tokens while the two agree, and at the
    first token where they part (a near tie: both choices about equally likely)."""
    from kernels import wq_matmul

    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, detokenize=False, logprobs=0)
    common = dict(model="dummy:llama-3.2-1b", device="cuda", dtype="bfloat16", quantization="int4",
                  max_model_len=1024, max_num_seqs=16, num_kv_blocks=512)
    runs, model = {}, None
    for on in (False, True):
        wq_matmul.NORM_HANDOFF = on  # read while the decode graphs are captured
        engine = LLMEngine(EngineConfig(**common), model=model)
        model = engine.model
        assert all(layer.norm_handoff for layer in model.model.layers), "int4 projections not tiled"
        # alone: every decode step one row
        outs = [(toks, torch.tensor(lps)) for p in prompts for toks, lps in engine.generate_logprobs([p], sp)]
        engine.check_integrity()
        engine.close()
        runs[on] = outs
    wq_matmul.NORM_HANDOFF = True
    agreed, worst = 0, 0.0
    for (t_off, lp_off), (t_on, lp_on) in zip(runs[False], runs[True]):
        same = next((i for i, (a, b) in enumerate(zip(t_off, t_on)) if a != b), len(t_off))
        agreed += same
        n = min(same + 1, len(t_off))
        worst = max(worst, (lp_on[:n] - lp_off[:n]).abs().max().item())
    total = sum(len(t) for t, _ in runs[False])
    print(f"norm handoff (int4, one row): tokens agreed {agreed}/{total} before each parting; largest "
          f"logprob difference there {worst:.4f}")
    return worst < 0.15


if __name__ == "__main__":
    sys.exit(main())
