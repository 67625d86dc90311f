"""What a quantized KV pool (int8, fp8) costs in quality against the float pool (auto), on CPU.

    HF_HUB_OFFLINE=1 python benchmarks/kv_cache_quality.py [--model smollm2-135m] [--json PATH]
        [--parts ppl parity long] [--kv-dtypes auto int8 fp8] [--bf16-parts ppl parity]
        [--max-tokens 4096] [--new-tokens 64] [--long-lengths 1024 2048 3072] [--long-new-tokens 32]
        [--tail 512]

Three measurements per KV dtype, each against auto's (temperature 0, EOS ignored):

    ppl     perplexity of the shipped text (benchmarks/data/eval_text.txt, the first --max-tokens
            tokens), exp(-mean prompt logprob), and the mean / max |delta logprob| per token
    parity  the ten parity prompts (tests/conftest.py, chat template as there), --new-tokens greedy
            tokens: prompts whose output equals auto's, the mean common prefix, and the share of
            tokens generated before the first divergence
    long    the text (repeated as needed) cut to --long-lengths prompt tokens, then a question about
            it: the same agreement numbers for --long-new-tokens tokens, plus the mean / max
            |delta logprob| of the prompt's last --tail tokens (they attend over the longest
            quantized context)

Prefill is chunked (--max-num-batched-tokens 512), prefix caching off, so every prompt computes all
its KV. A row for the whole model in bf16 (float KV) gives the scale of what serving in bf16 already
costs (--bf16-parts with no parts skips it). Other benchmarks reuse the text through
``eval_token_ids``.

On 2 shared CPU cores the defaults took 6 minutes for SmolLM2-135M (more while other jobs load the
cores). Long prompts cost about the square of their length (each 512-token chunk attends over all
before it): the long part with --long-lengths 2048 4096 6144 8192 took 3 to 12 minutes per
configuration there, depending on the load (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.llm_engine import LLMEngine  # noqa: E402
from worker.engine.sampling_params import SamplingParams  # noqa: E402

EVAL_TEXT = Path(__file__).resolve().parent / "data" / "eval_text.txt"  # see data/README.md
QUESTION = ("\n\nQuestion: what is the document above, and what does it require of someone who conveys the "
            "program to others? Answer briefly.")


def load_eval_text() -> str:
    """The shipped evaluation text (the GPL v3, verbatim)."""
    return EVAL_TEXT.read_text(encoding="utf-8")


def eval_token_ids(engine: LLMEngine, num_tokens: int) -> list[int]:
    """The eval text's first ``num_tokens`` tokens (raw, no chat template), repeated as needed to reach them."""
    once = engine.tokenize(prompt=load_eval_text())
    ids = once
    while len(ids) < num_tokens:
        ids = ids + engine.tokenize(prompt="\n\n") + once
    return ids[:num_tokens]


def run(engine: LLMEngine, prompts: list[list[int]],
        params: SamplingParams) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt's output tokens and the logprobs of its scored prompt tokens (empty if none asked)."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    scored: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            scored[out.request_id] += [e.logprob for e in out.prompt_logprobs or []]
    return [tokens[i] for i in ids], [torch.tensor(scored[i], dtype=torch.float64) for i in ids]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Greedy outputs against the reference's: equal prompts, common prefixes, tokens before divergence."""
    prefixes = []
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    return {"exact": sum(a == b for a, b in zip(ref, got)), "prompts": len(ref),
            "mean_prefix": sum(prefixes) / len(prefixes),
            "token_agreement": sum(prefixes) / sum(len(a) for a in ref), "prefixes": prefixes}


def delta(ref: torch.Tensor, got: torch.Tensor) -> dict:
    assert ref.shape == got.shape and ref.numel() > 0, (ref.shape, got.shape)
    d = (got - ref).abs()
    return {"mean_abs_dlogprob": d.mean().item(), "max_abs_dlogprob": d.max().item()}


