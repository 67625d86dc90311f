"""A tier's stacked confidence: the chance that its draft is right, from the prompt *and* the draft.

The prompt router (router/prompt_router.py) reads only the question: it knows which kinds a tier
gets wrong, not which capital the small model happens to know. The tier's own logprobs
(router/confidence.py) read only the answer, on one scale for every kind of question: but a right
letter-of-a-word answer from the 0.5B is typically less sure than a wrong chemical symbol (issue
16). One logistic regression over both, fit on the calibration split, learns how sure a draft
must be *for this kind of prompt*:

    P(right) = sigmoid(bias + prompt(text) + sum_f weight_f x feature_f)

    prompt(text)   a weight per hashed word n-gram of the prompt, as the prompt router hashes and
                   sums them (over the root of their count), so the kind of question shifts the bar
    sum_logprob    the draft's (window's) log-probability
    mean_logprob   ... per token
    min_logprob    log of min_prob: the least likely chosen token
    mean_entropy   of the top-N renormalised (router/confidence.py)
    log_tokens     log of the number of tokens scored

The n-gram weights and the draft's are fit together, not the router's score fed in as one
feature: the router's score says how often a kind is right, not what confidence is right for it
(on the calibration split the joint fit separated right from wrong drafts better). A tier with
``measure: stacked`` accepts its draft when P(right) >= ``threshold``. Every term is a function of
the prompt's text and the window's logprobs only, so the router computes it at serve time as
``kvcascade cascade calibrate`` replays it. A prompt given as token ids has no words: its prompt
term is 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

from protos import kvcascade_pb2 as pb
from router.confidence import MEASURES, create_measure
from router.prompt_router import DIM, PromptRouter, PromptRouterError, fold_splits, read_json
from router.prompt_router import features as prompt_features

FORMAT = "kvcascade-stacked-confidence/1"
FEATURES = ("sum_logprob", "mean_logprob", "min_logprob", "mean_entropy", "log_tokens")


class StackedConfidenceError(ValueError):
    """A stacked-confidence file that cannot be used; the message names the file and the field."""


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z > -60 else 0.0


def own_scores(window: Sequence[pb.TokenLogprob], top_logprobs: int) -> dict[str, float | None]:
    """Every own measure over a window of logprobs: what calibration records for a draft (``own``)
    and what the stacked measure reads at serve time (None each for an empty window)."""
    return {m: (create_measure(m, top_logprobs).score(window) if window else None) for m in MEASURES}


def features(own: Mapping[str, float | None], tokens: int) -> dict[str, float] | None:
    """The draft's named features: ``own`` its measures (``own_scores``), ``tokens`` how many it
    scored; None when it scored none."""
    if tokens < 1 or any(own[m] is None for m in MEASURES):
        return None
    return {"sum_logprob": own["sum_logprob"], "mean_logprob": own["mean_logprob"],
            "min_logprob": math.log(max(own["min_prob"], 1e-30)), "mean_entropy": own["mean_entropy"],
            "log_tokens": math.log(tokens)}


class StackedModel:
    """The weights of the prompt's n-grams (``prompt``, a PromptRouter without bias) and of the
    draft's features ``names`` (a subset of FEATURES), and the bias."""

    def __init__(self, prompt: PromptRouter, names: Sequence[str], weights: Sequence[float], bias: float,
                 top_logprobs: int = 20, trained_on: int = 0):
        self.prompt, self.names = prompt, tuple(names)
        self.weights = np.asarray(weights, dtype=np.float64)
        assert self.weights.shape == (len(self.names),) and set(self.names) <= set(FEATURES)
        self.bias, self.top_logprobs, self.trained_on = float(bias), top_logprobs, trained_on

    def prompt_logit(self, prompt: str | None) -> float:
        """The prompt's term (0 for a prompt without text)."""
        return self.prompt.logit(prompt) if prompt is not None else 0.0

    def score(self, prompt: str | None, row: Mapping[str, float]) -> float:
        """P(right) of a draft with these features (``features``) answering this prompt."""
        return self.score_with(self.prompt_logit(prompt), row)

    def score_with(self, prompt_logit: float, row: Mapping[str, float]) -> float:
        return _sigmoid(prompt_logit + self.bias + sum(float(w) * row[n] for n, w in zip(self.names, self.weights)))

    def measure(self, prompt: str | None) -> StackedMeasure:
        return StackedMeasure(self, self.prompt_logit(prompt))

    @classmethod
    def train(cls, prompts: Sequence[str], rows: Sequence[Mapping[str, float]], right: Sequence[bool],
              names: Sequence[str] = FEATURES, l2_prompt: float = 1e-3, l2_own: float = 1e-2,
              top_logprobs: int = 20) -> StackedModel:
        """Fit by Newton's method on the mean log loss plus ``l2_prompt`` |n-gram weights|^2 and
        ``l2_own`` |draft weights|^2, the draft's features standardised (so one penalty suits all)
        and each prompt's n-grams of unit norm, as the prompt router's; only the n-grams the
        prompts hold are solved for. The defaults separated best in cross-fitting on the
        calibration split of deploy/cascade_tasks.jsonl (docs/BENCHMARKS.md)."""
        if not len(prompts) == len(rows) == len(right) or not rows:
            raise ValueError("train: need as many prompts, rows and labels, and at least one")
        grams = [prompt_features(p) for p in prompts]
        cols = np.unique(np.concatenate(grams))
        g = np.zeros((len(rows), len(cols)))
        for i, idx in enumerate(grams):
            g[i, np.searchsorted(cols, idx)] = 1.0 / math.sqrt(len(idx))
        x = np.array([[r[n] for n in names] for r in rows], dtype=np.float64)
        mean, scale = x.mean(axis=0), x.std(axis=0)
        scale[scale < 1e-9] = 1.0  # a constant feature: its weight stays 0 under the penalty
        z = np.hstack([g, (x - mean) / scale, np.ones((len(rows), 1))])
        y = np.asarray(right, dtype=np.float64)
        rate = float(np.clip(y.mean(), 1e-3, 1 - 1e-3))
        w = np.zeros(z.shape[1])
        w[-1] = math.log(rate / (1 - rate))
        if len(set(right)) > 1:  # (one kind of label: the base rate; the bias alone would diverge)
            penalty = np.concatenate([np.full(len(cols), 2 * l2_prompt), np.full(len(names), 2 * l2_own), [0.0]])
            for _ in range(50):
                p = 1.0 / (1.0 + np.exp(-np.clip(z @ w, -60, 60)))
                grad = z.T @ (p - y) / len(y) + penalty * w
                hess = (z.T * (p * (1 - p))) @ z / len(y) + np.diag(penalty) + 1e-9 * np.eye(len(w))
                step = np.linalg.solve(hess, grad)
                w -= step
                if np.abs(step).max() < 1e-9:
                    break
        ngrams = np.zeros(DIM, dtype=np.float32)
        ngrams[cols] = w[: len(cols)]
        own = w[len(cols): -1] / scale
        return cls(PromptRouter(ngrams, 0.0, trained_on=len(rows)), names, own, w[-1] - float(own @ mean),
                   top_logprobs, trained_on=len(rows))

    def to_json(self) -> dict:
        return {"format": FORMAT, "features": list(self.names), "weights": [float(w) for w in self.weights],
                "bias": self.bias, "top_logprobs": self.top_logprobs, "trained_on": self.trained_on,
                "prompt": self.prompt.to_json()}

    @classmethod
    def from_json(cls, data: object, source: str = "<stacked>") -> StackedModel:
        def fail(field: str, message: str) -> StackedConfidenceError:
            return StackedConfidenceError(f"{source}: {field}: {message}")

        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise StackedConfidenceError(f"{source}: not a stacked confidence file (format must be {FORMAT!r})")
        names, weights = data.get("features"), data.get("weights")
        if not isinstance(names, list) or not names or any(n not in FEATURES for n in names) \
                or len(set(names)) != len(names):
            raise fail("features", f"must be a list of distinct names from {list(FEATURES)}, not {names!r}")
        if not isinstance(weights, list) or len(weights) != len(names) or not all(_finite(w) for w in weights):
            raise fail("weights", f"must be {len(names)} numbers, one per feature, not {weights!r}")
        if not _finite(data.get("bias")):
            raise fail("bias", f"must be a number, not {data.get('bias')!r}")
        top = data.get("top_logprobs", 20)
        if not isinstance(top, int) or isinstance(top, bool) or top < 1:
            raise fail("top_logprobs", f"must be an integer >= 1, not {top!r}")
        try:
            prompt = PromptRouter.from_json(data.get("prompt"), f"{source}: prompt")
        except PromptRouterError as err:
            raise StackedConfidenceError(str(err)) from None
        return cls(prompt, names, weights, data["bias"], top, int(data.get("trained_on", 0)))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> StackedModel:
        return cls.from_json(read_json(path, StackedConfidenceError), str(path))


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class StackedMeasure:
    """The stacked model bound to one request's prompt (its term computed once): a confidence
    measure over a window of logprobs like router/confidence.py's."""

    name: ClassVar[str] = "stacked"
    higher_is_surer: ClassVar[bool] = True

    def __init__(self, model: StackedModel, prompt_logit: float):
        self.model, self.prompt_logit = model, prompt_logit

    @property
    def top_logprobs(self) -> int:
        return self.model.top_logprobs

    def score(self, logprobs: Sequence[pb.TokenLogprob]) -> float:
        row = features(own_scores(logprobs, self.top_logprobs), len(logprobs))
        assert row is not None, "a measure is never asked to score no tokens"
        return self.model.score_with(self.prompt_logit, row)


