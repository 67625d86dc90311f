"""benchmarks/quant_gpu.py's step profile, the part that runs without a GPU: the marginal time of
each kernel (its end after the end of the one before it), which adds up to the whole span where
kernels overlap under PDL, and the device's idle time before each."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("quant_gpu", Path(__file__).parents[2] / "benchmarks" / "quant_gpu.py")
quant_gpu = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(quant_gpu)


def test_overlapping_kernels_add_up_to_the_span_and_gaps_count_as_idle():
    spans = [(0.0, 10.0, "proj"), (8.0, 12.0, "norm"),  # the norm starts early (PDL), ends 2 after
             (15.0, 30.0, "proj"),  # 3 idle before it
             (16.0, 31.0, "attn"), (31.0, 33.0, "norm")]
    out = quant_gpu.marginal_times(spans)
    assert out["norm"] == (pytest.approx(2.0 + 2.0), pytest.approx(0.0))
    assert out["proj"] == (pytest.approx(15.0), pytest.approx(3.0))
    assert out["attn"] == (pytest.approx(1.0), pytest.approx(0.0))
    total = sum(m + i for m, i in out.values())
    assert total == pytest.approx(33.0 - 10.0)  # everything after the first kernel's end


def test_spans_are_taken_in_the_order_they_end():
    spans = [(5.0, 9.0, "b"), (0.0, 4.0, "a")]
    assert quant_gpu.marginal_times(spans) == {"b": (4.0, 1.0)}


def kernel_event(name, ts, dur, grid=None):
    """A GPU kernel as torch.profiler's chrome trace writes it (kineto: "cat" kernel, µs, launch args)."""
    args = {"device": 0, "stream": 7, "correlation": 1, "registers per thread": 64, "shared memory": 33792,
            "block": [256, 1, 1]}
    if grid is not None:
        args["grid"] = grid
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur, "args": args}


def test_one_kernels_launches_of_different_grids_count_apart():
    trace = {"traceEvents": [
        kernel_event("_wq_gluon_ws_kernel", 100.0, 7.0, [96, 1, 2]),  # qkv
        kernel_event("_decode_kernel", 106.0, 5.0, [1, 8, 32]),
        kernel_event("_wq_gluon_ws_kernel", 110.0, 6.0, [64, 1, 4]),  # o_proj
        kernel_event("_wq_gluon_ws_kernel", 120.0, 7.0, [96, 1, 2]),  # qkv, next step
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0, "tid": 9,
         "ts": 118.0, "dur": 2.0, "args": {}},  # another stream's copy: not a kernel
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 1, "ts": 90.0, "dur": 3.0},
        kernel_event("_argmax_kernel", 127.0, 1.0),  # no grid in its args: the name alone
    ]}
    spans = quant_gpu.kernel_spans(trace)
    assert [label for _, _, label in spans] == [
        "_wq_gluon_ws_kernel grid 96x1x2", "_decode_kernel grid 1x8x32", "_wq_gluon_ws_kernel grid 64x1x4",
        "_wq_gluon_ws_kernel grid 96x1x2", "_argmax_kernel"]
    rows = {r["kernel"]: r for r in quant_gpu.grid_rows(spans, steps=2)}
    qkv, o = rows["_wq_gluon_ws_kernel grid 96x1x2"], rows["_wq_gluon_ws_kernel grid 64x1x4"]
    assert qkv["calls_a_step"] == pytest.approx(1.0) and qkv["us_a_step"] == pytest.approx(7.0)
    assert o["calls_a_step"] == pytest.approx(0.5)
    # marginal among kernels only: o ends at 116 after the attention's 111 (5); the second qkv
    # starts 4 after o's end (idle) and runs 7; the attention ends 4 after the first qkv
    assert o["marginal_us_a_step"] == pytest.approx(5.0 / 2)
    assert qkv["marginal_us_a_step"] == pytest.approx(7.0 / 2) and qkv["idle_before_us_a_step"] == pytest.approx(2.0)
    assert rows["_decode_kernel grid 1x8x32"]["marginal_us_a_step"] == pytest.approx(4.0 / 2)
    total = sum(r["marginal_us_a_step"] + r["idle_before_us_a_step"] for r in rows.values()) * 2
    assert total == pytest.approx(128.0 - 107.0)  # everything after the first kernel's end


def test_a_real_profiler_trace_parses(tmp_path):
    """torch.profiler's own export on this machine (CPU activity: no GPU kernels, so no spans)."""
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])  # CPU ops are there ...
    assert quant_gpu.kernel_spans(trace) == []  # ... and none of them is taken for a kernel
