"""``kvcascade cascade calibrate``: the cheapest cascade setting that keeps a target share of the
last tier's quality, found on labelled tasks and checked on tasks it did not see.

    kvcascade cascade calibrate --config deploy/cascade.example.yaml --tasks deploy/cascade_tasks.jsonl \\
        --target-quality 0.98 --out runs/calibrate

1. **Collect** (the models, in this process): every tier answers every task greedily with its
   top-20 logprobs, and every tier but the last has its answers judged by the next tier's model
   (one prefill over the prompt and the draft, ``prompt_logprobs``; what the router's judge does).
   Saved as ``runs.json``; ``--from runs.json`` replays it without the models.
2. **Replay**: with ``mode: full`` and ``original_prompt_only: true`` a tier's decision depends only
   on its own answer and the judge's score of it, so one pass of each model prices every setting
   exactly. Per tier but the last, the settings swept are: its own measure (``mean_logprob``,
   ``sum_logprob``, ``min_prob``, ``mean_entropy``) at every threshold the tasks produce; the judge
   alone, each measure at every threshold; and the two together (accept outright above one
   threshold, escalate unjudged below a floor, judge in between) on a grid of quantiles
   (``--grid``). Two more, fit on the calibration split first (``--no-route``, ``--no-stacked``
   leave them out): a prompt router in front of the tier (router/prompt_router.py), and the
   stacked confidence (one logistic model over the prompt's words and the draft's own measures,
   router/stacked_confidence.py), swept as one more own measure; both are cross-fitted, so their
   thresholds are picked on scores of tasks they did not learn from.
3. **Pick** on a calibration split (``--split``, seeded): the cheapest setting whose accuracy
   reaches ``--target-quality`` x the last tier's on that split; report it on the held-out rest.

Cost is compute, 2 x parameters x tokens (prompt + generated; parameters a token multiplies
through: the input embedding, a lookup, left out) summed over every call a request
made: trials thrown away and judging prefills included, relative to the last tier alone. The
prefix cache is not subtracted (so a system prompt all requests share costs every time, for the
last tier alone too), except where the cascade itself puts it to use: a tier escalated to after
its judge rejected the draft finds the prompt's full KV blocks the judge computed (the router
routes it there by that prefix). Outputs in ``--out``:
``results.json``, ``calibration.md`` (a table per measure, each group of families' best held-out
points, the scores' AUROC), ``curve.png`` (accuracy against compute on the held-out split) and the
calibrated cascade file (``--write``, default ``cascade.calibrated.yaml`` there, with the prompt
router or stacked confidence it picked beside it; kvcascade/calibration_report.py writes them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvcascade.calibration_report import calibrated_yaml, frontier, plot, router_file, separation, stacked_file, table
from loadtest.tasks import Task, TaskFileError, load_tasks, score
from protos import kvcascade_pb2 as pb
from router.cascade_config import CascadeConfig, CascadeConfigError, load_cascade
from router.confidence import MEASURES, create_measure
from router.prompt_router import PromptRouter, cross_fit
from router.stacked_confidence import OWN_MEASURES, StackedModel, features, own_scores, surer
from router.stacked_confidence import cross_fit as cross_fit_stacked

TOP_LOGPROBS = 20  # asked of every tier and judge, so every measure can be replayed


# --- settings and their replay --------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """How one tier (not the last) decides: see ``TierConfig.accepts`` and ``judged``."""

    measure: str
    threshold: float | None  # None: never accepted on its own confidence
    judge_measure: str | None = None  # None: no judge
    judge_threshold: float | None = None
    floor: float | None = None  # below it (own measure), escalate unjudged
    route_threshold: float | None = None  # the prompt router's score below which the tier is skipped

    @property
    def family(self) -> str:
        route = "route + " if self.route_threshold is not None else ""
        if self.judge_measure is None:
            return f"{route}own {self.measure}"
        if self.threshold is None and self.floor is None:
            return f"{route}judge {self.judge_measure}"
        return f"{route}own {self.measure} + judge {self.judge_measure}"

    def skips(self, answer: dict) -> bool:
        """The prompt router sends this task on before the tier runs (``answer["route"]``: its score)."""
        return self.route_threshold is not None and answer.get("route") is not None \
            and answer["route"] < self.route_threshold


def decide(setting: Setting, own: dict[str, float | None], judge: dict[str, float | None]) -> tuple[bool, bool]:
    """(accepted, judged) for one answer with these scores (None: no tokens to score)."""
    conf = own[setting.measure]
    if conf is None:
        return False, False
    if setting.threshold is not None and surer(setting.measure, conf, setting.threshold):
        return True, False
    if setting.judge_measure is None:
        return False, False
    if setting.floor is not None and not surer(setting.measure, conf, setting.floor):
        return False, False
    jscore = judge[setting.judge_measure]
    return jscore is not None and surer(setting.judge_measure, jscore, setting.judge_threshold), True


def _cost(tier: dict, k: int) -> float:
    """Compute of ``tier`` answering task ``k``: 2 x parameters x (prompt + generated tokens)."""
    ans = tier["answers"][k]
    return 2 * tier["params"] * (ans["prompt_tokens"] + ans["completion_tokens"])


def _last_alone(runs: dict, idx: Sequence[int]) -> float:
    """What every relative compute figure divides by: the last tier answering ``idx`` alone."""
    return sum(_cost(runs["tiers"][-1], k) for k in idx)


def replay(runs: dict, idx: Sequence[int], settings: Sequence[Setting], rights: list[bool] | None = None) -> dict:
    """Accuracy, cost and escalations of the cascade with ``settings`` (one per tier but the last)
    over the tasks ``idx``; compute is relative to the last tier alone. ``rights``, if given, gets
    whether each task of ``idx`` was answered right, in order."""
    tiers = runs["tiers"]
    block = runs.get("block_size", 16)
    right = compute = 0.0
    reached = [0] * len(tiers)  # tasks each tier generated for
    judged = 0
    for k in idx:
        for i, tier in enumerate(tiers):
            ans = tier["answers"][k]
            if i < len(tiers) - 1 and settings[i].skips(ans):
                continue
            reached[i] += 1
            compute += _cost(tier, k)
            if i == len(tiers) - 1:
                right += ans["correct"]
                if rights is not None:
                    rights.append(bool(ans["correct"]))
                break
            accepted, was_judged = decide(settings[i], ans["own"], ans["judge"])
            if was_judged:
                judged += 1
                compute += 2 * tiers[i + 1]["params"] * (ans["judge_tokens"] + 1)
            if accepted:
                right += ans["correct"]
                if rights is not None:
                    rights.append(bool(ans["correct"]))
                break
            if was_judged:  # the next tier's prompt blocks are in its prefix cache now
                nxt = tiers[i + 1]["answers"][k]["prompt_tokens"]
                compute -= 2 * tiers[i + 1]["params"] * (nxt // block * block)
    n = len(idx)
    return {"accuracy": right / n, "compute": compute / _last_alone(runs, idx), "last_tier_share": reached[-1] / n,
            "judged": judged / n, "settings": [asdict(s) for s in settings]}


def oracle(runs: dict, idx: Sequence[int], before: bool = False) -> dict:
    """The bound no measure can beat: each task answered by the first tier that gets it right, or
    by the first tier when none does, with no judging: what a router that knew the answers would
    pay, running every tier before that one (or, ``before``, deciding before any runs: the bound
    of a prompt router)."""
    tiers = runs["tiers"]
    right = compute = 0.0
    last_share = 0
    for k in idx:
        answering = next((i for i, t in enumerate(tiers) if t["answers"][k]["correct"]), 0)
        right += tiers[answering]["answers"][k]["correct"]
        last_share += answering == len(tiers) - 1
        compute += sum(_cost(tier, k) for tier in tiers[answering if before else 0: answering + 1])
    return {"accuracy": right / len(idx), "compute": compute / _last_alone(runs, idx),
            "last_tier_share": last_share / len(idx), "judged": 0.0}


def compute_alone(runs: dict, tier: int, idx: Sequence[int]) -> float:
    """Compute of ``tier`` answering every task alone, relative to the last tier alone."""
    return sum(_cost(runs["tiers"][tier], k) for k in idx) / _last_alone(runs, idx)


def accuracy(runs: dict, tier: int, idx: Sequence[int]) -> float:
    return sum(runs["tiers"][tier]["answers"][k]["correct"] for k in idx) / len(idx)


def _quantiles(values: list[float], n: int) -> list[float]:
    values = sorted(values)
    if len(values) <= n:
        return values
    return sorted({values[round(q * (len(values) - 1) / (n - 1))] for q in range(n)})


def candidates(runs: dict, tier: int, idx: Sequence[int], grid: int, exact: bool = True) -> list[Setting]:
    """Settings worth trying for ``tier`` (module docstring, step 2); ``exact``: every distinct
    threshold for the one-parameter families (else ``grid`` quantiles, as for the combined one).
    With prompt-router scores (``route``), each own-measure and judge setting also with the router
    in front at each of 2 x ``grid`` quantiles of its scores."""
    answers = [runs["tiers"][tier]["answers"][k] for k in idx]
    out = _unrouted(answers, grid, exact)
    routes = [a["route"] for a in answers if a.get("route") is not None]
    if routes:
        plain = [s for s in out if s.floor is None]  # own or judge alone: the combined ones are many
        for r in _quantiles(routes, 2 * grid)[1:]:  # the lowest skips nothing: that is the plain setting
            out += [replace(s, route_threshold=r) for s in plain]
    return out


def _unrouted(answers: list[dict], grid: int, exact: bool) -> list[Setting]:
    out: list[Setting] = []
    # The stacked confidence where calibration fit one (attach_stacked), as any own measure.
    owns = [*MEASURES, *(["stacked"] if any(a["own"].get("stacked") is not None for a in answers) else [])]
    never = {m: (math.inf if OWN_MEASURES[m].higher_is_surer else -math.inf) for m in owns}
    for m in owns:
        own = [a["own"][m] for a in answers if a["own"][m] is not None]
        for t in [*(sorted(set(own)) if exact else _quantiles(own, grid)), never[m]]:
            out.append(Setting(m, t))
    for jm in MEASURES:
        scores = [a["judge"][jm] for a in answers if a["judge"][jm] is not None]
        for jt in [*(sorted(set(scores)) if exact else _quantiles(scores, grid))]:
            out.append(Setting("mean_logprob", None, jm, jt))
    if not exact:
        return out
    for m, jm in itertools.product(owns, MEASURES):
        own = _quantiles([a["own"][m] for a in answers if a["own"][m] is not None], grid)
        scores = _quantiles([a["judge"][jm] for a in answers if a["judge"][jm] is not None], grid)
        for hi, lo in itertools.combinations_with_replacement(own, 2):
            if OWN_MEASURES[m].higher_is_surer:
                lo, hi = min(lo, hi), max(lo, hi)
            else:
                lo, hi = max(lo, hi), min(lo, hi)
            out += [Setting(m, hi, jm, jt, lo) for jt in scores]
    return out


def search(runs: dict, calib: Sequence[int], target: float, grid: int) -> tuple[dict, list[dict], float]:
    """Every candidate setting replayed on ``calib``; the cheapest reaching ``target`` x the last
    tier's accuracy (else the most accurate), all the points, and that goal."""
    last = len(runs["tiers"]) - 1
    per_tier = [candidates(runs, i, calib, grid, exact=last == 1) for i in range(last)]
    goal = target * accuracy(runs, last, calib) - 1e-12
    points = [replay(runs, calib, combo) | {"combo": combo} for combo in itertools.product(*per_tier)]
    return _pick(points, goal), points, goal


