"""Where a decode step's time goes on the GPU (Llama-3.1-8B shape, random bf16 weights):
graph replay alone vs the whole engine step, the host-side phases of a step, and the top
kernels of one eager step (torch profiler). For finding the gap to the floor, not for records.

    python benchmarks/gpu_profile.py --batch 1 --batch 256
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.llm_engine import LLMEngine  # noqa: E402
from worker.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--context", type=int, default=600)
    args = ap.parse_args()
    eng = LLMEngine(EngineConfig(model="dummy:llama-3.1-8b", device="cuda", dtype="bfloat16", max_model_len=4096,
                                 max_num_batched_tokens=8192, max_num_seqs=256))
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, detokenize=False)
    for b in args.batch or [1, 256]:
        for _ in range(b):
            eng.add_request([rng.randrange(1000, 100000) for _ in range(args.context)], sp)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        for _ in range(3):
            eng.step()
        # phases of a step, synchronising between them
        phases = {"schedule": 0.0, "run": 0.0, "postprocess": 0.0}
        n = 20
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            batch, _ = eng.scheduler.schedule()
            t1 = time.perf_counter()
            sampled = eng.runner.run(batch)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            eng._postprocess(batch, sampled)
            t3 = time.perf_counter()
            phases["schedule"] += t1 - t0
            phases["run"] += t2 - t1
            phases["postprocess"] += t3 - t2
        print(f"batch {b}: " + ", ".join(f"{k} {v / n * 1e3:.2f} ms" for k, v in phases.items()))
        # the graph alone
        g = eng.runner.graphs
        size = next(s for s in g.sizes if s >= b)
        graph, _ = g.graphs[size]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        print(f"batch {b}: graph replay alone {start.elapsed_time(end) / n:.2f} ms (size {size})")
        # whole steps back to back
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            eng.step()
        print(f"batch {b}: engine.step {(time.perf_counter() - t) / n * 1e3:.2f} ms")
        # kernels of one eager step
        graphs, eng.runner.graphs = eng.runner.graphs, None
        eng.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            eng.step()
            torch.cuda.synchronize()
        eng.runner.graphs = graphs
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        for s in list(eng.scheduler.running):
            eng.abort_request(s.request_id)


if __name__ == "__main__":
    main()