def cross_fit(prompts: Sequence[str], rows: Sequence[Mapping[str, float]], right: Sequence[bool], folds: int = 5,
              seed: int = 0, **train) -> tuple[list[float], StackedModel]:
    """As prompt_router.cross_fit: each draft's score from a model fit on the other folds (what a
    threshold is picked on), and the model for new drafts, the fold models' average (a linear model:
    their mean logit)."""
    scores = [float(np.mean(right))] * len(rows)
    trained = []
    for test, fit in fold_splits(len(rows), folds, seed):
        model = StackedModel.train([prompts[i] for i in fit], [rows[i] for i in fit], [right[i] for i in fit],
                                   **train)
        trained.append(model)
        for i in test:
            scores[i] = model.score(prompts[i], rows[i])
    if not trained:
        return scores, StackedModel.train(prompts, rows, right, **train)
    first = trained[0]
    prompt = PromptRouter(np.mean([m.prompt.weights for m in trained], axis=0), 0.0, trained_on=len(rows))
    mean = StackedModel(prompt, first.names, np.mean([m.weights for m in trained], axis=0),
                        float(np.mean([m.bias for m in trained])), first.top_logprobs, trained_on=len(rows))
    return scores, mean


# The measures a tier may judge its own draft by (a judge: MEASURES only, it reads no prompt).
OWN_MEASURES = {**MEASURES, StackedMeasure.name: StackedMeasure}


def surer(measure: str, value: float, bar: float) -> bool:
    """``value`` of ``measure`` (one of OWN_MEASURES) is at least as sure as ``bar``."""
    return value >= bar if OWN_MEASURES[measure].higher_is_surer else value <= bar
