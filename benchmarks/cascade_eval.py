"""What the cascade buys: accuracy against cost on questions with known answers.

    python benchmarks/cascade_eval.py --out runs/cascade [--n 120] [--target 0.95]

Questions are generated here (nothing downloaded): 3-digit sums, capitals from a list shipped in
this file, and the output of short Python expressions (computed with ``eval`` on literals we built).
Both models answer every question greedily, the small one with its top-20 logprobs; the cascade is
then replayed offline for each measure over a sweep of thresholds. That replay is exact for
``mode: full`` with ``original_prompt_only: true`` (the router's decision depends only on the small
model's answer, and the large model sees the same prompt), so one pass of each model prices every
threshold. Cost: large-tier tokens (prompt + completion of the escalated questions) and total
compute, 2 x parameters x tokens summed over both tiers, relative to large only.

The threshold is picked on a calibration split (the cheapest reaching ``--target`` of large-only
accuracy there) and reported on the held-out split. Output: a table on stdout, ``results.json``
(``generations.json`` holds the raw answers; ``--from`` replays it without the models) and
``cascade.png`` (accuracy against relative compute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from protos import kvcascade_pb2 as pb  # noqa: E402
from router.confidence import MEASURES, create_measure  # noqa: E402

SMALL, LARGE = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "Canada": "Ottawa", "Australia": "Canberra", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens",
    "Turkey": "Ankara", "Peru": "Lima", "Chile": "Santiago", "Argentina": "Buenos Aires", "Mexico": "Mexico City",
    "Ireland": "Dublin", "Austria": "Vienna", "Hungary": "Budapest", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Morocco": "Rabat", "Nigeria": "Abuja", "Brazil": "Brasilia", "Switzerland": "Bern", "New Zealand": "Wellington",
}  # fmt: skip
MAX_TOKENS = 16


@dataclass
class Question:
    kind: str
    prompt: str
    answer: str


def make_questions(n: int, seed: int) -> list[Question]:
    rng = random.Random(seed)
    out: list[Question] = []
    capitals = list(CAPITALS.items())
    for i in range(n):
        kind = ("sum", "capital", "code")[i % 3]
        if kind == "sum":
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            out.append(Question(kind, f"What is {a} + {b}? Reply with the number only.", str(a + b)))
        elif kind == "capital":
            country, city = capitals[rng.randrange(len(capitals))]
            out.append(Question(kind, f"What is the capital of {country}? Reply with the city only.", city))
        else:
            a, b, word = rng.randint(2, 40), rng.randint(2, 9), rng.choice(["kvcascade", "router", "tensor", "paged"])
            expr = rng.choice([f"{a} * {b} - {b}", f"{a} // {b} + {a} % {b}", f"len('{word}') * {b}",
                               f"sum(range({b}))", f"'{word}'[::-1]", f"max({a}, {b} * {b}) - {a}"])
            value = eval(expr, {"__builtins__": {"len": len, "sum": sum, "range": range, "max": max}})  # our literals
            out.append(Question(kind, f"What does this Python code print? Reply with the output only.\n"
                                      f"print({expr})", str(value)))
    rng.shuffle(out)
    return out


def correct(question: Question, text: str) -> bool:
    got = re.sub(r"[`*'\"]", "", text).strip().lower()
    return re.search(rf"(?<![\w-]){re.escape(question.answer.lower())}(?![\w-])", got) is not None


# --- generation ---------------------------------------------------------------------------------


def generate(model: str, questions: list[Question], logprobs: int | None) -> dict:
    """Greedy answers of one model, with each token's logprob (and top-N) when asked."""
    import torch

    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    started = time.monotonic()
    engine = LLMEngine(EngineConfig(model=model, max_model_len=512, kv_cache_bytes=256 * 2**20))
    params = sum(p.numel() for p in engine.model.parameters())
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=logprobs)
    prompts = [engine.tokenize(messages=[{"role": "user", "content": q.prompt}]) for q in questions]
    ids = [engine.add_request(p, sp) for p in prompts]
    got: dict[str, dict] = {i: {"text": "", "logprobs": []} for i in ids}
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                g = got[out.request_id]
                g["text"] += out.text_delta
                g["logprobs"] += [[lp.logprob, [t[1] for t in lp.top]] for lp in out.logprobs or ()]
                if out.usage is not None:
                    g["prompt_tokens"], g["completion_tokens"] = out.usage.prompt_tokens, out.usage.completion_tokens
    answers = [got[i] for i in ids]
    for q, a in zip(questions, answers):
        a["correct"] = correct(q, a["text"])
    print(f"{model}: {sum(a['correct'] for a in answers)}/{len(answers)} right in "
          f"{time.monotonic() - started:.0f}s", file=sys.stderr)
    return {"model": model, "params": params, "answers": answers}


# --- the cascade, replayed ----------------------------------------------------------------------


def confidence(measure: str, logprobs: list) -> float:
    lps = [pb.TokenLogprob(logprob=lp, top=[pb.TopLogprob(logprob=t) for t in top]) for lp, top in logprobs]
    return create_measure(measure).score(lps) if lps else float("-inf")


