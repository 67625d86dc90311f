"""Would the small tier's hidden states tell its right answers from its wrong ones better than its
logprobs? A probe experiment for issue 16, on the answers `kvcascade cascade calibrate` collected.

    python benchmarks/cascade_probe.py --runs runs/calibrate/runs.json [--hidden /tmp/hidden.npz]

1. Hidden states: the first tier's model (Hugging Face transformers on the same GGUF, fp32) reads
   each task's prompt followed by the tier's recorded draft; kept per layer: the state after the
   prompt (``p``: before answering), at the draft's last token (``d``) and the mean over the answer
   (``m``). Cached in ``--hidden``.
2. Probes: an L2 logistic regression on standardized states (alone, and on the stacked confidence's
   five draft features plus the states' first principal components), its penalty picked by 5-fold
   cross-validation on the calibration half, AUROC on the held-out half; the same seeded halves as
   the calibration command. Beside it: the draft's ``sum_logprob`` and the stacked confidence
   (router/stacked_confidence.py) on the same halves.
3. Learning curve of the stacked confidence: 102 held-out tasks, fit on 102 / 204 / 306 of the rest.
4. ``--picks``: does a pick with a margin transfer to the held-out half better? The calibration
   command's candidates (routers and stacked confidence included) replayed per task on the
   calibration half and resampled (400 bootstrap draws); picked: the cheapest setting whose
   accuracy reaches the target share of the last tier's in at least ``conf`` of the draws, for
   each ``conf`` in ``--confidences``; reported: its held-out share of the last tier's accuracy and
   compute, beside the command's own pick (the point estimate).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcascade import calibrate as cal  # noqa: E402
from kvcascade.calibrate import stacked_row  # noqa: E402
from router.stacked_confidence import FEATURES  # noqa: E402
from router.stacked_confidence import cross_fit as cross_fit_stacked  # noqa: E402

LAYERS = (8, 12, 16, 20, 24)
PENALTIES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)  # inverse strength, as C in the usual notation


def hidden_states(runs: dict, out: Path) -> dict[str, np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    from contracts.models import resolve_model
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine

    tier = runs["tiers"][0]
    src = resolve_model(tier["model"])
    hf = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=tier["model"], device="cpu", dtype="float32", max_model_len=1024,
                                    kv_cache_bytes=64 * 2**20))  # its tokenizer and chat template, as collected
    got: dict[str, list] = {f"{w}{layer}": [] for w in "pdm" for layer in LAYERS}
    with torch.no_grad():
        for task, answer in zip(runs["tasks"], tier["answers"]):
            prompt = engine.tokenize(messages=[{"role": "user", "content": task["prompt"]}])
            ids = prompt + answer["token_ids"]
            states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for layer in LAYERS:
                h = states[layer][0]
                got[f"p{layer}"].append(h[len(prompt) - 1].numpy())
                got[f"d{layer}"].append(h[len(ids) - 1].numpy())
                got[f"m{layer}"].append(h[len(prompt) - 1:].mean(0).numpy())
    arrays = {k: np.stack(v) for k, v in got.items()}
    np.savez(out, **arrays)
    return arrays


def auroc(y: np.ndarray, s: np.ndarray) -> float:
    """P(a right answer scores above a wrong one), ties counted half."""
    pos, neg = s[y], s[~y]
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
                 / (len(pos) * len(neg)))


def fit_logistic(x: np.ndarray, y: np.ndarray, c: float, steps: int = 300) -> tuple[np.ndarray, float]:
    """Newton's method on the mean log loss + |w|^2 / (2 c n): a standard L2 logistic regression."""
    n, d = x.shape
    w, b = np.zeros(d), 0.0
    xb = np.hstack([x, np.ones((n, 1))])
    reg = np.eye(d + 1) / (c * n)
    reg[-1, -1] = 0.0
    for _ in range(steps):
        theta = np.append(w, b)
        p = 1.0 / (1.0 + np.exp(-(xb @ theta)))
        grad = xb.T @ (p - y) / n + reg @ theta
        hess = (xb * (p * (1 - p))[:, None]).T @ xb / n + reg
        step = np.linalg.solve(hess, grad)
        w, b = w - step[:-1], b - step[-1]
        if np.abs(step).max() < 1e-8:
            break
    return w, b


def standardize(train: np.ndarray, *rest: np.ndarray) -> list[np.ndarray]:
    mu, sd = train.mean(0), train.std(0) + 1e-6
    return [(a - mu) / sd for a in (train, *rest)]


def probe(x: np.ndarray, y: np.ndarray, calib: list[int], held: list[int], seed: int) -> tuple[float, float]:
    """(cross-validated AUROC on the calibration half at the best penalty, held-out AUROC)."""
    best = (-1.0, PENALTIES[0])
    folds = np.array_split(np.random.default_rng(seed).permutation(calib), 5)
    for c in PENALTIES:
        scores, labels = [], []
        for k, test in enumerate(folds):
            fit = np.concatenate([f for j, f in enumerate(folds) if j != k])
            a, b = standardize(x[fit], x[test])
            w, bias = fit_logistic(a, y[fit].astype(float), c)
            scores.append(b @ w + bias)
            labels.append(y[test])
        best = max(best, (auroc(np.concatenate(labels), np.concatenate(scores)), c))
    a, b = standardize(x[calib], x[held])
    w, bias = fit_logistic(a, y[calib].astype(float), best[1])
    return best[0], auroc(y[held], b @ w + bias)


def cascade_right(runs: dict, idx: list[int], settings) -> list[bool]:
    """Per task of ``idx``: whether the cascade with ``settings`` answers it right."""
    rights: list[bool] = []
    cal.replay(runs, idx, settings, rights)
    return rights


