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
