"""Does the small tier's agreement with itself tell its right answers from its wrong ones, and does it
pay for its samples? A probe for issue 16 (self-consistency: MoT cascades, Yue et al. 2023), on the
answers `kvcascade cascade calibrate` collected.

    python benchmarks/cascade_consistency.py --runs runs/calibrate/runs.json [--samples 4] \
        [--temperature 0.7] [--cache /tmp/samples.json] [--out docs/results/....json]

1. Samples: the first tier's model draws ``--samples`` more answers to every task (temperature
   sampling, a seed per task and draw, the same chat prompt and token cap as the collected greedy
   answer), as the router would ask for them beside the greedy draft: the prompt's full KV blocks
   are then in the prefix cache, so a sample costs its own tokens and the prompt's last partial
   block (at least one token).
2. Scores: ``agree``, the share of the samples whose normalised reply (loadtest/tasks.py) is the
   greedy reply's; ``agree + sum``, the same with the draft's own ``sum_logprob`` breaking ties
   (agree + sum_logprob / 1000). Beside them: ``sum_logprob`` alone (no samples to pay for).
3. Replay, two tiers: a task the prompt router skips (its score below r) goes to the last tier;
   else the first tier answers (plus its samples where the score needs them) and is accepted when
   its score reaches t, else the last tier answers too. Compute is 2 x parameters x tokens against
   the last tier alone, as calibration counts it. Thresholds are picked on the calibration half
   (the seeded halves of the calibration command, routers cross-fitted there) for the target, and
   reported on the held-out half; also each score's held-out frontier (the cheapest point at each
   share of the last tier's accuracy), and the AUROC of each score against the draft's correctness.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcascade import calibrate as cal  # noqa: E402
from kvcascade.calibration_report import auroc  # noqa: E402
from loadtest.tasks import normalise  # noqa: E402


def draw_samples(runs: dict, k: int, temperature: float, seed: int) -> list[list[dict]]:
    """``k`` sampled answers of the first tier to every task: [{text, completion_tokens}, ...]."""
    import torch

    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    tier = runs["tiers"][0]
    engine = LLMEngine(EngineConfig(model=tier["model"], device="cpu", dtype="float32", max_model_len=1024,
                                    kv_cache_bytes=512 * 2**20))
    started = time.monotonic()
    rids = {}
    for t, task in enumerate(runs["tasks"]):
        prompt = engine.tokenize(messages=[{"role": "user", "content": task["prompt"]}])
        assert len(prompt) == tier["answers"][t]["prompt_tokens"], "not the prompt the greedy answer had"
        for j in range(k):
            params = SamplingParams(max_tokens=runs["max_tokens"], temperature=temperature,
                                    seed=seed * 1_000_003 + t * k + j)
            rids[engine.add_request(prompt, params)] = (t, j)
    got: list[list[dict]] = [[{"text": "", "completion_tokens": 0} for _ in range(k)] for _ in runs["tasks"]]
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                t, j = rids[out.request_id]
                got[t][j]["text"] += out.text_delta
                got[t][j]["completion_tokens"] += len(out.new_token_ids)
    print(f"{k} samples of {len(got)} tasks in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return got


def scores(runs: dict, samples: list[list[dict]]) -> dict[str, list[float | None]]:
    answers = runs["tiers"][0]["answers"]
    agree = [sum(normalise(s["text"]) == normalise(a["text"]) for s in ss) / len(ss) for a, ss in zip(answers, samples)]
    own = [a["own"]["sum_logprob"] for a in answers]
    return {"sum_logprob": own, "agree": agree,
            "agree + sum": [g + (o or -1e3) / 1e3 for g, o in zip(agree, own)]}


def sample_tokens(runs: dict, samples: list[list[dict]], fork: bool = False) -> list[int]:
    """Tokens the samples of each task compute: their own, and the prompt's last partial block each
    (this engine's prefix cache holds full blocks); ``fork``: their own only (samples forked from the
    greedy request's KV after its prompt, as parallel sampling can do)."""
    block = runs.get("block_size", 16)
    answers = runs["tiers"][0]["answers"]
    return [sum((0 if fork else max(1, a["prompt_tokens"] % block)) + s["completion_tokens"] for s in ss)
            for a, ss in zip(answers, samples)]


def replay(runs: dict, idx: list[int], score: list[float | None], t: float, r: float | None,
           extra: list[int] | None) -> dict:
    small, large = runs["tiers"]
    right = compute = reached = 0.0
    for k in idx:
        s, g = small["answers"][k], large["answers"][k]
        if r is not None and s.get("route") is not None and s["route"] < r:
            compute += cal._cost(large, k)
            right += g["correct"]
            reached += 1
            continue
        compute += cal._cost(small, k) + (2 * small["params"] * extra[k] if extra else 0)
        if score[k] is not None and score[k] >= t:
            right += s["correct"]
            continue
        compute += cal._cost(large, k)
        right += g["correct"]
        reached += 1
    return {"accuracy": right / len(idx), "compute": compute / cal._last_alone(runs, idx),
            "last_tier_share": reached / len(idx)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="runs.json of `kvcascade cascade calibrate`")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--cache", type=Path, help="the samples: read if there, else drawn and written")
    ap.add_argument("--target", type=float, default=0.98)
    ap.add_argument("--seed", type=int, default=0, help="the calibration command's split seed")
    ap.add_argument("--fork", action="store_true", help="price the samples at their own tokens only (sample_tokens)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    runs = json.loads(Path(args.runs).read_text())
    assert len(runs["tiers"]) == 2, "two tiers"
    if args.cache and args.cache.exists():
        samples = json.loads(args.cache.read_text())
    else:
        samples = draw_samples(runs, args.samples, args.temperature, args.seed)
        if args.cache:
            args.cache.write_text(json.dumps(samples))
    n = len(runs["tasks"])
    calib, held = cal.halves(n, 0.5, args.seed)
    cal.attach_routes(runs, calib, held, args.seed)
    extra = sample_tokens(runs, samples, args.fork)
    right = [bool(a["correct"]) for a in runs["tiers"][0]["answers"]]
    large_right = [bool(a["correct"]) for a in runs["tiers"][1]["answers"]]
    result = {"runs": str(args.runs), "samples": args.samples, "fork": args.fork, "temperature": args.temperature,
              "target": args.target,
              "small_accuracy_held": sum(right[k] for k in held) / len(held),
              "large_accuracy_held": sum(large_right[k] for k in held) / len(held),
              "sample_compute_held": sum(2 * runs["tiers"][0]["params"] * extra[k] for k in held)
              / cal._last_alone(runs, held),
              "oracle": cal.oracle(runs, held), "scores": {}}
    routes = sorted({runs["tiers"][0]["answers"][k]["route"] for k in calib})
    route_grid = [None] + [routes[round(q * (len(routes) - 1) / 23)] for q in range(1, 24)]
    goal = args.target * sum(large_right[k] for k in calib) / len(calib) - 1e-12
    large_held = result["large_accuracy_held"]
    for name, score in scores(runs, samples).items():
        cost = None if name == "sum_logprob" else extra
        values = sorted({score[k] for k in range(n) if score[k] is not None}) + [float("inf")]
        grid = [(t, r) for t in values for r in route_grid]
        held_scores = [-math.inf if score[k] is None else score[k] for k in held]  # no score: least sure
        for route in (False, True):
            pts = [(replay(runs, calib, score, t, r, cost), t, r) for t, r in grid if (r is not None) == route]
            ok = [p for p in pts if p[0]["accuracy"] >= goal]
            best = min(ok, key=lambda p: (p[0]["compute"], -p[0]["accuracy"])) if ok else \
                max(pts, key=lambda p: p[0]["accuracy"])
            held_pts = [replay(runs, held, score, t, r, cost) for _, t, r in pts]
            frontier = {}
            for share in (0.85, 0.90, 0.95, 0.98, 1.00):
                reach = [p for p in held_pts if p["accuracy"] >= share * large_held - 1e-12]
                frontier[f"{share:.2f}"] = (min(reach, key=lambda p: p["compute"]) if reach else None)
            key = f"{name}{' + route' if route else ''}"
            picked = {"threshold": best[1], "route_threshold": best[2], "calibration": best[0],
                      "held_out": replay(runs, held, score, best[1], best[2], cost)}
            result["scores"][key] = {"auroc_held": auroc(held_scores, [right[k] for k in held]),
                                     "auroc_all": auroc([-math.inf if v is None else v for v in score], right),
                                     "picked": picked, "frontier_held": frontier}
            h = picked["held_out"]
            print(f"{key:<22} AUROC held {result['scores'][key]['auroc_held']:.3f}  picked for {args.target}: "
                  f"held-out {h['accuracy']:.3f} ({h['accuracy'] / large_held:.0%} of large), large generates "
                  f"{h['last_tier_share']:.0%}, compute {h['compute']:.2f}x   frontier at 98%: "
                  + (f"{frontier['0.98']['compute']:.2f}x ({frontier['0.98']['last_tier_share']:.0%})"
                     if frontier["0.98"] else "-"))
    print(f"samples' compute on the held-out half: {result['sample_compute_held']:.3f}x of large alone; "
          f"oracle {result['oracle']['compute']:.2f}x", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