def _pick(points: list[dict], goal: float) -> dict:
    """The cheapest point reaching ``goal`` accuracy, else the most accurate."""
    reaching = [p for p in points if p["accuracy"] >= goal]
    if reaching:
        return min(reaching, key=lambda p: (p["compute"], -p["accuracy"]))
    return min(points, key=lambda p: (-p["accuracy"], p["compute"]))


def family(point: dict) -> str:
    """The family of a point's settings, as calibration.md names it (``route + own stacked``)."""
    return " | ".join(s.family for s in point["combo"])


def attach_routes(runs: dict, calib: Sequence[int], held: Sequence[int], seed: int) -> list[PromptRouter]:
    """Every tier but the last gets a prompt router trained on the calibration split; each answer
    its score (``route``): cross-fitted on the calibration split (so thresholds are picked on
    scores of prompts the router did not learn from), from the fold routers' average on the
    held-out one (``cross_fit``)."""
    prompts = [t["prompt"] for t in runs["tasks"]]
    routers = []
    for tier in runs["tiers"][:-1]:
        answers = tier["answers"]
        texts, right = [prompts[k] for k in calib], [bool(answers[k]["correct"]) for k in calib]
        scores, router = cross_fit(texts, right, seed=seed)
        for k, score in zip(calib, scores):
            answers[k]["route"] = score
        for k in held:
            answers[k]["route"] = router.score(prompts[k])
        routers.append(router)
    return routers


