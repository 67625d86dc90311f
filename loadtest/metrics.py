"""What one request measured, and the run's numbers computed from those records.

    TTFT   send -> first streamed token (client side, so it includes the network and queueing)
    TPOT   (E2E - TTFT) / (output tokens - 1): time per output token after the first
    E2E    send -> last message
    goodput  completed requests that succeeded and met every SLO limit set, as a fraction of the
             completed ones and per second of the run

Requests still running when the run's time bound hits are cancelled and counted as cut off:
they are neither errors nor part of the latency, throughput or goodput figures.

    accuracy        of the scored answers (a tasks workload), the share that were right
    cascade tokens  per tier, the tokens it computed (prompt not served from its cache, plus
                    completion) by role: answer, trial (an escalated attempt thrown away) or
                    judge (scoring the draft of the tier before it), and in total
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.scenario import Slo

OK = "ok"
CUT_OFF = "cut_off"


@dataclass
class RequestRecord:
    index: int  # order of sending
    session: int
    turn: int
    tag: str
    start_s: float  # seconds since the run started
    status: str = OK  # ok | cut_off | a gRPC code name | "HTTP 503" | connection_error | ...
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None  # from usage; None when the server sent none
    cached_tokens: int | None = None
    output_tokens: int = 0
    finish_reason: str = ""
    worker_id: str | None = None  # set by a router
    server_ttft_s: float | None = None  # the worker's own TTFT, from its arrival to its first token (via a router)
    tier: str | None = None  # set by a cascade (absent today: reported n/a)
    escalated: bool | None = None
    # A cascade's tier_usage: per tier, tokens computed by role ({"small": {"answer": 40}, "large": {"judge": 35}}).
    tier_tokens: dict[str, dict[str, int]] | None = None
    correct: bool | None = None  # the answer scored against a labelled task's; None: not a task

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float | None:
        return None if self.e2e_s is None else self.start_s + self.e2e_s

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tpot_s": self.tpot_s}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    return {"n": len(values), "mean": sum(values) / len(values) if values else None,
            "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "max": max(values) if values else None}


def meets(r: RequestRecord, slo: Slo) -> bool:
    """Succeeded and within every limit the SLO sets."""
    if not r.ok:
        return False
    if slo.ttft_s is not None and (r.ttft_s is None or r.ttft_s > slo.ttft_s):
        return False
    # An answer of one token has no TPOT, so it has none to miss.
    if slo.tpot_s is not None and r.tpot_s is not None and r.tpot_s > slo.tpot_s:
        return False
    return slo.e2e_s is None or (r.e2e_s is not None and r.e2e_s <= slo.e2e_s)


def goodput(records: Sequence[RequestRecord], slo: Slo, duration_s: float) -> dict[str, float | int | None]:
    completed = [r for r in records if r.status != CUT_OFF]
    good = sum(meets(r, slo) for r in completed)
    return {"requests": good, "fraction": good / len(completed) if completed else None,
            "per_s": good / duration_s if duration_s > 0 else None}


def _share(counts: Counter[str]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in sorted(counts.items())}


def summarize(records: Sequence[RequestRecord], slo: Slo, duration_s: float) -> dict[str, Any]:
    """The run's numbers; what the server never reported (tiers, workers) is None."""
    ok = [r for r in records if r.ok]
    cut = sum(r.status == CUT_OFF for r in records)
    errors = Counter(r.status for r in records if not r.ok and r.status != CUT_OFF)
    workers = Counter(r.worker_id for r in ok if r.worker_id)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    output = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    summary: dict[str, Any] = {
        "requests": {"sent": len(records), "ok": len(ok), "errors": sum(errors.values()), "cut_off": cut},
        "errors_by_status": dict(sorted(errors.items())),
        "duration_s": duration_s,
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "throughput": {"requests_per_s": per_s(len(ok)), "output_tokens_per_s": per_s(output),
                       "prompt_tokens_per_s": per_s(prompt)},
        "goodput": {"slo": dataclasses.asdict(slo), **goodput(records, slo, duration_s)},
        "tokens": {"prompt": prompt, "cached": cached, "output": output,
                   "cached_fraction": cached / prompt if prompt else None,
                   "requests_with_cache_hits": sum((r.cached_tokens or 0) > 0 for r in ok)},
        **_cascade(ok),
        "accuracy": _accuracy(ok),
        "cascade_tokens": _cascade_tokens(ok),
        "workers": _share(workers) if workers else None,
    }
    tags = sorted({r.tag for r in records if r.tag})
    if tags:
        summary["tags"] = {t: _tag_summary([r for r in records if r.tag == t]) for t in tags}
    return summary


def _cascade(ok: list[RequestRecord]) -> dict[str, Any]:
    """Tier mix and escalation rate of the successful requests; None when no answer said."""
    tiers = Counter(r.tier for r in ok if r.tier)
    with_escalation = [r for r in ok if r.escalated is not None]
    rate = sum(bool(r.escalated) for r in with_escalation) / len(with_escalation) if with_escalation else None
    return {"tiers": _share(tiers) if tiers else None, "escalation_rate": rate}


def _accuracy(ok: list[RequestRecord]) -> float | None:
    """The share of the scored answers that were right; None when none was scored (no tasks)."""
    scored = [r.correct for r in ok if r.correct is not None]
    return sum(scored) / len(scored) if scored else None


def _cascade_tokens(ok: list[RequestRecord]) -> dict[str, dict[str, int]] | None:
    """Per tier (in the order first seen), the tokens computed by role and in total: what the
    answers cost, trials and judging included. None when no answer said."""
    by_tier: dict[str, Counter[str]] = {}
    for r in ok:
        for tier, roles in (r.tier_tokens or {}).items():
            by_tier.setdefault(tier, Counter()).update(roles)
    return {tier: {**dict(sorted(c.items())), "total": c.total()} for tier, c in by_tier.items()} or None


def _tag_summary(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    return {"sent": len(records), "ok": len(ok),
            "e2e_p50_s": percentile([r.e2e_s for r in ok if r.e2e_s is not None], 50), **_cascade(ok),
            "accuracy": _accuracy(ok)}


def throughput_series(records: Sequence[RequestRecord], bin_s: float = 1.0) -> dict[str, list[float]]:
    """Completed requests and output tokens per second, in bins of ``bin_s`` over the run. A
    request's tokens are spread evenly from its first token to its end."""
    ok = [r for r in records if r.ok and r.end_s is not None]
    if not ok:
        return {"t_s": [], "requests_per_s": [], "output_tokens_per_s": []}
    n = max(1, math.ceil(max(r.end_s for r in ok) / bin_s))
    reqs, toks = [0.0] * n, [0.0] * n
    for r in ok:
        reqs[min(n - 1, int(r.end_s / bin_s))] += 1
        first = r.start_s + (r.ttft_s or 0.0)
        _spread(toks, first, r.end_s, r.output_tokens, bin_s)
    return {"t_s": [(i + 0.5) * bin_s for i in range(n)], "requests_per_s": [x / bin_s for x in reqs],
            "output_tokens_per_s": [x / bin_s for x in toks]}


def _spread(bins: list[float], t0: float, t1: float, amount: float, bin_s: float) -> None:
    if t1 <= t0:
        bins[min(len(bins) - 1, int(t1 / bin_s))] += amount
        return
    for i in range(int(t0 / bin_s), min(len(bins) - 1, int(t1 / bin_s)) + 1):
        overlap = min(t1, (i + 1) * bin_s) - max(t0, i * bin_s)
        bins[i] += amount * max(0.0, overlap) / (t1 - t0)
