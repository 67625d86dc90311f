"""What ``kvcascade cascade calibrate`` reports (kvcascade/calibrate.py replays and picks): the
held-out frontiers of the families and of groups of them, how well each score separates right
from wrong answers (AUROC), the table in ``calibration.md``, the plot, and the calibrated cascade
file with the prompt router or stacked confidence it picked beside it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import yaml

from router.stacked_confidence import OWN_MEASURES


def frontier(points: list[dict]) -> list[dict]:
    """The points no other point beats on both accuracy and compute, cheapest first."""
    out: list[dict] = []
    for p in sorted(points, key=lambda p: (p["compute"], -p["accuracy"])):
        if not out or p["accuracy"] > out[-1]["accuracy"]:
            out.append(p)
    return out


def auroc(scores: Sequence[float], right: Sequence[bool], higher_is_surer: bool = True) -> float | None:
    """The chance that a right answer scores surer than a wrong one (ties: half); None without both."""
    pos = [s if higher_is_surer else -s for s, r in zip(scores, right) if r]
    neg = [s if higher_is_surer else -s for s, r in zip(scores, right) if not r]
    if not pos or not neg:
        return None
    return sum((p > q) + 0.5 * (p == q) for p in pos for q in neg) / (len(pos) * len(neg))


def separation(runs: dict, idx: Sequence[int]) -> dict[str, float | None]:
    """How well each score of the first tier's answers tells right from wrong on ``idx`` (AUROC);
    an answer without a score counts as the least sure."""
    answers = [runs["tiers"][0]["answers"][k] for k in idx]
    right = [bool(a["correct"]) for a in answers]
    out = {}
    for m in OWN_MEASURES:
        if any(a["own"].get(m) is not None for a in answers):
            worst = -math.inf if OWN_MEASURES[m].higher_is_surer else math.inf
            out[m] = auroc([worst if a["own"].get(m) is None else a["own"][m] for a in answers], right,
                           OWN_MEASURES[m].higher_is_surer)
    if any(a.get("route") is not None for a in answers):
        out["route"] = auroc([a.get("route") or 0.0 for a in answers], right)
    return out


# Groups of families, each one more than the one before: what the stacked confidence adds.
GROUPS = {
    "own measures and judges": lambda family: "route + " not in family and "stacked" not in family,
    "+ the prompt router in front": lambda family: "stacked" not in family,
    "stacked confidence (no router in front)": lambda family: "stacked" in family and "route + " not in family,
    "everything (+ stacked, + router in front of it)": lambda family: True,
}
LEVELS = (0.85, 0.90, 0.95, 0.98, 1.00)


def frontiers(result: dict) -> dict[str, dict[float, dict | None]]:
    """Per group of families, the cheapest held-out point reaching each share of the last tier's
    held-out accuracy (what a perfectly calibrated pick could get; None: none reaches it)."""
    last = result["tiers"][-1]["accuracy"]["held_out"]
    out = {}
    for group, member in GROUPS.items():
        points = [p for family, curve in result["curves"].items() if member(family) for p in curve]
        if not points:
            continue
        out[group] = {level: min((p for p in points if p["accuracy"] >= level * last - 1e-12),
                                 key=lambda p: (p["compute"], -p["accuracy"]), default=None) for level in LEVELS}
    return out


def router_file(written: Path, tier: str) -> Path:
    """Where the calibrated file's prompt router for ``tier`` is written: beside it."""
    return written.with_name(f"{written.stem}.{tier}.router.json")


def stacked_file(written: Path, tier: str) -> Path:
    """Where the calibrated file's stacked confidence for ``tier`` is written: beside it."""
    return written.with_name(f"{written.stem}.{tier}.stacked.json")


def calibrated_yaml(source: Path, result: dict, written: Path | None = None) -> str:
    """The cascade file with each tier's picked setting in place of its decision keys (a picked
    prompt router named as ``router_file(written, tier)``, a stacked confidence as ``stacked_file``)."""
    data = yaml.safe_load(source.read_text())
    for tier, setting in zip(data["tiers"], result["picked"]["calibration"]["settings"]):
        for key in ("measure", "threshold", "judge", "route", "stacked"):
            tier.pop(key, None)
        tier["measure"] = setting["measure"]
        if setting["threshold"] is not None and math.isfinite(setting["threshold"]):
            tier["threshold"] = round(setting["threshold"], 6)
        elif setting["judge_measure"] is None:  # never accepted on its own: the next tier always answers,
            tier["measure"], tier["threshold"] = "min_prob", 1.01  # a bar no measure's file can write as inf
        if tier["measure"] == "stacked":
            tier["stacked"] = {"file": stacked_file(written or source, tier.get("name") or tier["model"]).name}
        if setting["judge_measure"] is not None:
            judge = {"measure": setting["judge_measure"], "threshold": round(setting["judge_threshold"], 6)}
            if setting["floor"] is not None:
                judge["floor"] = round(setting["floor"], 6)
            tier["judge"] = judge
        if setting.get("route_threshold") is not None:
            name = tier.get("name") or tier["model"]
            tier["route"] = {"file": router_file(written or source, name).name,
                             "threshold": round(setting["route_threshold"], 6)}
    held = result["picked"]["held_out"]
    head = (f"# Calibrated by `kvcascade cascade calibrate` from {source.name}: target "
            f"{result['target']:.0%} of the last tier's accuracy on {result['calibration_tasks']} tasks;\n"
            f"# on {result['held_out_tasks']} held-out tasks: accuracy {held['accuracy']:.1%} (last tier alone "
            f"{result['tiers'][-1]['accuracy']['held_out']:.1%}), compute {held['compute']:.2f}x, last tier "
            f"generating for {held['last_tier_share']:.0%}.\n")
    return head + yaml.safe_dump(data, sort_keys=False)