def attach_stacked(runs: dict, calib: Sequence[int], held: Sequence[int], seed: int) -> list[StackedModel]:
    """Every tier but the last gets a stacked confidence (router/stacked_confidence.py) over the
    prompt's words and its draft's own measures, fit on the calibration split; each answer its
    score as the measure ``own["stacked"]``: cross-fitted on the calibration split, from the fold
    models' average on the held-out one (what the router computes at serve time)."""
    prompts = [t["prompt"] for t in runs["tasks"]]
    models = []
    for tier in runs["tiers"][:-1]:
        answers, window = tier["answers"], tier.get("window")
        rows = [stacked_row(a, window) for a in answers]
        fit = [k for k in calib if rows[k] is not None]
        scores, model = cross_fit_stacked([prompts[k] for k in fit], [rows[k] for k in fit],
                                          [bool(answers[k]["correct"]) for k in fit], seed=seed,
                                          top_logprobs=tier.get("top_logprobs", TOP_LOGPROBS))
        for a in answers:
            a["own"]["stacked"] = None
        for k, score in zip(fit, scores):
            answers[k]["own"]["stacked"] = score
        for k in held:
            if rows[k] is not None:
                answers[k]["own"]["stacked"] = model.score(prompts[k], rows[k])
        models.append(model)
    return models


