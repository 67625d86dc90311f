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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, help="runs.json written by `kvcascade cascade calibrate`")
    ap.add_argument("--hidden", default="/tmp/cascade_hidden.npz", help="hidden states, cached here")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    runs = json.loads(Path(args.runs).read_text())
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
        order = list(range(n))
        random.Random(seed).shuffle(order)
        calib, held = sorted(order[: n // 2]), sorted(order[n // 2:])
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
        rest, test = ok[:], None
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
