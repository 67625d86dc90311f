"""Speculative decoding in the engine: decode tok/s with and without drafts, acceptance rate and
mean accepted length, on the chat and code-editing prompts of benchmarks/data/speculative_workloads.jsonl
(greedy, chat template). Every speculative output is checked against the plain run's, token for token.

    python benchmarks/speculative.py [--model qwen2.5-coder-1.5b] [--workloads code chat] [--batches 1 8]
        [--speculative ngram] [--k 4] [--max-tokens 192] [--limit 8] [--out results.json]

Decode tok/s: per group of --batch prompts run together, the output tokens after each request's
first over the time from the group's first token to its end; summed tokens over summed time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.llm_engine import LLMEngine  # noqa: E402
from worker.engine.sampling_params import SamplingParams  # noqa: E402

DATA = REPO / "benchmarks" / "data" / "speculative_workloads.jsonl"


def run_group(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int, float]:
    """Outputs, decode tokens (after each first) and decode seconds of one batch run together."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    first = None
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        if first is None and all(out.values()):
            first = time.perf_counter()
    end = time.perf_counter()
    tokens = [out[i] for i in ids]
    return tokens, sum(len(t) - 1 for t in tokens), end - (first or end)


def measure(engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    outputs, tokens, seconds = [], 0, 0.0
    before = engine.stats()
    for s in range(0, len(prompts), batch):
        o, n, t = run_group(engine, prompts[s : s + batch], max_tokens)
        outputs += o
        tokens += n
        seconds += t
    after = engine.stats()
    drafted = after.spec_drafted - before.spec_drafted
    accepted = after.spec_accepted - before.spec_accepted
    verifications = after.spec_verifications - before.spec_verifications
    return {
        "decode_tok_s": tokens / seconds if seconds else 0.0, "decode_tokens": tokens, "decode_s": seconds,
        "drafted": drafted, "accepted": accepted, "verifications": verifications,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": (accepted + verifications) / verifications if verifications else None,
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none",
                    help="weights: none (the GGUF dequantized, as recorded) or auto (packed, the serving default)")
    ap.add_argument("--draft-quantization", default=None,
                    help="a draft:MODEL's weights (default: as --quantization), e.g. auto: a packed draft")
    ap.add_argument("--workloads", nargs="+", default=["code", "chat"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--speculative", nargs="+", default=["ngram"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--limit", type=int, default=8, help="prompts per workload")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    base_cfg = dict(model=args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                    quantization=args.quantization,
                    kv_cache_bytes=1 << 30, max_num_seqs=max(args.batches))
    plain = LLMEngine(EngineConfig(**base_cfg))
    engines = {"none": plain}
    for spec in args.speculative:
        draft_quantization = args.draft_quantization if spec.startswith("draft:") else None
        engines[spec] = LLMEngine(EngineConfig(**base_cfg, speculative=spec, num_speculative_tokens=args.k,
                                               speculative_draft_quantization=draft_quantization),
                                  tokenizer=plain.tokenizer, model=plain.model)
    results = []
    for workload in args.workloads:
        texts = [r["prompt"] for r in rows if r["workload"] == workload][: args.limit]
        prompts = [plain.tokenize(messages=[{"role": "user", "content": t}]) for t in texts]
        plain.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        for batch in args.batches:
            base = None
            for name, engine in engines.items():
                for e in engines.values():
                    e.block_manager.reset_prefix_cache()  # every run computes its prompts
                r = measure(engine, prompts, batch, args.max_tokens)
                if base is None:
                    base = r
                exact = r["outputs"] == base["outputs"]
                row = {"workload": workload, "batch": batch, "speculative": name, "k": args.k if name != "none" else 0,
                       **{k: v for k, v in r.items() if k != "outputs"},
                       "speedup": r["decode_tok_s"] / base["decode_tok_s"], "same_output_as_plain": exact}
                results.append(row)
                acc = "" if row["acceptance_rate"] is None else (
                    f" acceptance {row['acceptance_rate']:.2f} mean accepted length {row['mean_accepted_length']:.2f}")
                print(f"{workload:5s} batch {batch:2d} {name:8s}: {row['decode_tok_s']:7.1f} decode tok/s "
                      f"(x{row['speedup']:.2f}){acc} same output: {exact}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
