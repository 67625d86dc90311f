"""benchmarks/step_timeline_gpu.py's reading of a profiler trace, the part that runs without a GPU:
for each graph launch, when the device started it after the graph before ended, what ran on the
device in between, and when the host had asked for it (a host ahead of the device shows as a
launch before the graph before ended)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("step_timeline_gpu",
                                              Path(__file__).parents[2] / "benchmarks" / "step_timeline_gpu.py")
step_timeline = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(step_timeline)


def _ev(cat, name, ts, dur, corr):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_a_step_boundary_is_read_from_the_trace():
    trace = {"traceEvents": [
        # step 1: launched at host time 0, its two kernels run 100-200 and 150-300 (overlapping)
        _ev("cuda_runtime", "cudaGraphLaunch", 0, 5, 1),
        _ev("kernel", "embed", 100, 50, 1), _ev("kernel", "proj", 150, 150, 1),
        # between the steps: the sampler, the tokens' copy out, an input copy in
        _ev("cuda_runtime", "cudaLaunchKernel", 20, 3, 2), _ev("kernel", "argmax", 302, 4, 2),
        _ev("cuda_runtime", "cudaMemcpyAsync", 30, 2, 3), _ev("gpu_memcpy", "Memcpy HtoD", 310, 1, 3),
        # step 2: asked for at host time 40, long before step 1 ended; starts at 320
        _ev("cuda_runtime", "cudaGraphLaunch", 40, 5, 4),
        _ev("kernel", "embed", 320, 10, 4), _ev("kernel", "proj", 330, 100, 4),
        {"ph": "i", "name": "an instant event, ignored", "ts": 1},
    ]}
    steps = step_timeline.analyse(trace)
    assert len(steps) == 1
    step = steps[0]
    assert step["graph_start_after_prev_graph_us"] == 20.0  # 320 - 300
    assert step["launch_host_after_prev_graph_us"] == -260.0  # the host was ahead by 260
    assert step["graph_span_us"] == 110.0
    assert [op[0] for op in step["ops_between"]] == ["argmax", "Memcpy HtoD"]
    calls = {c["call"]: c for c in step["host_calls"]}
    assert calls["cudaMemcpyAsync"]["device"] == [("Memcpy HtoD", 10.0, 1.0)]
    assert calls["cudaGraphLaunch"]["device"][0] == ("embed", 20.0, 10.0)
