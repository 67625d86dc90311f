"""Speculative decoding's step costs on one GPU: the target's verify step for k = 1..8 drafts
against its plain decode step, and the draft model's step, at batch 1 and 8; from them and an
acceptance rate, the expected speed-up.

    python benchmarks/speculative_gpu.py [--model dummy:llama-3.1-8b] [--draft dummy:llama-3.2-1b]
        [--tokenizer .tok] [--context 512] [--alphas 0.6 0.8] [--out results.json]

A step here is what the engine runs: ``drafter.fill`` (the draft model's k + 1 forwards) and
``runner.run`` (the target's forward over last token + k drafts, and verification), timed
end to end with the host in the loop, median of --reps. k = 0 is the plain decode step (CUDA
graph). Random weights: the drafts are random, so the timing is of the work, not of acceptance.

Expected speed-up at batch 1, acceptance rate a per draft (drafts accepted independently):
tokens per step E = (1 - a^(k+1)) / (1 - a); speed-up = E * t_decode / t_step(k).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.llm_engine import LLMEngine  # noqa: E402
from worker.engine.sampling_params import SamplingParams  # noqa: E402
from worker.engine.scheduler import ScheduledSeq  # noqa: E402
from worker.engine.sequence import Sequence  # noqa: E402


def step_time(engine: LLMEngine, seqs: list[Sequence], k: int, drafter, reps: int) -> float:
    """Median seconds of one step of ``seqs`` each with k drafts (0: plain decode)."""
    times = []
    for _ in range(reps + 3):
        batch = [ScheduledSeq(s, 1 + k, [0] * k) for s in seqs]
        torch.cuda.synchronize()
        t = time.perf_counter()
        q = drafter.fill(batch) if (drafter is not None and k) else None
        engine.runner.run(batch, q)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--draft", default="dummy:llama-3.2-1b")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.6, 0.7, 0.8])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtype", default="bfloat16", help="--check's dtype")
    ap.add_argument("--check", action="store_true",
                    help="instead: greedy outputs with --speculative ngram against without, end to end (engine)")
    args = ap.parse_args()
    if args.check:
        return check(args)

    engine = LLMEngine(EngineConfig(model=args.model, tokenizer=args.tokenizer, device="cuda", dtype="bfloat16",
                                    speculative=f"draft:{args.draft}", num_speculative_tokens=args.max_k,
                                    max_num_seqs=max(args.batches), gpu_memory_utilization=0.85))
    drafter = engine.drafter
    results = []
    for b in args.batches:
        seqs = []
        for i in range(b):
            seq = Sequence(f"s{i}", [(7 * i + j) % 1000 + 10 for j in range(args.context)],
                           SamplingParams(max_tokens=64, temperature=0))
            assert engine.block_manager.allocate(seq, args.context + args.max_k + 1)
            seq.num_computed_tokens = args.context - 1  # its KV: whatever the pool holds (timing only)
            seqs.append(seq)
        t_decode = step_time(engine, seqs, 0, None, args.reps)
        # the draft model's own decode step: its runner on the same sequences
        t_draft = statistics.median(_draft_decode(drafter.runner, seqs, args.reps))
        row = {"batch": b, "context": args.context, "decode_ms": t_decode * 1e3, "draft_decode_ms": t_draft * 1e3,
               "verify_ms": {}, "step_with_draft_ms": {}, "expected_speedup": {}}
        for k in range(1, args.max_k + 1):
            t_verify = step_time(engine, seqs, k, None, args.reps)
            t_step = step_time(engine, seqs, k, drafter, args.reps)
            row["verify_ms"][k] = t_verify * 1e3
            row["step_with_draft_ms"][k] = t_step * 1e3
            for a in args.alphas:
                e = (1 - a ** (k + 1)) / (1 - a)
                row["expected_speedup"].setdefault(f"draft a={a}", {})[k] = e * t_decode / t_step
                row["expected_speedup"].setdefault(f"ngram a={a}", {})[k] = e * t_decode / t_verify
            print(f"batch {b} k={k}: decode {t_decode * 1e3:.2f} ms, verify {t_verify * 1e3:.2f} ms, "
                  f"draft+verify {t_step * 1e3:.2f} ms (draft decode {t_draft * 1e3:.2f} ms)", flush=True)
        results.append(row)
        for seq in seqs:
            engine.block_manager.free(seq)
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(),
                                              "results": results}, indent=1))


def check(args) -> None:
    """End to end on the GPU (lookahead and graphs as served): 16 prompts, half of them repeating
    a pattern (drafts accepted), 128 greedy tokens each, batch 1 and 16: the same tokens with
    n-gram speculation as without, and decode tok/s of each."""
    common = dict(model=args.model, tokenizer=args.tokenizer, device="cuda", dtype=args.dtype, max_num_seqs=16,
                  num_kv_blocks=4096)  # two engines, one GPU: a fixed pool each
    plain = LLMEngine(EngineConfig(**common))
    spec = LLMEngine(EngineConfig(**common, speculative="ngram", num_speculative_tokens=4), model=plain.model,
                     tokenizer=plain.tokenizer)
    prompts = [[(i * 31 + j) % 5000 + 100 for j in range(200)] for i in range(8)]
    prompts += [[(j % 12) * 7 + 100 + i for j in range(200)] for i in range(8)]  # a period-12 pattern
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True, detokenize=False)
    report = {}
    for b in (1, 16):
        outs = {}
        for name, engine in (("plain", plain), ("ngram", spec)):
            engine.block_manager.reset_prefix_cache()
            engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, detokenize=False))  # warm
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs[name] = [o for s in range(0, len(prompts), b) for o in engine.generate(prompts[s : s + b], params)]
            torch.cuda.synchronize()
            report[f"batch {b} {name} tok/s"] = 128 * len(prompts) / (time.perf_counter() - t)
        same = sum(a == c for a, c in zip(outs["plain"], outs["ngram"]))
        report[f"batch {b} same outputs"] = f"{same}/{len(prompts)}"
        # where they part (random weights: near-ties, which other kernels' rounding can flip)
        report[f"batch {b} first difference"] = [next((i for i, (x, y) in enumerate(zip(a, c)) if x != y), None)
                                                 for a, c in zip(outs["plain"], outs["ngram"])]
    st = spec.spec_stats
    report["acceptance"] = st.acceptance_rate
    report["mean accepted length"] = st.mean_accepted_length
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), **report}, indent=1))


def _draft_decode(runner, seqs: list[Sequence], reps: int) -> list[float]:
    batch = [ScheduledSeq(s, 1) for s in seqs]
    inputs = runner.prepare(batch)
    times = []
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.execute(inputs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times[3:]


if __name__ == "__main__":
    main()
