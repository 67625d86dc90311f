"""Where a decode step's time goes on the GPU (Llama-3.1-8B shape, random bf16 weights):
graph replay alone vs the whole engine step, the host-side phases of a step, and the top
kernels of one eager step (torch profiler). For finding the gap to the floor, not for records.

    python benchmarks/gpu_profile.py --batch 1 --batch 256
    python benchmarks/gpu_profile.py --ttft      # a prefill step: host-bound or device-bound?
    python benchmarks/gpu_profile.py --timeline --batch 1   # the kernels of a graph replay, and the gaps

``--ttft`` times the one step of a 2,000-token prompt, first with 1,888 of its tokens cached and
then uncached (benchmark (c)): wall time against the sum of its kernels' time and the span from
its first kernel's start to its last kernel's end.
"""

from __future__ import annotations

import argparse
import contextlib
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
    ap.add_argument("--ttft", action="store_true", help="profile benchmark (c)'s prefill steps instead")
    ap.add_argument("--timeline", action="store_true", help="only the kernel timeline of graph replays")
    ap.add_argument("--mixed", type=int, default=None, metavar="DECODES",
                    help="profile one mixed step instead: DECODES running sequences plus new prompts to the budget")
    args = ap.parse_args()
    eng = LLMEngine(EngineConfig(model="dummy:llama-3.1-8b", device="cuda", dtype="bfloat16", max_model_len=4096,
                                 max_num_batched_tokens=8192, max_num_seqs=256))
    rng = random.Random(0)
    if args.ttft:
        profile_ttft(eng, rng)
        return
    if args.mixed is not None:
        profile_mixed(eng, rng, args.mixed, args.context)
        return
    sp = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, detokenize=False)
    for b in args.batch or [1, 256]:
        for _ in range(b):
            eng.add_request([rng.randrange(1000, 100000) for _ in range(args.context)], sp)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        for _ in range(3):
            eng.step()
        if args.timeline:
            graph_timeline(eng, b)
            for s in list(eng.scheduler.running):
                eng.abort_request(s.request_id)
            continue
        # phases of a step, synchronising between them
        phases = {"schedule": 0.0, "run": 0.0, "postprocess": 0.0}
        n = 20
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            batch, _ = eng.scheduler.schedule()
            t1 = time.perf_counter()
            sampled, _ = eng.runner.run(batch)
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


def graph_timeline(eng: LLMEngine, batch: int, replays: int = 5) -> None:
    """Kernels of ``replays`` graph replays (CUPTI sees inside graphs): time per kind of kernel,
    and the gaps between one kernel's end and the next one's start."""
    g = eng.runner.graphs
    size = next(s for s in g.sizes if s >= batch)
    graph, _ = g.graphs[size]
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels:
        print("no kernels recorded inside the graph (CUPTI too old?)")
        return
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / replays
    busy = sum(e.time_range.elapsed_us() for e in kernels) / replays
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:])]
    gaps = [x for x in gaps if x < 1000]  # not the gaps between replays
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:70], []).append(e.time_range.elapsed_us())
    print(f"graph size {size}: {len(kernels) / replays:.0f} kernels a replay, {span / 1e3:.3f} ms span, "
          f"{busy / 1e3:.3f} ms busy, gaps {sum(gaps) / replays / 1e3:.3f} ms "
          f"(median gap {sorted(gaps)[len(gaps) // 2] if gaps else 0:.2f} us)")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:16]:
        print(f"  {sum(times) / replays / 1e3:7.3f} ms  {len(times) / replays:5.0f} x {sum(times) / len(times):7.2f} us  {name}")


def kernel_table(kernels, rows: int = 16) -> None:
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:70], []).append(e.time_range.elapsed_us())
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"  {sum(times) / 1e3:7.3f} ms  {len(times):5d} x {sum(times) / len(times):8.2f} us  {name}")


def profile_mixed(eng: LLMEngine, rng: random.Random, decodes: int, context: int) -> None:
    """One step of (b)'s admission phase: ``decodes`` sequences decoding and new prompts
    (100-1024 tokens, as in the workload) chunked to fill the token budget; eager (no graph for
    mixed steps). Wall time, kernels' busy time and span, and the kernels by total time."""
    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 100000) for _ in range(n)]

    sp = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, detokenize=False)
    for _ in range(3):  # rounds: warm-up twice (compiles), then profiled
        for _ in range(decodes):
            eng.add_request(prompt(context), sp)
        while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
            eng.step()
        eng.config.async_scheduling = False  # plain steps, so the profiled one is whole
        budget = eng.config.max_num_batched_tokens - decodes
        while budget > 0:
            n = rng.randint(100, 1024)
            eng.add_request(prompt(n), sp)
            budget -= n
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        eng.config.async_scheduling = True
        for s in list(eng.scheduler.running) + list(eng.scheduler.waiting):
            eng.abort_request(s.request_id)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / 1e3
    print(f"mixed step, {decodes} decodes + {eng.config.max_num_batched_tokens - decodes} prefill tokens: "
          f"wall {wall * 1e3:.2f} ms, {len(kernels)} kernels busy {busy:.2f} ms over a {span:.2f} ms span")
    kernel_table(kernels, 20)


def profile_ttft(eng: LLMEngine, rng: random.Random) -> None:
    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 100000) for _ in range(n)]

    def one_step(tokens: list[int], label: str, profile: bool) -> None:
        eng.add_request(tokens, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False))
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        prof = torch.profiler.profile(activities=acts)
        with prof if profile else contextlib.nullcontext():
            t = time.perf_counter()
            outs = eng.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        assert outs and outs[0].finished, "one step should prefill and sample the only token"
        line = f"{label}: cached {outs[0].usage.cached_tokens}, wall {wall * 1e3:.2f} ms"
        if profile:
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
            span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3
            line += f", {len(kernels)} kernels: {busy:.2f} ms busy over a {span:.2f} ms span"
        print(line, flush=True)

    for _ in range(3):  # warm-up: Triton compiles, cuBLAS picks its kernels
        one_step(prompt(2000), "warm-up uncached", False)
    base = prompt(2000)
    one_step(base[:1900] + prompt(100), "caching the prefix", False)
    for i in range(3):
        one_step(base[:1900] + prompt(100), f"cached #{i}", i == 2)
    for i in range(3):
        one_step(prompt(2000), f"uncached #{i}", i == 2)


if __name__ == "__main__":
    main()