def table(result: dict) -> str:
    tiers = result["tiers"]
    last = tiers[-1]["accuracy"]["held_out"]
    lines = [f"target: {result['target']:.0%} of the last tier's accuracy; {result['calibration_tasks']} "
             f"calibration tasks, {result['held_out_tasks']} held out", "",
             "| held-out | accuracy | vs last tier | last tier generates | judged | compute vs last tier |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for t in tiers:
        acc = t["accuracy"]["held_out"]
        lines.append(f"| {t['name']} alone | {acc:.1%} | {acc / last:.0%} | | | {t['compute_alone']:.2f}x |")

    def row(name: str, p: dict) -> str:
        return (f"| {name} | {p['accuracy']:.1%} | {p['accuracy'] / last:.0%} | {p['last_tier_share']:.0%} | "
                f"{p['judged']:.0%} | {p['compute']:.2f}x |")

    lines.append(row("**picked**", result["picked"]["held_out"]))
    lines.append(row("oracle (knows which answers are right)", result["oracle"]))
    if "oracle_before" in result:
        lines.append(row("oracle deciding before any tier runs", result["oracle_before"]))
    for name, fam in sorted(result["per_family"].items(), key=lambda kv: kv[1]["calibration"]["compute"]):
        lines.append(row(name, fam["held_out"]))
    lines += ["", "The best of each group of families on the held-out split itself (compute, and the share "
              "the last tier generates):", "",
              "| accuracy vs last tier | " + " | ".join(f"{level:.0%}" for level in LEVELS) + " |",
              "| --- |" + " ---: |" * len(LEVELS)]
    for group, best in frontiers(result).items():
        cells = [f"{p['compute']:.2f}x ({p['last_tier_share']:.0%})" if p else "" for p in best.values()]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    if result.get("auroc"):
        lines += ["", "AUROC of the first tier's scores (right against wrong answers), calibration "
                  "(cross-fitted where fit) / held out: " + ", ".join(
                      f"{m} {result['auroc']['calibration'].get(m) or 0:.3f} / {v or 0:.3f}"
                      for m, v in result["auroc"]["held_out"].items())]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)  # more curves than the default ten colours
    # One curve per own measure and per judge measure; the combined families, and those with a
    # prompt router in front, each as one frontier.
    curves = {k: v for k, v in result["curves"].items() if " + " not in k}
    for label, member in (("own + judge (best of every pair)", lambda k: not k.startswith("route + ")),
                          ("prompt router + own or judge (best)",
                           lambda k: k.startswith("route + ") and "stacked" not in k),
                          ("prompt router + stacked", lambda k: k.startswith("route + ") and "stacked" in k)):
        combined = [p for k, v in result["curves"].items() if " + " in k and member(k) for p in v]
        if combined:
            curves[label] = frontier(combined)
    for name, points in sorted(curves.items()):
        ax.plot([p["compute"] for p in points], [p["accuracy"] for p in points], marker=".", label=name,
                linewidth=2.5 if "stacked" in name else 1.5)
    o = result["oracle"]
    ax.scatter([o["compute"]], [o["accuracy"]], marker="D", color="g", label="oracle router", zorder=3)
    if "oracle_before" in result:
        o = result["oracle_before"]
        ax.scatter([o["compute"]], [o["accuracy"]], marker="D", facecolors="none", edgecolors="g",
                   label="oracle deciding before any tier runs", zorder=3)
    for t in result["tiers"]:
        ax.scatter([t["compute_alone"]], [t["accuracy"]["held_out"]], marker="s", color="k")
        ax.annotate(f"{t['name']} alone", (t["compute_alone"], t["accuracy"]["held_out"]), fontsize=8)
    held = result["picked"]["held_out"]
    ax.scatter([held["compute"]], [held["accuracy"]], marker="*", s=160, color="r", label="picked", zorder=3)
    ax.set(xlabel="compute relative to the last tier alone", ylabel="accuracy (held-out)",
           title="cascade: accuracy against compute")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
