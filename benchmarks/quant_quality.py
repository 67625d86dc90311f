"""What weight quantization (--quantization auto|int8|int4) costs in quality and buys in memory and
decode speed against the dense float model (none), on CPU.

    HF_HUB_OFFLINE=1 python benchmarks/quant_quality.py [--model smollm2-135m] [--json PATH]
        [--quantizations none auto int8 int4] [--parts layers ppl parity tasks speed]
        [--max-tokens 2048] [--new-tokens 64] [--tasks deploy/cascade_tasks.jsonl] [--task-limit N]
        [--speed-tokens 64] [--speed-batches 1 8]

Each configuration against ``none`` (the checkpoint dequantized to float32, as served before):

    layers  per projection, ||W_q - W|| / ||W|| of the packed weight's dequantization against none's
            float weight (mean and max over the layers of each kind), and the weight bytes
    ppl     perplexity of the shipped text (benchmarks/data/, the first --max-tokens tokens) and the
            mean / max |delta logprob| per token (kv_cache_quality.py's measurement)
    parity  greedy agreement over the ten parity prompts, --new-tokens tokens
    tasks   accuracy on the cascade's labelled tasks (deploy/cascade_tasks.jsonl; chat template,
            greedy, 16 tokens, as `kvcascade cascade calibrate` runs them)
    speed   decode tok/s at each --speed-batches (greedy, EOS ignored, the prefill's time left out:
            the time from each request's first token to its last), the engine in-process

``auto`` serves a GGUF as it ships (Q4_K and Q4_1 as int4 groups of 32, Q6_K and Q8_0 as int8);
int8 / int4 re-quantize every projection (group --group-size). On CPU the packed matmuls run bf16
activations (worker/models/quantization.py), so a ``none`` row in bf16 (--bf16) gives the scale.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
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

from benchmarks.kv_cache_quality import agreement, delta, eval_token_ids, run  # noqa: E402
from loadtest.tasks import load_tasks, score  # noqa: E402
from contracts.models import resolve_model  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.llm_engine import LLMEngine  # noqa: E402
from worker.engine.model_runner import kv_bytes_per_block, kv_storage_dtype  # noqa: E402
from worker.engine.sampling_params import SamplingParams  # noqa: E402
from worker.models.quantization import QuantizedLinearWeight, weight_bytes  # noqa: E402


def layer_errors(dense: torch.nn.Module, quant: torch.nn.Module) -> dict:
    """Per projection kind: mean and max relative reconstruction error, and how many were packed."""
    floats = dict(dense.named_parameters())
    kinds: dict[str, list[float]] = {}
    for name, module in quant.named_modules():
        if not isinstance(module, QuantizedLinearWeight):
            continue
        w = floats[name]
        err = ((module.data.dequantize() - w.float()).norm() / w.float().norm()).item()
        kinds.setdefault(name.split(".")[-2], []).append(err)
    return {k: {"mean": sum(v) / len(v), "max": max(v), "count": len(v)} for k, v in kinds.items()}


def layer_errors_before_finalize(args, base: LLMEngine, config: EngineConfig) -> dict:
    """Reconstruction errors need the generic packed form, which CPU int4 drops at finalize:
    build the model again with finalize skipped."""
    import worker.models.llama as llama
    from worker.engine.llm_engine import build_model

    real = llama.finalize_quantized
    llama.finalize_quantized = lambda model: None
    try:
        model = build_model(config, resolve_model(args.model), base.model_config)
    finally:
        llama.finalize_quantized = real
    return layer_errors(base.model, model)


def summarize(r: dict, ref: dict) -> dict:
    """One setting's results against none's (``ref``): weights, the KV blocks they free,
    reconstruction errors, perplexity and its logprob deltas, greedy agreement, tasks, speed."""
    s = {"weight_gib": r["weight_bytes"] / 2**30,
         # what the weights this setting saves against none buy in KV blocks of this model
         "kv_blocks_freed": (ref["weight_bytes"] - r["weight_bytes"]) // r["kv_block_bytes"]}
    if "layers" in r:
        s["layers"] = r["layers"]
    if "ppl" in r:
        lp = r["ppl"]["logprobs"]
        s["ppl"] = {"perplexity": math.exp(-lp.mean().item()), "tokens": lp.numel(),
                    **delta(ref["ppl"]["logprobs"], lp)}
    if "parity" in r:
        s["parity"] = agreement(ref["parity"]["outputs"], r["parity"]["outputs"])
    if "tasks" in r:
        s["tasks"] = {k: v for k, v in r["tasks"].items() if k != "right"}
        s["tasks"]["agree_with_none"] = sum(a == b for a, b in zip(ref["tasks"]["right"], r["tasks"]["right"]))
    if "speed" in r:
        s["speed"] = r["speed"]
    return s


def release_memory() -> None:
    """Hand a closed engine's memory back to the system: a 1.5B's settings one after another
    otherwise grow the process past 24 GiB (glibc keeps freed arenas), and the next one is killed."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def tasks_accuracy(engine: LLMEngine, tasks, max_tokens: int) -> dict:
    prompts = [engine.tokenize(messages=[{"role": "user", "content": t.prompt}]) for t in tasks]
    outs, _ = run(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    right = [score(t, engine.tokenizer.decode(o, skip_special_tokens=True)) for t, o in zip(tasks, outs)]
    return {"correct": sum(right), "tasks": len(tasks), "accuracy": sum(right) / len(tasks), "right": right}


def decode_speed(engine: LLMEngine, batch: int, tokens: int) -> dict:
    """Decode tok/s over ``batch`` requests of 64-token prompts: tokens after each one's first,
    over the time from the first first-token to the last token."""
    prompt = eval_token_ids(engine, 64)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt[i:] + prompt[:i], params) for i in range(batch)]
    first: float | None = None
    counted = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if first is None and out.new_token_ids:
                first = now
            elif first is not None:
                counted += len(out.new_token_ids)
    wall = time.perf_counter() - first
    del ids
    return {"batch": batch, "tok_s": counted / wall, "ms_per_step": wall / (tokens - 1) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantizations", nargs="+", choices=["none", "auto", "int8", "int4"],
                    default=["none", "auto", "int8", "int4"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--parts", nargs="+", choices=["layers", "ppl", "parity", "tasks", "speed"],
                    default=["layers", "ppl", "parity", "tasks", "speed"])
    ap.add_argument("--bf16", action="store_true", help="also a dense row with the whole model in bf16")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tasks", default=str(REPO / "deploy" / "cascade_tasks.jsonl"))
    ap.add_argument("--task-limit", type=int, default=None)
    ap.add_argument("--task-max-tokens", type=int, default=16)
    ap.add_argument("--speed-tokens", type=int, default=64)
    ap.add_argument("--speed-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if "none" not in args.quantizations:
        args.quantizations.insert(0, "none")

    t_start = time.monotonic()
    common = dict(model=args.model, max_num_batched_tokens=512, kv_cache_bytes=512 * 2**20,
                  enable_prefix_caching=False, quantization_group_size=args.group_size)
    base = LLMEngine(EngineConfig(**common, quantization="none"))  # a GGUF's default is auto: the dense reference
    from tests.conftest import PROMPTS

    parity = [base.tokenize(messages=[{"role": "user", "content": p}]) for p in PROMPTS[:-1]]
    parity.append(base.tokenize(prompt=PROMPTS[-1]))
    text = [eval_token_ids(base, min(args.max_tokens, base.max_model_len - 1))]
    tasks = load_tasks(args.tasks)[: args.task_limit]
    configs = [(q, dict(quantization=q)) for q in args.quantizations]
    if args.bf16:
        configs.append(("none bf16", dict(quantization="none", dtype="bfloat16")))
    raw: dict[str, dict] = {}
    summary: dict[str, dict] = {}
    results = {"model": args.model, "args": vars(args), "torch": torch.__version__, "cpus": os.cpu_count(),
               "machine": platform.platform(), "configs": summary}
    for name, overrides in configs:
        engine = base if name == "none" else LLMEngine(EngineConfig(**{**common, **overrides}),
                                                       tokenizer=base.tokenizer)
        res: dict = {"weight_bytes": weight_bytes(engine.model)}
        block = kv_bytes_per_block(engine.model_config, engine.config.block_size, kv_storage_dtype(engine.config),
                                   engine.model.kv_heads)
        res["kv_block_bytes"] = block
        config = engine.config
        for part in args.parts:
            t0 = time.monotonic()
            if part == "layers":
                continue  # below, once this setting's engine is closed (a second model of it is built)
            elif part == "ppl":
                _, (lp,) = run(engine, text, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
                res["ppl"] = {"logprobs": lp}
            elif part == "parity":
                out, _ = run(engine, parity, SamplingParams(max_tokens=args.new_tokens, temperature=0,
                                                            ignore_eos=True))
                res["parity"] = {"outputs": out}
            elif part == "tasks":
                res["tasks"] = tasks_accuracy(engine, tasks, args.task_max_tokens)
            elif part == "speed":
                res["speed"] = [decode_speed(engine, b, args.speed_tokens) for b in args.speed_batches]
            print(f"{name}: {part} {time.monotonic() - t0:.0f} s", flush=True)
        if engine is not base:
            engine.close()
            del engine
            release_memory()
        if "layers" in args.parts and name not in ("none", "none bf16"):
            t0 = time.monotonic()
            res["layers"] = layer_errors_before_finalize(args, base, config)
            release_memory()
            print(f"{name}: layers {time.monotonic() - t0:.0f} s", flush=True)
        raw[name] = res
        summary[name] = summarize(res, raw["none"])
        # Written after each setting: a run of the 1.5B's four settings takes an hour or more.
        results["seconds"] = round(time.monotonic() - t_start, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\n{'config':<11}{'GiB':>7}{'blocks+':>9}{'ppl':>9}{'mean|d|':>9}{'max|d|':>8}{'parity':>8}{'tasks':>8}"
          f"  decode tok/s (batch)")
    for name, s in summary.items():
        p, a, t = s.get("ppl", {}), s.get("parity", {}), s.get("tasks", {})
        speed = " ".join(f"{x['tok_s']:.1f} ({x['batch']})" for x in s.get("speed", []))
        print(f"{name:<11}{s['weight_gib']:>7.3f}{s['kv_blocks_freed']:>9}{p.get('perplexity', math.nan):>9.3f}"
              f"{p.get('mean_abs_dlogprob', math.nan):>9.4f}{p.get('max_abs_dlogprob', math.nan):>8.2f}"
              f"{a.get('token_agreement', math.nan):>8.1%}{t.get('accuracy', math.nan):>8.1%}  {speed}")
        for kind, e in s.get("layers", {}).items():
            print(f"    {kind:<13} rel. error mean {e['mean']:.4f} max {e['max']:.4f} ({e['count']} packed)")
    print(f"\n{results['seconds']:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
