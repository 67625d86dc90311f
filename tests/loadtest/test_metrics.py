"""The metric math on fixed inputs: percentiles, TPOT, goodput, the summary, throughput bins."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loadtest.metrics import CUT_OFF, RequestRecord, goodput, meets, percentile, summarize, throughput_series
from loadtest.scenario import Slo


def rec(i: int = 0, status: str = "ok", ttft: float | None = 0.1, e2e: float | None = 0.5, out: int = 5,
        start: float = 0.0, **kw) -> RequestRecord:
    return RequestRecord(index=i, session=i, turn=0, tag=kw.pop("tag", ""), start_s=start, status=status,
                         ttft_s=ttft, e2e_s=e2e, output_tokens=out, **kw)


def test_percentiles_of_fixed_values() -> None:
    xs = [7, 1, 10, 3, 2, 9, 4, 6, 5, 8]  # unsorted on purpose
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 10
    assert percentile([4.2], 99) == 4.2
    assert percentile([], 50) is None


def test_percentiles_match_numpy() -> None:
    rng = random.Random(0)
    for n in (2, 3, 17, 1000):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (50, 90, 99, 99.9):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_tpot_is_time_per_token_after_the_first() -> None:
    assert rec(ttft=0.2, e2e=1.0, out=5).tpot_s == pytest.approx(0.2)
    assert rec(ttft=0.2, e2e=0.2, out=1).tpot_s is None  # one token: no time between tokens
    assert rec(status="UNAVAILABLE", ttft=None, e2e=None).tpot_s is None


def test_goodput_counts_requests_meeting_every_limit() -> None:
    records = [
        rec(0, ttft=0.1, e2e=0.5, out=5),  # tpot 0.1
        rec(1, ttft=0.5, e2e=0.9, out=5),  # ttft too slow for 0.2
        rec(2, ttft=0.1, e2e=2.1, out=5),  # tpot 0.5: too slow for 0.2
        rec(3, ttft=0.1, e2e=0.1, out=1),  # no tpot: nothing to miss
        rec(4, status="HTTP 503", ttft=None, e2e=None, out=0),
        rec(5, status=CUT_OFF, ttft=None, e2e=None, out=0),  # not completed: not counted at all
    ]
    slo = Slo(ttft_s=0.2, tpot_s=0.2)
    assert [meets(r, slo) for r in records] == [True, False, False, True, False, False]
    assert goodput(records, slo, duration_s=4.0) == {"requests": 2, "fraction": 2 / 5, "per_s": 0.5}
    assert goodput(records, Slo(), 4.0)["fraction"] == 4 / 5  # no limits: every success
    assert goodput(records, Slo(ttft_s=1e-6), 4.0)["fraction"] == 0
    assert goodput(records, Slo(ttft_s=60, tpot_s=60, e2e_s=60), 4.0)["requests"] == 4
    assert goodput(records, Slo(e2e_s=1.0), 4.0)["requests"] == 3
    assert goodput([], slo, 1.0)["fraction"] is None


def test_summary_adds_up() -> None:
    records = [
        rec(0, prompt_tokens=100, cached_tokens=0, worker_id="w1", tag="easy"),
        rec(1, prompt_tokens=100, cached_tokens=96, worker_id="w1", tag="easy"),
        rec(2, prompt_tokens=50, cached_tokens=32, worker_id="w2", tag="hard"),
        rec(3, status="UNAVAILABLE", ttft=None, e2e=None, out=0, tag="hard"),
        rec(4, status="UNAVAILABLE", ttft=None, e2e=None, out=0, tag="hard"),
        rec(5, status="HTTP 429", ttft=None, e2e=None, out=0, tag="easy"),
        rec(6, status=CUT_OFF, ttft=None, e2e=None, out=0, tag="easy"),
    ]
    s = summarize(records, Slo(), duration_s=2.0)
    assert s["requests"] == {"sent": 7, "ok": 3, "errors": 3, "cut_off": 1}
    assert s["errors_by_status"] == {"HTTP 429": 1, "UNAVAILABLE": 2}
    assert s["tokens"] == {"prompt": 250, "cached": 128, "output": 15, "cached_fraction": 128 / 250,
                           "requests_with_cache_hits": 2}
    assert s["throughput"] == {"requests_per_s": 1.5, "output_tokens_per_s": 7.5, "prompt_tokens_per_s": 125}
    assert s["ttft_s"]["n"] == 3 and s["ttft_s"]["p50"] == pytest.approx(0.1)
    assert s["workers"] == {"w1": pytest.approx(2 / 3), "w2": pytest.approx(1 / 3)}
    assert s["tiers"] is None and s["escalation_rate"] is None  # no cascade reported: n/a
    assert s["accuracy"] is None and s["cascade_tokens"] is None  # nothing scored, no tier usage: n/a
    assert s["tags"]["easy"]["sent"] == 4 and s["tags"]["easy"]["ok"] == 2 and s["tags"]["hard"]["ok"] == 1


def test_tier_mix_and_escalation_rate_when_reported() -> None:
    records = [rec(0, tier="small", escalated=False), rec(1, tier="small", escalated=False),
               rec(2, tier="large", escalated=True), rec(3, tier="large", escalated=True)]
    s = summarize(records, Slo(), 1.0)
    assert s["tiers"] == {"large": 0.5, "small": 0.5}
    assert s["escalation_rate"] == 0.5


def test_accuracy_and_cascade_tokens_of_the_successful_requests() -> None:
    records = [
        rec(0, tag="add", correct=True, tier_tokens={"small": {"answer": 40}, "large": {"judge": 35}}),
        rec(1, tag="add", correct=False, tier_tokens={"small": {"trial": 30}, "large": {"judge": 5, "answer": 20}}),
        rec(2, tag="fact", correct=True),  # scored, but no cascade answered
        rec(3, tag="fact", tier_tokens={"large": {"answer": 7}}),  # not scored
        rec(4, tag="fact", status="UNAVAILABLE", ttft=None, e2e=None, correct=False,
            tier_tokens={"small": {"answer": 1000}}),  # a failure counts in neither
    ]
    s = summarize(records, Slo(), 1.0)
    assert s["accuracy"] == pytest.approx(2 / 3)
    assert s["cascade_tokens"] == {"small": {"answer": 40, "trial": 30, "total": 70},
                                   "large": {"answer": 27, "judge": 40, "total": 67}}
    assert list(s["cascade_tokens"]) == ["small", "large"]  # the order first seen
    assert s["tags"]["add"]["accuracy"] == 0.5 and s["tags"]["fact"]["accuracy"] == 1.0


def test_throughput_series_bins() -> None:
    # Request 0 streams 4 tokens from 0.5 s to 1.5 s, request 1 two tokens from 1.5 s to 2.5 s.
    records = [rec(0, start=0.0, ttft=0.5, e2e=1.5, out=4), rec(1, start=1.0, ttft=0.5, e2e=1.5, out=2),
               rec(2, status="UNAVAILABLE", start=0.2, ttft=None, e2e=None, out=0)]
    s = throughput_series(records, bin_s=1.0)
    assert s["t_s"] == [0.5, 1.5, 2.5]
    assert s["requests_per_s"] == [0, 1, 1]
    assert s["output_tokens_per_s"] == pytest.approx([2, 2 + 1, 1])
    assert throughput_series([], 1.0)["t_s"] == []