def replay(small: dict, large: dict, idx: list[int], measure: str, threshold: float) -> dict:
    surer = create_measure(measure).higher_is_surer
    right = large_tokens = compute = escalated = 0
    for i in idx:
        s, g = small["answers"][i], large["answers"][i]
        c = confidence(measure, s["logprobs"])
        accept = c >= threshold if surer else c <= threshold
        compute += 2 * small["params"] * (s["prompt_tokens"] + s["completion_tokens"])
        if accept:
            right += s["correct"]
        else:
            escalated += 1
            right += g["correct"]
            large_tokens += g["prompt_tokens"] + g["completion_tokens"]
            compute += 2 * large["params"] * (g["prompt_tokens"] + g["completion_tokens"])
    large_only = sum(2 * large["params"] * (large["answers"][i]["prompt_tokens"]
                                            + large["answers"][i]["completion_tokens"]) for i in idx)
    return {"measure": measure, "threshold": threshold, "accuracy": right / len(idx),
            "escalated": escalated / len(idx), "large_tokens": large_tokens, "compute_vs_large": compute / large_only}


def sweep(small: dict, large: dict, idx: list[int], measure: str) -> list[dict]:
    scores = sorted({confidence(measure, small["answers"][i]["logprobs"]) for i in idx})
    surer = create_measure(measure).higher_is_surer
    # Every distinct decision: each observed score as the threshold, plus "escalate everything".
    edge = float("inf") if surer else float("-inf")
    return [replay(small, large, idx, measure, t) for t in [*scores, edge]]


def accuracy(model: dict, idx: list[int]) -> float:
    return sum(model["answers"][i]["correct"] for i in idx) / len(idx)


def evaluate(small: dict, large: dict, target: float, seed: int) -> dict:
    n = len(small["answers"])
    idx = list(range(n))
    random.Random(seed + 1).shuffle(idx)
    calib, held = sorted(idx[: n // 2]), sorted(idx[n // 2:])
    result = {"n": n, "target": target, "small_only": {}, "large_only": {}, "picked": {}, "sweeps": {}}
    for name, split in (("calibration", calib), ("held_out", held)):
        result["small_only"][name] = accuracy(small, split)
        result["large_only"][name] = accuracy(large, split)
    for measure in MEASURES:
        points = sweep(small, large, calib, measure)
        goal = target * result["large_only"]["calibration"]
        reaching = [p for p in points if p["accuracy"] >= goal] or [max(points, key=lambda p: p["accuracy"])]
        best = min(reaching, key=lambda p: (p["compute_vs_large"], -p["accuracy"]))
        result["picked"][measure] = {"threshold": best["threshold"], "calibration": best,
                                     "held_out": replay(small, large, held, measure, best["threshold"])}
        result["sweeps"][measure] = sweep(small, large, held, measure)
    return result


def report(result: dict, small: dict, large: dict, out: Path) -> None:
    small_cost = small["params"] / large["params"]
    print(f"\n{result['n']} questions; held-out split: small only {result['small_only']['held_out']:.0%}, "
          f"large only {result['large_only']['held_out']:.0%} (small costs ~{small_cost:.2f}x large per token)")
    print(f"threshold picked on the calibration split for >= {result['target']:.0%} of large-only accuracy:\n")
    print(f"{'measure':<14}{'threshold':>11}{'accuracy':>10}{'escalated':>11}{'large tok':>11}{'compute':>9}")
    for measure, picked in result["picked"].items():
        h = picked["held_out"]
        print(f"{measure:<14}{picked['threshold']:>11.3f}{h['accuracy']:>10.0%}{h['escalated']:>11.0%}"
              f"{h['large_tokens']:>11}{h['compute_vs_large']:>8.2f}x")
    (out / "results.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for measure, points in result["sweeps"].items():
        points = sorted(points, key=lambda p: p["compute_vs_large"])
        ax.plot([p["compute_vs_large"] for p in points], [p["accuracy"] for p in points], marker=".", label=measure)
    ax.scatter([small_cost], [result["small_only"]["held_out"]], marker="s", color="k", label="small only")
    ax.scatter([1.0], [result["large_only"]["held_out"]], marker="*", s=120, color="k", label="large only")
    ax.set(xlabel="compute relative to large only", ylabel="accuracy (held-out)", title="cascade: accuracy vs cost")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cascade.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/cascade"))
    parser.add_argument("--n", type=int, default=120, help="questions (a third of each kind)")
    parser.add_argument("--target", type=float, default=0.95, help="share of large-only accuracy to reach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from", dest="replay_from", type=Path, help="a generations.json to replay")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replay_from:
        gens = json.loads(args.replay_from.read_text())
    else:
        questions = make_questions(args.n, args.seed)
        gens = {"questions": [asdict(q) for q in questions], "small": generate(SMALL, questions, 20),
                "large": generate(LARGE, questions, None)}
        (args.out / "generations.json").write_text(json.dumps(gens))
    report(evaluate(gens["small"], gens["large"], args.target, args.seed), gens["small"], gens["large"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
