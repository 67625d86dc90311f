"""How cheap can a two-tier cascade keep a target share of the last tier's accuracy on these tasks,
whatever its confidence measure? Bounds for issue 16, on the answers `kvcascade cascade calibrate`
collected (its runs.json), on the seeded held-out half the command reports on.

    python benchmarks/cascade_bounds.py --runs runs/calibrate/runs.json [--target 0.98] [--out FILE]

Compute is 2 x parameters x (prompt + generated tokens) of every tier that runs, against the last
tier alone, as calibration counts it (kvcascade/calibrate.py). Each bound, and what it assumes known:

- ``oracle``: which tier is right on each task; the first tier runs first, and just enough of the
  tasks only the last tier gets right are escalated to reach the target.
- ``oracle, before the first tier runs``: the same, known from the prompt (those tasks skip the
  first tier).
- ``perfect detector``: which of the first tier's answers are wrong, but not whether the last tier
  gets those right: the first tier answers every task and a share f of its wrong answers is
  escalated (any of them, so in expectation), f the least that reaches the target.
- ``perfect prompt router``: the same, known from the prompt (the escalated share skips the first
  tier).
- ``kinds + perfect detector``: the same, after sending whole task kinds (what a prompt says it
  asks for: a capital, a unit conversion, ...) straight to the last tier; the best set of kinds.
- ``kinds + sum_logprob``: a measure that exists: whole kinds to the last tier, the rest answered
  by the first tier unless its draft's sum_logprob is below a threshold; kinds and threshold chosen
  on the calibration half, reported on the held-out half (and, optimistically, chosen on the
  held-out half itself).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcascade import calibrate as cal  # noqa: E402


def escalate_share(runs: dict, idx: list[int], target: float, pool: str, direct: frozenset[str] = frozenset()) -> dict | None:
    """The cheapest point reaching ``target`` when a share of the ``pool`` tasks ("wrong": the first
    tier's wrong answers; "rescued": those the last tier gets right) goes to the last tier, any of
    them (so in expectation), and the tasks of the ``direct`` kinds go there straight. The first tier
    runs on every other task, and also on the pool's escalated tasks unless ``pool`` ends in
    " before" (the pool known before it runs). None if escalating the whole pool misses the target."""
    small, large = runs["tiers"]
    goal = target * cal.accuracy(runs, 1, idx) * len(idx)
    before = pool.endswith(" before")
    right = compute = direct_n = 0.0
    pool_cost = gain = pool_n = 0.0
    for k in idx:
        s, g = small["answers"][k]["correct"], large["answers"][k]["correct"]
        if runs["tasks"][k]["kind"] in direct:
            right += g
            compute += cal._cost(large, k)
            direct_n += 1
            continue
        right += s
        compute += cal._cost(small, k)
        if not s and (g or pool.startswith("wrong")):
            pool_n += 1
            gain += g
            pool_cost += cal._cost(large, k) - (cal._cost(small, k) if before else 0)
    if right >= goal:
        f = 0.0
    elif right + gain < goal:
        return None
    else:
        f = (goal - right) / gain
    return {"accuracy": (right + f * gain) / len(idx), "compute": (compute + f * pool_cost) / cal._last_alone(runs, idx),
            "last_tier_share": (direct_n + f * pool_n) / len(idx), "escalated_share_of_pool": f,
            "direct": sorted(direct)}


def kinds_sum(runs: dict, idx: list[int], direct: frozenset[str], threshold: float) -> dict:
    """Whole ``direct`` kinds to the last tier; the first tier's drafts below ``threshold``
    (sum_logprob) escalated."""
    small, large = runs["tiers"]
    right = compute = reached = 0.0
    for k in idx:
        s = small["answers"][k]
        if runs["tasks"][k]["kind"] not in direct:
            compute += cal._cost(small, k)
            conf = s["own"]["sum_logprob"]
            if conf is not None and conf >= threshold:
                right += s["correct"]
                continue
        compute += cal._cost(large, k)
        right += large["answers"][k]["correct"]
        reached += 1
    return {"accuracy": right / len(idx), "compute": compute / cal._last_alone(runs, idx),
            "last_tier_share": reached / len(idx), "direct": sorted(direct), "threshold": threshold}


def _cheapest_threshold(runs: dict, idx: list[int], direct: frozenset[str], goal: float) -> float | None:
    """The highest sum_logprob threshold at which ``direct`` + escalation below it reaches ``goal``
    right answers: drafts escalated least sure first, drafts of equal score together, drafts with
    no score always (as kinds_sum does). None if escalating every draft misses ``goal``."""
    small, large = runs["tiers"]
    right = 0
    rest = []
    for k in idx:
        if runs["tasks"][k]["kind"] in direct:
            right += large["answers"][k]["correct"]
            continue
        conf = small["answers"][k]["own"]["sum_logprob"]
        if conf is None:
            right += large["answers"][k]["correct"]
        else:
            rest.append((conf, k))
            right += small["answers"][k]["correct"]
    rest.sort()
    i = 0
    while right < goal - 1e-9:
        if i == len(rest):
            return None
        conf = rest[i][0]
        while i < len(rest) and rest[i][0] == conf:
            k = rest[i][1]
            right += large["answers"][k]["correct"] - small["answers"][k]["correct"]
            i += 1
    return rest[i][0] if i < len(rest) else float("inf")


def _kind_sets(runs: dict):
    """Every set of task kinds (the empty one first) that could be sent straight to the last tier."""
    kinds = sorted({t["kind"] for t in runs["tasks"]})
    for n in range(len(kinds) + 1):
        for direct in itertools.combinations(kinds, n):
            yield frozenset(direct)


def _cheapest(points) -> dict | None:
    return min((p for p in points if p), key=lambda p: p["compute"], default=None)


def best_kinds_sum(runs: dict, idx: list[int], target: float) -> dict | None:
    """The cheapest (kinds, threshold) reaching ``target`` of the last tier's accuracy on ``idx``."""
    goal = target * cal.accuracy(runs, 1, idx) * len(idx)
    thresholds = ((direct, _cheapest_threshold(runs, idx, direct, goal)) for direct in _kind_sets(runs))
    return _cheapest(kinds_sum(runs, idx, direct, t) for direct, t in thresholds if t is not None)


def best_escalate_share(runs: dict, idx: list[int], target: float, pool: str) -> dict | None:
    """escalate_share with the best set of kinds sent straight to the last tier."""
    return _cheapest(escalate_share(runs, idx, target, pool, direct) for direct in _kind_sets(runs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, type=Path, help="runs.json of `kvcascade cascade calibrate`")
    ap.add_argument("--target", type=float, default=0.98)
    ap.add_argument("--seed", type=int, default=0, help="the calibration command's split seed")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    runs = json.loads(args.runs.read_text())
    assert len(runs["tiers"]) == 2, "two tiers"
    calib, held = cal.halves(len(runs["tasks"]), 0.5, args.seed)
    picked = best_kinds_sum(runs, calib, args.target)
    rows = {
        "oracle": escalate_share(runs, held, args.target, "rescued"),
        "oracle, before the first tier runs": escalate_share(runs, held, args.target, "rescued before"),
        "perfect detector": escalate_share(runs, held, args.target, "wrong"),
        "perfect prompt router": escalate_share(runs, held, args.target, "wrong before"),
        "kinds + perfect detector": best_escalate_share(runs, held, args.target, "wrong"),
        "kinds + sum_logprob, chosen on the held-out half": best_kinds_sum(runs, held, args.target),
        "kinds + sum_logprob, chosen on the calibration half": picked and kinds_sum(
            runs, held, frozenset(picked["direct"]), picked["threshold"]),
    }
    large = cal.accuracy(runs, 1, held)
    print(f"held-out half: {len(held)} tasks; last tier alone {large:.1%}, first tier alone "
          f"{cal.accuracy(runs, 0, held):.1%} at {cal.compute_alone(runs, 0, held):.2f}x; target {args.target:.0%}")
    print(f"{'bound':52s} {'of large':>8s} {'large runs':>10s} {'compute':>8s}  kinds sent to large")
    for name, p in rows.items():
        if p is None:
            print(f"{name:52s} {'(misses the target)':>30s}")
            continue
        print(f"{name:52s} {p['accuracy'] / large:8.1%} {p['last_tier_share']:10.1%} {p['compute']:7.2f}x  "
              f"{', '.join(p.get('direct', [])) or '-'}")
    if args.out:
        args.out.write_text(json.dumps({"runs": str(args.runs), "target": args.target, "seed": args.seed,
                                        "held_out": len(held), "large_accuracy": large, "bounds": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