class UnknownFamily(ValueError):
    """``--family`` names no family of the settings swept."""


def calibrate(runs: dict, target: float, split: float, seed: int, grid: int, route: bool = True,
              stacked: bool = True, only: str | None = None) -> dict:
    """Pick on the calibration split, report on the held-out one (module docstring, step 3);
    ``route``: with prompt routers in front of the tiers as candidates too (their weights in the
    result's ``routers``); ``stacked``: with the stacked confidence as an own measure (its models in
    ``stacked``); ``only``: pick from that family alone (UnknownFamily naming them if there is none)."""
    n = len(runs["tasks"])
    calib, held = halves(n, split, seed)
    routers = attach_routes(runs, calib, held, seed) if route else []
    models = attach_stacked(runs, calib, held, seed) if stacked else []
    best, points, goal = search(runs, calib, target, grid)
    # The held-out curve of each family: its settings' cheapest points, cost against accuracy.
    families: dict[str, list[dict]] = {}
    for p in points:
        families.setdefault(family(p), []).append(p)
    if only is not None:
        if only not in families:
            raise UnknownFamily(f"no family {only!r}; the families: {sorted(families)}")
        best = _pick(families[only], goal)
    curves = {name: frontier([replay(runs, held, p["combo"]) for p in pts]) for name, pts in families.items()}
    per_family = {}
    for name, pts in families.items():
        ok = [p for p in pts if p["accuracy"] >= goal]
        if ok:
            pick = min(ok, key=lambda p: (p["compute"], -p["accuracy"]))
            per_family[name] = {"calibration": _strip(pick), "held_out": replay(runs, held, pick["combo"])}
    return {
        "target": target, "tasks": n, "calibration_tasks": len(calib), "held_out_tasks": len(held),
        "tiers": [{"name": t["name"], "model": t["model"], "params": t["params"],
                   "accuracy": {"calibration": accuracy(runs, i, calib), "held_out": accuracy(runs, i, held)},
                   "compute_alone": compute_alone(runs, i, held)}
                  for i, t in enumerate(runs["tiers"])],
        "reached_target": best["accuracy"] >= goal,
        "picked": {"calibration": _strip(best), "held_out": replay(runs, held, best["combo"])},
        "oracle": oracle(runs, held), "oracle_before": oracle(runs, held, before=True),
        "per_family": per_family, "curves": curves, "routers": [r.to_json() for r in routers],
        "stacked": [m.to_json() for m in models],
        "auroc": {"calibration": separation(runs, calib), "held_out": separation(runs, held)},
    }


