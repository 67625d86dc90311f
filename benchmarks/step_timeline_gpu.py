"""Where a decode step's boundary goes, host against device (one GPU, dummy:llama-3.1-8b).

    python benchmarks/step_timeline_gpu.py [--quantization none] [--batch 1] [--steps 12] [--trace T.json]

Runs batch-``--batch`` decode steps of the engine as served (CUDA graphs, the lookahead) under
torch.profiler with CUDA activity only (CUPTI's runtime-API records come with it; no CPU op
recording, which would slow the host), and reads the trace: for each step, when the host enqueued
its input copies and its graph launch, against when the device finished the step before and
started this one. The device idles between steps either because the host enqueued late (host
bound) or because the stream's own operations take that long (device bound). Also the host's time
a step outside the wait for tokens, the wait itself, and the engine step's wall interval.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_engine import random_prompt  # noqa: E402

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def analyse(trace: dict) -> list[dict]:
    """Per graph launch: host enqueue times and device times, µs, relative to the end of the
    device's last operation before the step's first one."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    runtime = sorted((e for e in events if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    by_corr: dict[int, list[dict]] = {}
    for e in device:
        by_corr.setdefault(e["args"].get("correlation"), []).append(e)
    launches = [r for r in runtime if r["name"] == "cudaGraphLaunch"]
    steps = []
    for prev_launch, launch in zip(launches, launches[1:]):
        kernels = by_corr.get(launch["args"].get("correlation"), [])
        if not kernels:
            continue
        first = kernels[0]["ts"]
        # The host's calls between the previous graph launch and this one, and the device's
        # operations they made (copies, the ids' copy, the sampler's kernels).
        calls = [r for r in runtime if prev_launch["ts"] < r["ts"] <= launch["ts"]]
        before = [d for d in device if d["ts"] < first]
        prev_end = max(d["ts"] + d["dur"] for d in before)
        prev_graph = by_corr.get(prev_launch["args"].get("correlation"), [])
        graph_end = max(d["ts"] + d["dur"] for d in prev_graph) if prev_graph else prev_end
        between = [d for d in device if graph_end <= d["ts"] < first]
        ops = []
        for r in calls:
            made = by_corr.get(r["args"].get("correlation"), [])
            ops.append({"call": r["name"], "host_us": round(r["ts"] - graph_end, 1), "call_us": round(r["dur"], 1),
                        "device_ops": len(made),  # a graph's kernels: the first few listed
                        "device": [(d["name"][:40], round(d["ts"] - graph_end, 1), round(d["dur"], 1))
                                   for d in made[:4]]})
        steps.append({"graph_start_after_prev_graph_us": round(first - graph_end, 1),
                      "launch_host_after_prev_graph_us": round(launch["ts"] - graph_end, 1),
                      "graph_span_us": round(max(k["ts"] + k["dur"] for k in kernels) - first, 1),
                      "ops_between": [(d["name"][:40], round(d["ts"] - graph_end, 1), round(d["dur"], 1))
                                      for d in between],
                      "host_calls": ops})
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--trace", type=Path, default=None, help="also keep the chrome trace here")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from worker.engine import model_runner
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    waits: list[float] = []
    tolist = model_runner.PendingTokens.tolist

    def timed_tolist(self):
        t = time.perf_counter()
        out = tolist(self)
        waits.append(time.perf_counter() - t)
        return out

    model_runner.PendingTokens.tolist = timed_tolist
    engine = LLMEngine(EngineConfig(model="dummy:llama-3.1-8b", device="cuda", dtype="bfloat16", max_model_len=4096,
                                    max_num_batched_tokens=8192, max_num_seqs=256, quantization=args.quantization))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def add(n_tokens: int) -> None:
        for _ in range(args.batch):
            engine.add_request(random_prompt(rng, 128, vocab),
                               SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True, detokenize=False))

    add(16)  # warm-up
    while engine.has_unfinished():
        engine.step()
    add(args.steps * 3 + 16)
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    # Unprofiled: the step's wall interval and the host's wait for tokens.
    waits.clear()
    stamps = []
    for _ in range(args.steps):
        engine.step()
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    res = {"quantization": args.quantization, "batch": args.batch,
           "step_ms": statistics.median(gaps) * 1e3,
           "wait_ms": statistics.median(waits) * 1e3,
           "host_busy_ms": (statistics.median(gaps) - statistics.median(waits)) * 1e3}
    print(json.dumps(res), flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    path = args.trace or Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    res["steps"] = analyse(json.loads(path.read_text()))
    for s in res["steps"][2:5]:
        print(json.dumps(s), flush=True)
    keys = ("graph_start_after_prev_graph_us", "launch_host_after_prev_graph_us", "graph_span_us")
    res["median"] = {k: statistics.median(s[k] for s in res["steps"]) for k in keys}
    print(json.dumps(res["median"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
