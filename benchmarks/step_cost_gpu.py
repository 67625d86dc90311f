"""Checks fleet_sim.py's step-cost model against the engine on a GPU: the fleet simulator's
workload (long shared prompts, short questions) run through one real engine (dummy:llama-3.1-8b,
bf16, CUDA graphs), every step's composition recorded as the simulator sees it (decode rows, their
context, prefill chunks) next to its measured time, and the model's prediction for it.

    python benchmarks/step_cost_gpu.py [--requests 600] [--rate 40] [--prefixes 8] [--out step_cost.json]

Requests arrive as a Poisson process in wall time at --rate per second (so prefill and decode
mix as they would on a worker of the fleet). Steps run without the lookahead (async scheduling
off), so each step's wall time is its own: host work plus device time, as a step costs the
simulator. Reports measured / predicted by kind of step (decode only, with prefill) and by batch
size, and the totals.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

spec = importlib.util.spec_from_file_location("fleet_sim", REPO / "benchmarks" / "fleet_sim.py")
fleet_sim = sys.modules["fleet_sim"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fleet_sim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--lookahead", action="store_true", help="async scheduling on (the engine's default on CUDA): "
                    "per-step times then overlap, only the totals compare")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    wl = argparse.Namespace(prefixes=args.prefixes, prefix_tokens=[2048, 4096], question_tokens=[32, 160],
                            output_tokens=[64, 192], hot=0.0, hot_from=0.0)
    reqs = fleet_sim.make_workload(wl, args.rate, args.requests, seed=0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") and not args.lookahead else (lambda: None)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype="bfloat16",
                                    num_kv_blocks=args.blocks, max_num_seqs=128, max_num_batched_tokens=8192,
                                    async_scheduling=args.lookahead, max_model_len=8192))
    vocab = engine.inputs.vocab_size  # the simulator draws ids below 128,000; a smaller model folds them
    for r in reqs:
        r.prompt = [t % vocab for t in r.prompt]
    cost = fleet_sim.StepCost()
    sched = engine.scheduler
    schedule = sched.schedule
    last: dict = {}

    def recording(*a, **kw):
        batch, overflow = schedule(*a, **kw)
        rows, ctx, prefill = fleet_sim.composition(batch)
        last.update(rows=rows, ctx=ctx, prefill=prefill)
        return batch, overflow

    sched.schedule = recording
    # warm-up: the graphs and the prefill kernels' shapes
    engine.generate([r.prompt for r in reqs[:4]], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False))
    engine.block_manager.reset_prefix_cache()
    steps = []
    start = time.perf_counter()
    pending = list(reqs)
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].arrival <= now:
            r = pending.pop(0)
            engine.add_request(r.prompt, SamplingParams(max_tokens=r.output_tokens, ignore_eos=True, detokenize=False))
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0].arrival - now))
            continue
        last.clear()
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        if last:
            steps.append({**last, "ms": ms, "predicted_ms": cost.step_ms(last["rows"], last["ctx"], last["prefill"])})
    wall = time.perf_counter() - start

    def group(name: str, sel: list[dict]) -> dict:
        if not sel:
            return {"group": name, "steps": 0}
        measured, predicted = sum(s["ms"] for s in sel), sum(s["predicted_ms"] for s in sel)
        ratios = [s["ms"] / s["predicted_ms"] for s in sel]
        return {"group": name, "steps": len(sel), "measured_ms": measured, "predicted_ms": predicted,
                "measured_over_predicted": measured / predicted, "ratio_p10": sorted(ratios)[len(ratios) // 10],
                "ratio_p50": statistics.median(ratios), "ratio_p90": sorted(ratios)[len(ratios) * 9 // 10]}

    decode = [s for s in steps if not s["prefill"]]
    mixed = [s for s in steps if s["prefill"]]
    groups = [group("all", steps), group("decode only", decode), group("with prefill", mixed)]
    for lo, hi in ((1, 16), (17, 64), (65, 128)):
        groups.append(group(f"decode only, batch {lo}-{hi}", [s for s in decode if lo <= s["rows"] <= hi]))
    for g in groups:
        if g["steps"]:
            print(f"{g['group']:28s} {g['steps']:5d} steps  measured {g['measured_ms'] / 1e3:7.2f} s  predicted "
                  f"{g['predicted_ms'] / 1e3:7.2f} s  x{g['measured_over_predicted']:.3f}  (per step p10/p50/p90 "
                  f"{g['ratio_p10']:.2f} / {g['ratio_p50']:.2f} / {g['ratio_p90']:.2f})", flush=True)
    stats = engine.stats()
    out = {"args": vars(args), "wall_s": wall, "prefix_hit_rate": stats.prefix_hits / max(stats.prefix_queries, 1),
           "groups": groups, "steps": steps, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    print(f"wall {wall:.1f} s, {len(steps)} steps, prefix hit rate {out['prefix_hit_rate']:.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