def halves(n: int, split: float, seed: int) -> tuple[list[int], list[int]]:
    """The seeded calibration and held-out task indices (a ``split`` share calibrates, each side non-empty)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = max(1, min(n - 1, round(n * split)))
    return sorted(order[:cut]), sorted(order[cut:])


def _strip(point: dict) -> dict:
    return {k: v for k, v in point.items() if k != "combo"}


# --- collecting the answers -------------------------------------------------------------------


def collect(config: CascadeConfig, tasks: list[Task], max_tokens: int, device: str, dtype: str) -> dict:
    """Every tier's answers and every judge's scores (module docstring, step 1)."""
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    tiers = []
    engines: dict[str, LLMEngine] = {}
    for tier in config.tiers:
        if tier.model not in engines:
            engines[tier.model] = LLMEngine(EngineConfig(model=tier.model, device=device, dtype=dtype,
                                                         max_model_len=1024, kv_cache_bytes=512 * 2**20))
        engine = engines[tier.model]
        started = time.monotonic()
        prompts = [engine.tokenize(messages=[{"role": "user", "content": t.prompt}]) for t in tasks]
        outs = _run(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=TOP_LOGPROBS))
        answers = []
        for task, prompt, out in zip(tasks, prompts, outs):
            lps = [pb.TokenLogprob(logprob=lp.logprob, top=[pb.TopLogprob(logprob=v) for _, v in lp.top])
                   for lp in out["logprobs"]]
            answers.append(answer_record(task, prompt, out["text"], out["token_ids"], lps, tier.window,
                                         tier.top_logprobs))
        params = matmul_params(engine.model)
        print(f"{tier.name} ({tier.model}): {sum(a['correct'] for a in answers)}/{len(tasks)} right in "
              f"{time.monotonic() - started:.0f} s", file=sys.stderr)
        tiers.append({"name": tier.name, "model": tier.model, "params": params, "window": tier.window,
                      "top_logprobs": tier.top_logprobs, "answers": answers})
    for i, tier in enumerate(config.tiers[:-1]):
        judge_engine = engines[config.tiers[i + 1].model]
        started = time.monotonic()
        answers = tiers[i]["answers"]
        jprompts = [judge_engine.tokenize(messages=[{"role": "user", "content": t.prompt}]) for t in tasks]
        runs = [(p + a["token_ids"], len(p)) for p, a in zip(jprompts, answers)]
        judged = _judge(judge_engine, runs)
        for a, (ids, _), lps in zip(answers, runs, judged):
            a["judge_tokens"] = len(ids)
            a["judge"] = {m: (create_measure(m, TOP_LOGPROBS).score(lps) if lps else None) for m in MEASURES}
        print(f"{config.tiers[i + 1].name} judged {tier.name}'s answers in {time.monotonic() - started:.0f} s",
              file=sys.stderr)
    for a in tiers[-1]["answers"]:
        a["judge"], a["judge_tokens"] = {m: None for m in MEASURES}, 0
    for a in (a for t in tiers for a in t["answers"]):
        del a["prompt"]
    block_size = next(iter(engines.values())).config.block_size
    return {"tasks": [asdict(t) for t in tasks], "max_tokens": max_tokens, "block_size": block_size, "tiers": tiers}


def answer_record(task: Task, prompt: list[int], text: str, token_ids: list[int], logprobs: list[pb.TokenLogprob],
                  window: int | None, top_logprobs: int) -> dict:
    """What calibration keeps of one tier's answer: its tokens, whether it is right, and its own
    measures over ``window`` (what the router computes from the same logprobs at serve time)."""
    return {"text": text, "token_ids": token_ids, "prompt": prompt, "prompt_tokens": len(prompt),
            "completion_tokens": len(token_ids), "correct": score(task, text),
            "own": own_scores(logprobs[:window] if window else logprobs, top_logprobs)}


def stacked_row(answer: dict, window: int | None) -> dict[str, float] | None:
    """The stacked confidence's features of a recorded answer's draft (router/stacked_confidence.py)."""
    tokens = answer["completion_tokens"]
    return features(answer["own"], min(tokens, window) if window else tokens)


def matmul_params(model) -> int:
    """Parameters a token multiplies through: all but the input embedding, a lookup (unless it is
    also the LM head), packed or not. Qwen2.5-0.5B: 494 M of 630 M stored; 1.5B: 1,544 M of 1,777 M."""
    from worker.models.quantization import QuantizedLinearWeight

    total = sum(p.numel() for p in model.parameters())  # packed projections hold buffers, not parameters:
    total += sum(m.shape[0] * m.shape[1] for m in model.modules() if isinstance(m, QuantizedLinearWeight))
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    return total if embed is head else total - embed.numel()


def _run(engine, prompts: list[list[int]], params) -> list[dict]:
    import torch

    ids = [engine.add_request(p, params) for p in prompts]
    got = {i: {"text": "", "token_ids": [], "logprobs": []} for i in ids}
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                g = got[out.request_id]
                g["text"] += out.text_delta
                g["token_ids"] += out.new_token_ids
                g["logprobs"] += out.logprobs or []
    return [got[i] for i in ids]


def _judge(engine, runs: list[tuple[list[int], int]]) -> list[list[pb.TokenLogprob]]:
    """The judging model's logprobs of each ``ids[start:]`` (a draft), as the router's judge asks
    (one batch of prefills)."""
    import torch

    from worker.engine.sampling_params import SamplingParams

    rids = {}
    for k, (ids, start) in enumerate(runs):
        if start < len(ids):
            params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP_LOGPROBS,
                                    prompt_logprobs_start=start)
            rids[engine.add_request(ids, params)] = k
    entries: list[list] = [[] for _ in runs]
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                if out.prompt_logprobs is not None:
                    entries[rids[out.request_id]] = out.prompt_logprobs
    return [[pb.TokenLogprob(logprob=e.logprob, top=[pb.TopLogprob(logprob=v) for _, v in e.top]) for e in got]
            for got in entries]


# --- the command ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="cascade_command", required=True, metavar="COMMAND")
    cal = commands.add_parser("calibrate", help="find the cheapest setting that keeps a target share of quality",
                              description=__doc__.split("\n\n")[0])
    cal.add_argument("--config", required=True, type=Path, help="the cascade file to calibrate")
    cal.add_argument("--tasks", type=Path, default=Path("deploy/cascade_tasks.jsonl"),
                     help="labelled tasks, JSON Lines (loadtest/tasks.py; default: %(default)s)")
    cal.add_argument("--target-quality", type=float, default=0.98,
                     help="share of the last tier's accuracy to keep (default: %(default)s)")
    cal.add_argument("--out", type=Path, default=Path("runs/calibrate"), help="output folder (default: %(default)s)")
    cal.add_argument("--write", type=Path, help="the calibrated cascade file (default: OUT/cascade.calibrated.yaml)")
    cal.add_argument("--split", type=float, default=0.5, help="share of tasks to calibrate on (default: %(default)s)")
    cal.add_argument("--seed", type=int, default=0, help="the split's seed (default: %(default)s)")
    cal.add_argument("--grid", type=int, default=12,
                     help="quantiles per threshold of the combined own + judge settings (default: %(default)s)")
    cal.add_argument("--max-tokens", type=int, default=16, help="answer length cap (default: %(default)s)")
    cal.add_argument("--limit", type=int, help="use only the first N tasks")
    cal.add_argument("--device", default="cpu")
    cal.add_argument("--dtype", default="float32")
    cal.add_argument("--no-route", dest="route", action="store_false",
                     help="leave prompt routers out of the candidates (router/prompt_router.py)")
    cal.add_argument("--no-stacked", dest="stacked", action="store_false",
                     help="leave the stacked confidence out of the candidates (router/stacked_confidence.py)")
    cal.add_argument("--family", help="pick from this family of settings only, as calibration.md names them "
                     "(e.g. 'route + own stacked'; default: every family)")
    cal.add_argument("--from", dest="replay_from", type=Path, help="replay a runs.json instead of running the models")


def main(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"kvcascade cascade calibrate: error: {message}", file=sys.stderr)
        return 2

    if not 0 < args.target_quality <= 1:
        return fail(f"--target-quality: must be in (0, 1], got {args.target_quality}")
    if not 0 < args.split < 1:
        return fail(f"--split: must be in (0, 1), got {args.split}")
    try:
        config = load_cascade(args.config)
        tasks = load_tasks(args.tasks)
    except (CascadeConfigError, TaskFileError) as err:
        return fail(str(err))
    except OSError as err:
        return fail(f"{err.filename}: cannot read: {err.strerror}")
    if config.mode != "full" or not config.original_prompt_only:
        return fail(f"{args.config}: calibration replays mode: full with original_prompt_only: true")
    tasks = tasks[: args.limit] if args.limit else tasks
    if len(tasks) < 2:
        return fail("need at least 2 tasks (one to calibrate on, one held out)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replay_from:
        runs = json.loads(args.replay_from.read_text())
        if [t["model"] for t in runs["tiers"]] != [t.model for t in config.tiers]:
            return fail(f"--from {args.replay_from}: its tiers' models differ from {args.config}'s")
        for saved, tier in zip(runs["tiers"], config.tiers):  # (a runs.json from before they were saved)
            saved.setdefault("window", tier.window)
            saved.setdefault("top_logprobs", tier.top_logprobs)
    else:
        runs = collect(config, tasks, args.max_tokens, args.device, args.dtype)
        (args.out / "runs.json").write_text(json.dumps(runs))
    try:
        result = calibrate(runs, args.target_quality, args.split, args.seed, args.grid, args.route, args.stacked,
                           args.family)
    except UnknownFamily as err:
        return fail(f"--family: {err}")
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (args.out / "calibration.md").write_text(text)
    plot(result, args.out / "curve.png")
    written = args.write or args.out / "cascade.calibrated.yaml"
    written.write_text(calibrated_yaml(args.config, result, written))
    for tier, setting, router in zip(config.tiers, result["picked"]["calibration"]["settings"], result["routers"]):
        if setting.get("route_threshold") is not None:
            router_file(written, tier.name).write_text(json.dumps(router))
    for tier, setting, model in zip(config.tiers, result["picked"]["calibration"]["settings"], result["stacked"]):
        if setting["measure"] == "stacked":
            stacked_file(written, tier.name).write_text(json.dumps(model))
    print(text)
    if not result["reached_target"]:
        print(f"no setting reached {args.target_quality:.0%} of the last tier's accuracy on the calibration "
              "split; wrote the most accurate one", file=sys.stderr)
    print(f"wrote {written} and {args.out}/", file=sys.stderr)
    return 0