def picks(runs_text: str, target: float, seed: int, confidences: list[float], draws: int = 400) -> dict:
    runs = json.loads(runs_text)  # calibration writes its scores into the answers: a fresh copy a seed
    calib, held = cal.halves(len(runs["tasks"]), 0.5, seed)
    cal.attach_routes(runs, calib, held, seed)
    cal.attach_stacked(runs, calib, held, seed)
    best, points, _ = cal.search(runs, calib, target, 12)
    last = np.array([runs["tiers"][-1]["answers"][k]["correct"] for k in calib], dtype=np.float32)
    right = np.array([cascade_right(runs, calib, p["combo"]) for p in points], dtype=np.float32)
    weights = np.random.default_rng(seed).multinomial(len(calib), np.full(len(calib), 1 / len(calib)),
                                                      size=draws).astype(np.float32)
    share = (right @ weights.T) / (last @ weights.T)[None, :]
    held_last = cal.accuracy(runs, len(runs["tiers"]) - 1, held)
    out = {"points": len(points)}
    for conf in [None, *confidences]:
        if conf is None:
            pick = best
        else:
            ok = np.flatnonzero((share >= target - 1e-6).mean(axis=1) >= conf)
            pick = min((points[i] for i in ok), key=lambda p: (p["compute"], -p["accuracy"])) if len(ok) \
                else max(points, key=lambda p: p["accuracy"])
        got = cal.replay(runs, held, pick["combo"])
        out["point estimate" if conf is None else f"conf {conf}"] = {
            "held_out_share": got["accuracy"] / held_last, "held_out_compute": got["compute"],
            "calibration_compute": pick["compute"], "family": cal.family(pick)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, help="runs.json written by `kvcascade cascade calibrate`")
    ap.add_argument("--hidden", default="/tmp/cascade_hidden.npz", help="hidden states, cached here")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--picks", action="store_true", help="step 4 only (the bootstrap picks)")
    ap.add_argument("--target-quality", type=float, default=0.98)
    ap.add_argument("--confidences", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9])
    args = ap.parse_args()
    text = Path(args.runs).read_text()
    if args.picks:
        result = {"runs": args.runs, "target": args.target_quality, "seeds": {}}
        for seed in args.seeds:
            got = result["seeds"][seed] = picks(text, args.target_quality, seed, args.confidences)
            print(f"seed {seed}: " + " | ".join(f"{k}: {v['held_out_share']:.3f} of the last tier held out at "
                                                 f"{v['held_out_compute']:.2f}x" for k, v in got.items()
                                                 if k != "points"), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return 0
    runs = json.loads(text)
    path = Path(args.hidden)
    states = {k: v for k, v in np.load(path).items() if k != "y"} if path.exists() else hidden_states(runs, path)
    tier, prompts = runs["tiers"][0], [t["prompt"] for t in runs["tasks"]]
    y = np.array([bool(a["correct"]) for a in tier["answers"]])
    rows = [stacked_row(a, tier.get("window")) for a in tier["answers"]]
    ok = [k for k, r in enumerate(rows) if r is not None]
    draft = np.array([[r[f] for f in FEATURES] if r else [0.0] * len(FEATURES) for r in rows])
    n = len(y)
    result: dict = {"runs": args.runs, "tasks": n, "right": int(y.sum()), "splits": {}, "learning_curve": {}}
    for seed in args.seeds:
        calib, held = cal.halves(n, 0.5, seed)
        calib_ok, held_ok = [k for k in calib if k in ok], [k for k in held if k in ok]
        _, model = cross_fit_stacked([prompts[k] for k in calib_ok], [rows[k] for k in calib_ok],
                                     [bool(y[k]) for k in calib_ok], seed=seed)
        split = {"sum_logprob": auroc(y[held_ok], draft[held_ok, 0]),
                 "stacked": auroc(y[held_ok], np.array([model.score(prompts[k], rows[k]) for k in held_ok]))}
        for key in sorted(states):
            split[f"hidden {key}"] = probe(states[key], y, calib, held, seed)
        for key in ("p16", "d16", "m16"):
            for comps in (8, 32):
                a, b = standardize(states[key][calib_ok], states[key][held_ok])
                basis = np.linalg.svd(a, full_matrices=False)[2][:comps].T
                x = np.zeros((n, len(FEATURES) + comps))
                x[calib_ok] = np.hstack([draft[calib_ok], a @ basis])
                x[held_ok] = np.hstack([draft[held_ok], b @ basis])
                split[f"draft + {key} x{comps}"] = probe(x, y, calib_ok, held_ok, seed)
        result["splits"][seed] = split
        print(f"seed {seed}: " + ", ".join(f"{k} {v if isinstance(v, float) else v[1]:.3f}"
                                             for k, v in split.items()), flush=True)
        rest = ok[:]
        random.Random(seed).shuffle(rest)
        test, rest = rest[:102], rest[102:]
        for size in (102, 204, 306):
            fit = rest[:size]
            _, m = cross_fit_stacked([prompts[k] for k in fit], [rows[k] for k in fit], [bool(y[k]) for k in fit],
                                     seed=seed)
            got = auroc(y[test], np.array([m.score(prompts[k], rows[k]) for k in test]))
            result["learning_curve"].setdefault(str(size), []).append(got)
    print("stacked confidence, AUROC on 102 held-out tasks by tasks fit on (mean over seeds): "
          + ", ".join(f"{k}: {np.mean(v):.3f}" for k, v in result["learning_curve"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
