"""`kvcascade cascade calibrate`: the replay prices a setting as a hand-computed table says, the
search picks the cheapest setting reaching the target, and the command runs end to end (real
models, a few tasks) and writes a cascade file the router loads."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvcascade.calibrate import Setting, calibrate, oracle, replay, search
from router.cascade_config import load_cascade

ROOT = Path(__file__).resolve().parents[1]


def runs(small_correct, large_correct, own, judge, small_params=1, large_params=3, large_completion=2) -> dict:
    """Two tiers; every answer 8 prompt + 2 generated tokens (the large one's: ``large_completion``),
    every judge prefill 10 tokens.
    ``own`` and ``judge`` are mean logprobs; the other measures follow them in the same order."""
    def scores(lp: float | None) -> dict:
        return {"mean_logprob": lp, "sum_logprob": lp, "min_prob": None if lp is None else math.exp(lp),
                "mean_entropy": None if lp is None else -lp}

    def answer(correct, own_lp=None, judge_lp=None, completion=2) -> dict:
        return {"correct": bool(correct), "prompt_tokens": 8, "completion_tokens": completion, "judge_tokens": 10,
                "own": scores(own_lp), "judge": scores(judge_lp)}

    n = len(small_correct)
    return {"tasks": [{}] * n, "block_size": 4, "tiers": [
        {"name": "small", "model": "s", "params": small_params,
         "answers": [answer(c, o, j) for c, o, j in zip(small_correct, own, judge)]},
        {"name": "large", "model": "l", "params": large_params,
         "answers": [answer(c, completion=large_completion) for c in large_correct]},
    ]}


def test_replay_prices_a_setting_as_the_table_says() -> None:
    r = runs([1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], own=[-0.1, -0.2, -0.5, -0.9, -1.5, -2.0], judge=[-9] * 6)
    # Accept at >= -0.5: tasks 0-2 by small (right), 3-5 escalate (large: right, right, wrong) = 5/6.
    # Compute: small 6 x 2x1x10 = 120, large 3 x 2x3x10 = 180; large alone 6 x 60 = 360.
    p = replay(r, range(6), [Setting("mean_logprob", -0.5)])
    assert p["accuracy"] == pytest.approx(5 / 6) and p["compute"] == pytest.approx(300 / 360)
    assert p["last_tier_share"] == pytest.approx(0.5) and p["judged"] == 0
    # A judge for everything below -0.5 but above the floor -1.0 (task 3 only), rejecting it:
    # + its prefill 2x3x(10 + 1) = 66, and the escalation then finds 8 // 4 x 4 = 8 prompt tokens
    # cached: - 2x3x8 = 48.
    p = replay(r, range(6), [Setting("mean_logprob", -0.5, "mean_logprob", -1.0, floor=-1.0)])
    assert p["judged"] == pytest.approx(1 / 6) and p["compute"] == pytest.approx((300 + 66 - 48) / 360)


def test_the_search_picks_the_cheapest_threshold_reaching_the_target() -> None:
    r = runs([1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], own=[-0.1, -0.2, -0.5, -0.9, -1.5, -2.0], judge=[-9] * 6)
    best, points, _ = search(r, range(6), target=1.0, grid=4)
    assert best["settings"][0]["measure"] == "mean_logprob" and best["settings"][0]["threshold"] == -0.5
    assert best["accuracy"] == pytest.approx(5 / 6) and best["compute"] == pytest.approx(300 / 360)
    # A lower target lets it accept more: at 60% of 5/6 (= 1/2), small alone is enough.
    best, _, _ = search(r, range(6), target=0.6, grid=4)
    assert best["accuracy"] == pytest.approx(3 / 6) and best["last_tier_share"] == 0


def test_when_only_the_judge_separates_right_from_wrong_the_search_uses_it() -> None:
    # Own confidence says nothing (all equal); the judge agrees exactly with the right answers,
    # and the large tier answers at length (30 tokens), so a prefill of the draft costs less.
    r = runs([1, 0, 1, 0, 1, 0], [1] * 6, own=[-0.3] * 6, judge=[-0.1, -3, -0.1, -3, -0.1, -3], large_params=30,
             large_completion=30)
    best, _, _ = search(r, range(6), target=1.0, grid=4)
    s = best["settings"][0]
    assert s["judge_measure"] is not None and best["accuracy"] == 1.0 and best["last_tier_share"] == 0.5
    # small 6 x 2x1x10; judging 6 x 2x30x11; half escalate, their 8 prompt tokens cached: 3 x 2x30x30.
    large_alone = 6 * 2 * 30 * 38
    assert best["compute"] == pytest.approx((120 + 6 * 2 * 30 * 11 + 3 * 2 * 30 * 30) / large_alone)
    assert best["compute"] < replay(r, range(6), [Setting("mean_logprob", math.inf)])["compute"]


def test_a_prompt_router_in_front_skips_the_tier_where_it_is_wrong() -> None:
    # Own confidence says nothing; the prompt router's scores (``route``) rank the wrong ones low.
    r = runs([1, 1, 1, 0, 0, 0], [1] * 6, own=[-0.3] * 6, judge=[-9] * 6)
    for a, score in zip(r["tiers"][0]["answers"], [0.9, 0.8, 0.7, 0.2, 0.1, 0.3]):
        a["route"] = score
    # Skip below 0.5: tasks 3-5 go straight to large (3 x 60), tasks 0-2 small accepts (3 x 20).
    p = replay(r, range(6), [Setting("mean_logprob", -1.0, route_threshold=0.5)])
    assert p["accuracy"] == 1.0 and p["compute"] == pytest.approx((3 * 20 + 3 * 60) / 360)
    assert p["last_tier_share"] == pytest.approx(0.5) and p["judged"] == 0
    # The search finds it: nothing else reaches large's accuracy below the cost of large alone
    # plus small's trials, and the bound that decides before any tier runs is this cost.
    best, _, _ = search(r, range(6), target=1.0, grid=7)
    assert best["accuracy"] == 1.0 and best["compute"] == pytest.approx(240 / 360)
    assert best["settings"][0]["route_threshold"] is not None
    assert oracle(r, range(6), before=True)["compute"] == pytest.approx(240 / 360)
    assert oracle(r, range(6))["compute"] == pytest.approx((6 * 20 + 3 * 60) / 360)


def test_calibration_trains_the_router_on_its_split_and_scores_the_rest_unseen() -> None:
    # Two kinds of prompt: small answers capitals right and products wrong (large both).
    prompts = [f"What is the capital of {c}?" if i % 2 else f"What is {i + 10} times {i + 31}?"
               for i, c in enumerate("France Peru Japan Kenya Chile Spain Egypt Nepal Italy Chad Cuba Fiji".split())]
    small = [bool(i % 2) for i in range(12)]
    r = runs(small, [1] * 12, own=[-0.3] * 12, judge=[-9] * 12)
    r["tasks"] = [{"prompt": p} for p in prompts]
    result = calibrate(r, target=1.0, split=0.5, seed=0, grid=6)
    held = result["picked"]["held_out"]
    assert held["accuracy"] == 1.0 and held["settings"][0]["route_threshold"] is not None
    # Held out, the router (never trained on these prompts) sends each product to large at once.
    assert held["compute"] == pytest.approx(result["oracle_before"]["compute"])
    assert len(result["routers"]) == 1 and result["routers"][0]["trained_on"] == 6


def test_the_stacked_confidence_is_swept_like_an_own_measure() -> None:
    # Own measures say nothing; the stacked scores (as attach_stacked leaves them) rank one wrong
    # answer (task 4, 0.6) above a right one (task 2, 0.5).
    r = runs([1, 1, 1, 0, 0, 0], [1] * 6, own=[-0.3] * 6, judge=[-9] * 6)
    for a, p in zip(r["tiers"][0]["answers"], [0.9, 0.7, 0.5, 0.2, 0.6, 0.3]):
        a["own"]["stacked"] = p
    # Large's accuracy (6/6) needs no wrong answer kept: accept at >= 0.7 (tasks 0, 1), the other
    # four escalate: small 6 x 20 + large 4 x 60 = 360 of large alone's 360.
    best, _, _ = search(r, range(6), target=1.0, grid=4)
    assert best["settings"][0]["measure"] == "stacked" and best["settings"][0]["threshold"] == 0.7
    assert best["accuracy"] == 1.0 and best["compute"] == pytest.approx(1.0)
    # 5/6 allows one wrong answer: accept at >= 0.5 (tasks 0, 1, 2 and 4), 120 + 2 x 60 = 240;
    # at 0.3 two wrong ones get in (4/6), and own confidence accepts all or nothing.
    best, _, _ = search(r, range(6), target=5 / 6, grid=4)
    assert best["settings"][0]["measure"] == "stacked" and best["settings"][0]["threshold"] == 0.5
    assert best["accuracy"] == pytest.approx(5 / 6) and best["compute"] == pytest.approx(240 / 360)


def stacked_runs(n: int = 40) -> dict:
    """Capitals the small tier gets right when it is sure; products it gets wrong, just as sure:
    neither the prompt nor the draft alone finds every wrong answer, the two together do."""
    small, own, prompts = [], [], []
    for i in range(n):
        sure = i % 4 < 2
        if i % 2:
            prompts.append(f"What is the capital of {'France Peru Japan Kenya Chile'.split()[i % 5]}? One word.")
            small.append(sure)
        else:
            prompts.append(f"What is {100 + 7 * i} times {11 + i}? The number only.")
            small.append(False)
        own.append(-0.05 - 0.001 * i if sure else -1.5 - 0.01 * i)
    r = runs(small, [1] * n, own=own, judge=[-9] * n)
    r["tasks"] = [{"prompt": p, "answer": "x", "scorer": "exact"} for p in prompts]
    return r


def test_calibration_fits_the_stacked_confidence_and_writes_it_beside_the_cascade_file(tmp_path: Path) -> None:
    (tmp_path / "runs.json").write_text(json.dumps(stacked_runs()))
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in stacked_runs()["tasks"]))
    (tmp_path / "cascade.yaml").write_text("tiers:\n  - {name: small, model: s, threshold: -0.3}\n"
                                           "  - {name: large, model: l}\n")
    done = subprocess.run([sys.executable, "-m", "kvcascade", "cascade", "calibrate", "--config",
                           str(tmp_path / "cascade.yaml"), "--tasks", str(tmp_path / "tasks.jsonl"), "--out",
                           str(tmp_path / "out"), "--from", str(tmp_path / "runs.json"), "--target-quality", "1.0",
                           "--no-route", "--write", str(tmp_path / "c.yaml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Own confidence keeps the sure products; the stacked confidence escalates them and keeps the
    # sure capitals: on the held-out half, large's accuracy for its compute on what small misses.
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    held = result["picked"]["held_out"]
    assert held["settings"][0]["measure"] == "stacked" and held["accuracy"] == 1.0
    assert held["compute"] == pytest.approx(result["oracle"]["compute"])
    assert result["auroc"]["held_out"]["stacked"] == 1.0 > result["auroc"]["held_out"]["sum_logprob"]
    tier = load_cascade(tmp_path / "c.yaml").tiers[0]
    assert tier.measure == "stacked" and tier.stacked.file == "c.small.stacked.json" and tier.route is None
    assert tier.threshold == pytest.approx(held["settings"][0]["threshold"], abs=1e-6)
    assert "| stacked confidence (no router in front) |" in done.stdout
    # --family picks from one family only, and refuses one it does not know, naming them.
    cmd = [*done.args[:-3], "--write", str(tmp_path / "d.yaml")]
    again = subprocess.run([*cmd, "--family", "own sum_logprob"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    picked = json.loads((tmp_path / "out" / "results.json").read_text())["picked"]["calibration"]["settings"][0]
    assert picked["measure"] == "sum_logprob" and picked["threshold"] == math.inf  # (nothing else reaches 100%)
    # ... which the file says as a bar nothing reaches: the router refuses an infinite threshold.
    tier = load_cascade(tmp_path / "d.yaml").tiers[0]
    assert (tier.measure, tier.threshold) == ("min_prob", 1.01)
    bad = subprocess.run([*cmd, "--family", "vibes"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--family: no family 'vibes'; the families: [" in bad.stderr, bad.stderr


def test_the_command_end_to_end_writes_a_file_the_router_loads(tmp_path: Path) -> None:
    config = tmp_path / "cascade.yaml"
    config.write_text("tiers:\n  - name: small\n    model: smollm2-135m\n    threshold: -0.3\n"
                      "    window: 4\n  - name: large\n    model: smollm2-135m\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(t) for t in [
        {"prompt": "What is 2 + 2? Reply with the number only.", "answer": "4", "scorer": "numeric"},
        {"prompt": "What is the capital of France? One word.", "answer": "Paris", "scorer": "contains"},
        {"prompt": "What is 17 * 3? Reply with the number only.", "answer": "51", "scorer": "numeric"},
        {"prompt": "Name the chemical symbol of gold.", "answer": "Au", "scorer": "contains"},
    ]) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvcascade", "cascade", "calibrate", "--config", str(config), "--tasks", str(tasks),
           "--out", str(out), "--max-tokens", "6", "--target-quality", "0.9"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert "| **picked** |" in done.stdout and (out / "calibration.md").exists()
    calibrated = load_cascade(out / "cascade.calibrated.yaml")
    assert calibrated.tiers[0].window == 4 and calibrated.tiers[0].model == "smollm2-135m"
    assert calibrated.tiers[0].threshold is not None or calibrated.tiers[0].judge is not None
    saved = json.loads((out / "runs.json").read_text())
    assert [len(t["answers"]) for t in saved["tiers"]] == [4, 4]
    assert all(a["judge"]["mean_logprob"] is not None for a in saved["tiers"][0]["answers"])
    # Replaying the saved answers gives the same result without the models.
    again = subprocess.run([*cmd[:-2], "--target-quality", "0.9", "--from", str(out / "runs.json"),
                            "--write", str(tmp_path / "again.yaml")], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout == done.stdout


@pytest.mark.parametrize("flags, message", [
    (["--target-quality", "1.5"], "--target-quality: must be in (0, 1]"),
    (["--tasks", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
])
def test_bad_flags_are_refused_with_the_reason(tmp_path: Path, flags, message) -> None:
    done = subprocess.run([sys.executable, "-m", "kvcascade", "cascade", "calibrate", "--config",
                           str(ROOT / "deploy/cascade.example.yaml"), "--out", str(tmp_path), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b"])  # tied and untied embeddings
def test_compute_counts_packed_weights_as_parameters(model: str) -> None:
    """A packed projection holds buffers, not parameters: a quantized model multiplies through as
    many weights as its dense self (a run that missed it priced the cascade at 1,749x)."""
    from kvcascade.calibrate import matmul_params
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from contracts.models import BUILTIN_MODELS

    chunks = BUILTIN_MODELS[model].chunks
    if chunks is not None and not chunks.installed():
        pytest.skip(f"{model} is not installed (scripts/install_qwen.sh)")
    counts = []
    for quantization in ("none", "auto"):
        engine = LLMEngine(EngineConfig(model=model, quantization=quantization, max_model_len=64,
                                        kv_cache_bytes=16 * 2**20))
        counts.append(matmul_params(engine.model))
        engine.close()
    assert counts[0] == counts[1] > 100_000_000, counts
