"""What a run leaves behind: a side-by-side table for the terminal, summary.json with every
number, requests.jsonl with every request, and PNG plots (latency CDFs, throughput over time).
One column, one line per target, so ``loadtest`` and ``loadtest compare`` share all of it."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest.metrics import throughput_series
from loadtest.runner import RunResult
from loadtest.scenario import Scenario, Slo

NA = "n/a"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}" if x >= 0.1 else f"{x * 1000:.1f}"


def _pcts(d: dict[str, Any]) -> str:
    return " / ".join(_ms(d[p]) for p in ("p50", "p90", "p99")) if d["n"] else "-"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _shares(d: dict[str, float] | None) -> str:
    return NA if not d else ", ".join(f"{k} {v:.0%}" for k, v in d.items())


def _slo_text(slo: Slo) -> str:
    limits = [f"{name}<={v:g}s" for name, v in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s), ("E2E", slo.e2e_s))
              if v is not None]
    return ", ".join(limits) or "no limits: every success"


def _goodput(s: dict[str, Any]) -> str:
    g = s["goodput"]
    frac = "-" if g["fraction"] is None else f"{g['fraction']:.0%}"
    return f"{g['requests']} ({frac}), {_num(g['per_s'])}/s"


def _count(n: int) -> str:
    return str(n) if abs(n) < 1000 else f"{n / 1000:.1f}k" if abs(n) < 1_000_000 else f"{n / 1_000_000:.1f}M"


def _tier_tokens(s: dict[str, Any]) -> str:
    """Each tier's computed tokens, and in brackets those of them not spent on answers: ``small
    12.3k, large 4.1k (judge 2.0k, trial 300)``."""
    if s["cascade_tokens"] is None:
        return NA
    cells = []
    for tier, roles in s["cascade_tokens"].items():
        extra = ", ".join(f"{role} {_count(n)}" for role, n in roles.items() if role not in ("answer", "total"))
        cells.append(f"{tier} {_count(roles['total'])}" + (f" ({extra})" if extra else ""))
    return ", ".join(cells)


def _cached(s: dict[str, Any]) -> str:
    t = s["tokens"]
    frac = "" if t["cached_fraction"] is None else f" ({t['cached_fraction']:.0%})"
    return f"{t['cached']}/{t['prompt']}{frac}"


_ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("sent / ok / errors / cut off", lambda s: "{sent} / {ok} / {errors} / {cut_off}".format(**s["requests"])),
    ("stopped by", lambda s: s["stopped_by"]),
    ("duration s", lambda s: _num(s["duration_s"], ".1f")),
    ("TTFT p50/p90/p99 ms", lambda s: _pcts(s["ttft_s"])),
    ("TPOT p50/p90/p99 ms", lambda s: _pcts(s["tpot_s"])),
    ("E2E p50/p90/p99 ms", lambda s: _pcts(s["e2e_s"])),
    ("requests/s", lambda s: _num(s["throughput"]["requests_per_s"])),
    ("output tokens/s", lambda s: _num(s["throughput"]["output_tokens_per_s"], ".1f")),
    ("goodput", _goodput),
    ("cached / prompt tokens", _cached),
    ("errors by status", lambda s: ", ".join(f"{k} x{v}" for k, v in s["errors_by_status"].items()) or "-"),
    ("tier mix", lambda s: _shares(s["tiers"])),
    ("escalation rate", lambda s: NA if s["escalation_rate"] is None else f"{s['escalation_rate']:.0%}"),
    ("accuracy", lambda s: NA if s["accuracy"] is None else f"{s['accuracy']:.1%}"),
    ("tier tokens", _tier_tokens),
    ("worker share", lambda s: _shares(s["workers"])),
    ("harness processes, busiest", lambda s: "{}, {}".format(
        s["harness"]["processes"], "-" if s["harness"]["loop_busy"] is None else f"{s['harness']['loop_busy']:.0%}")),
]


def table(scenario: Scenario, summaries: dict[str, dict[str, Any]]) -> str:
    """Metrics down, targets across."""
    rows = [(label.replace("goodput", f"goodput ({_slo_text(scenario.slo)})"), [fn(s) for s in summaries.values()])
            for label, fn in _ROWS]
    tags = sorted({t for s in summaries.values() for t in s.get("tags", {})})
    for tag in tags:
        def cell(s: dict[str, Any], tag: str = tag) -> str:
            t = s.get("tags", {}).get(tag)
            if t is None:
                return "-"
            tiers = "" if t["tiers"] is None else f", tiers {_shares(t['tiers'])}"
            esc = "" if t["escalation_rate"] is None else f", escalated {t['escalation_rate']:.0%}"
            acc = "" if t["accuracy"] is None else f", accuracy {t['accuracy']:.0%}"
            return f"{t['ok']}/{t['sent']} ok, E2E p50 {_ms(t['e2e_p50_s'])} ms{tiers}{esc}{acc}"
        rows.append((f"tag {tag}", [cell(s) for s in summaries.values()]))
    header = ("", list(summaries))
    widths = [max(len(r[0]) for r in [header, *rows])]
    widths += [max(len(r[1][i]) for r in [header, *rows]) for i in range(len(summaries))]
    lines = [f"scenario {scenario.name} (seed {scenario.seed}, {scenario.workload.kind}, {scenario.arrival.kind})"]
    for label, cells in [header, *rows]:
        cells = [c.rjust(w) for c, w in zip(cells, widths[1:], strict=True)]
        lines.append("  ".join([label.ljust(widths[0]), *cells]))
        if label == "":
            lines.append("-" * (sum(widths) + 2 * len(cells)))
    return "\n".join(lines)


def write(out_dir: Path, scenario: Scenario, results: list[RunResult]) -> list[Path]:
    """summary.json, requests.jsonl and the plots in ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "scenario": scenario.to_dict(), "runs": {r.target.name: r.summary() for r in results}}
    paths = [out_dir / "summary.json", out_dir / "requests.jsonl"]
    paths[0].write_text(json.dumps(summary, indent=2) + "\n")
    with paths[1].open("w") as f:
        for r in results:
            for rec in r.records:
                f.write(json.dumps({"target": r.target.name, **rec.to_dict()}) + "\n")
    return paths + plot(out_dir, results)


def plot(out_dir: Path, results: list[RunResult]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    cdf, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    latencies = (("TTFT", lambda r: r.ttft_s), ("TPOT", lambda r: r.tpot_s), ("E2E latency", lambda r: r.e2e_s))
    for ax, (label, get) in zip(axes, latencies, strict=True):
        for res in results:
            xs = sorted(v * 1000 for rec in res.records if rec.ok and (v := get(rec)) is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=res.target.name)
        ax.set(title=f"{label} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    cdf.tight_layout()
    thr, (ax_req, ax_tok) = plt.subplots(1, 2, figsize=(12, 4.2))
    for res in results:
        series = throughput_series(res.records)
        ax_req.plot(series["t_s"], series["requests_per_s"], marker=".", label=res.target.name)
        ax_tok.plot(series["t_s"], series["output_tokens_per_s"], marker=".", label=res.target.name)
    ax_req.set(title="completed requests per second", xlabel="seconds into the run", ylabel="requests/s")
    ax_tok.set(title="output tokens per second", xlabel="seconds into the run", ylabel="tokens/s")
    for ax in (ax_req, ax_tok):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    thr.tight_layout()
    paths = [out_dir / "latency_cdf.png", out_dir / "throughput.png"]
    cdf.savefig(paths[0], dpi=100)
    thr.savefig(paths[1], dpi=100)
    plt.close(cdf)
    plt.close(thr)
    return paths