def build_prompts(engine: LLMEngine, args) -> dict[str, list[list[int]]]:
    from tests.conftest import PROMPTS

    parity = [engine.tokenize(messages=[{"role": "user", "content": p}]) for p in PROMPTS[:-1]]
    parity.append(engine.tokenize(prompt=PROMPTS[-1]))  # one raw completion prompt, as the tests do
    text = eval_token_ids(engine, max(args.long_lengths) + 64)
    overhead = len(engine.tokenize(messages=[{"role": "user", "content": QUESTION}]))
    long = []
    for target in args.long_lengths:
        target = min(target, engine.max_model_len - args.long_new_tokens)
        n = target - overhead
        while True:  # decoding and re-encoding the cut may shift a token or two
            content = engine.tokenizer.decode(text[:n]) + QUESTION
            ids = engine.tokenize(messages=[{"role": "user", "content": content}])
            if len(ids) <= target:
                break
            n -= len(ids) - target
        long.append(ids)
    return {"ppl": [eval_token_ids(engine, min(args.max_tokens, engine.max_model_len - 1))],
            "parity": parity, "long": long}


def measure(engine: LLMEngine, prompts: dict[str, list[list[int]]], parts: list[str], args) -> dict:
    """One engine's raw results: outputs, scored logprobs and seconds per part."""
    res = {}
    for part in parts:
        t0 = time.monotonic()
        if part == "ppl":
            _, (lp,) = run(engine, prompts["ppl"], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
            res["ppl"] = {"logprobs": lp}
        elif part == "parity":
            out, _ = run(engine, prompts["parity"], SamplingParams(max_tokens=args.new_tokens, temperature=0,
                                                                   ignore_eos=True))
            res["parity"] = {"outputs": out}
        else:  # long: the tail's logprobs and the greedy answer in one pass, a prompt at a time
            outs, lps, secs = [], [], []
            for p in prompts["long"]:
                t1 = time.monotonic()
                params = SamplingParams(max_tokens=args.long_new_tokens, temperature=0, ignore_eos=True,
                                        prompt_logprobs=0, prompt_logprobs_start=len(p) - args.tail)
                (out,), (lp,) = run(engine, [p], params)
                outs.append(out)
                lps.append(lp)
                secs.append(round(time.monotonic() - t1, 1))
            res["long"] = {"outputs": outs, "logprobs": lps, "seconds_per_prompt": secs}
        res[part]["seconds"] = time.monotonic() - t0
    return res


def compare(ref: dict, got: dict) -> dict:
    """One configuration's summary against auto's raw results."""
    out = {}
    if "ppl" in got:
        lp = got["ppl"]["logprobs"]
        out["ppl"] = {"tokens": lp.numel(), "perplexity": math.exp(-lp.mean().item()),
                      **delta(ref["ppl"]["logprobs"], lp)}
    if "parity" in got:
        out["parity"] = agreement(ref["parity"]["outputs"], got["parity"]["outputs"])
    if "long" in got:
        d = [delta(a, b) for a, b in zip(ref["long"]["logprobs"], got["long"]["logprobs"])]
        out["long"] = {**agreement(ref["long"]["outputs"], got["long"]["outputs"]),
                       "tail_mean_abs_dlogprob": [x["mean_abs_dlogprob"] for x in d],
                       "tail_max_abs_dlogprob": [x["max_abs_dlogprob"] for x in d],
                       "seconds_per_prompt": got["long"]["seconds_per_prompt"]}
    for part in got:
        out[part]["seconds"] = round(got[part]["seconds"], 1)
    return out


def print_table(results: dict, lengths: list[int]) -> None:
    rows = results["configs"]
    if any("ppl" in r for r in rows.values()):
        print(f"\nperplexity over {next(r['ppl']['tokens'] for r in rows.values() if 'ppl' in r)} scored tokens")
        print(f"{'config':<14}{'ppl':>9}{'mean|d|':>10}{'max|d|':>9}")
        for name, r in rows.items():
            if "ppl" in r:
                p = r["ppl"]
                print(f"{name:<14}{p['perplexity']:>9.4f}{p['mean_abs_dlogprob']:>10.4f}{p['max_abs_dlogprob']:>9.3f}")
    for part, title in (("parity", "parity prompts"), ("long", f"long prompts {lengths} tokens")):
        if not any(part in r for r in rows.values()):
            continue
        print(f"\n{title}: greedy agreement with auto")
        print(f"{'config':<14}{'exact':>7}{'prefix':>8}{'tokens':>8}  first divergence / tail mean|d| (max)")
        for name, r in rows.items():
            if part in r:
                a = r[part]
                extra = (" ".join(f"{m:.3f} ({x:.2f})" for m, x in zip(a["tail_mean_abs_dlogprob"],
                                                                    a["tail_max_abs_dlogprob"]))
                         if part == "long" else "")
                print(f"{name:<14}{a['exact']:>4}/{a['prompts']:<2}{a['mean_prefix']:>8.1f}"
                      f"{a['token_agreement']:>8.1%}  {a['prefixes']}  {extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--parts", nargs="+", choices=["ppl", "parity", "long"], default=["ppl", "parity", "long"])
    ap.add_argument("--kv-dtypes", nargs="+", choices=["auto", "int8", "fp8"], default=["auto", "int8", "fp8"])
    ap.add_argument("--bf16-parts", nargs="*", choices=["ppl", "parity", "long"], default=["ppl", "parity"],
                    help="the parts the whole-model-in-bf16 reference row runs (none: no such row)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens of the text scored for perplexity")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--long-lengths", type=int, nargs="+", default=[1024, 2048, 3072])
    ap.add_argument("--long-new-tokens", type=int, default=32)
    ap.add_argument("--tail", type=int, default=512, help="long prompts: score the last this many tokens")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-mib", type=int, default=1024)
    ap.add_argument("--quantization", default="none",
                    help="weights: none (the GGUF dequantized, as recorded) or auto (packed, the serving default)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if "auto" not in args.kv_dtypes:
        args.kv_dtypes.insert(0, "auto")  # the reference

    t_start = time.monotonic()
    common = dict(model=args.model, quantization=args.quantization,
                  max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_bytes=args.kv_cache_mib * 2**20,
                  enable_prefix_caching=False)
    base = LLMEngine(EngineConfig(**common))
    prompts = build_prompts(base, args)
    configs = [(f"kv {d}", dict(kv_cache_dtype=d), args.parts) for d in args.kv_dtypes]
    if [p for p in args.parts if p in args.bf16_parts]:
        configs.append(("bf16 model", dict(dtype="bfloat16"), [p for p in args.parts if p in args.bf16_parts]))
    raw = {}
    for name, overrides, parts in configs:
        if name == "kv auto":
            engine = base
        else:  # the fp32 weights are shared; a bf16 model has its own
            shared = dict(model=base.model) if "dtype" not in overrides else {}
            engine = LLMEngine(EngineConfig(**common, **overrides), tokenizer=base.tokenizer, **shared)
        raw[name] = measure(engine, prompts, parts, args)
        print(f"{name}: " + ", ".join(f"{p} {r['seconds']:.0f} s" for p, r in raw[name].items()), flush=True)
        if engine is not base:
            engine.close()
    results = {
        "model": args.model, "args": vars(args), "torch": torch.__version__, "cpus": os.cpu_count(),
        "machine": platform.platform(), "prompt_lengths": {k: [len(p) for p in v] for k, v in prompts.items()},
        "configs": {name: compare(raw["kv auto"], r) for name, r in raw.items()},
    }
    results["seconds"] = round(time.monotonic() - t_start, 1)
    print_table(results, results["prompt_lengths"]["long"])
    print(f"\n{results['seconds']:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
