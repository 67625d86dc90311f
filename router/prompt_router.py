"""A tier's prompt router: from the prompt's text alone, the chance that the tier answers right.

A cascade that must run its small tier first pays that tier on every request, also on the ones
it will escalate; with a 0.5B beside a 1.5B that is a third of the large model's compute each
time it escalates (issue 16). RouteLLM's answer is to decide before generating: a classifier trained on labelled traffic
sends the prompts the small model gets wrong straight to the large one. This is the smallest
such classifier: a logistic regression over hashed word n-grams of the prompt, numbers reduced
to their digit count ("What is 347 times 29" -> ``what is <3> times <2>``), so it learns which
kinds of question a tier gets wrong and how their size matters, in microseconds per request and
without a model call. ``kvcascade cascade calibrate`` trains it on the calibration split and picks
its threshold with the tier's other settings (``route`` in the cascade file).

It is as good as the traffic it was trained on: a prompt unlike any it saw scores near the
tier's base rate, and the tier's own confidence (and judge) still decide after it runs.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

FORMAT = "kvcascade-prompt-router/1"
DIM = 1 << 14  # hashed feature space; collisions cost little at a few hundred distinct n-grams
_TOKEN = re.compile(r"[a-z]+|\d+|[^\sa-z\d]")
MAX_TOKENS = 256  # words of a prompt the router reads


class PromptRouterError(ValueError):
    """A router file that cannot be used; the message names the file and what is wrong."""


def tokens(text: str) -> list[str]:
    """Lower-cased words and punctuation, each number replaced by its digit count."""
    return [f"<{len(t)}>" if t.isdigit() else t for t in _TOKEN.findall(text.lower())]


def features(text: str) -> np.ndarray:
    """Indices of the prompt's hashed unigrams, bigrams and length bucket (a set: 0/1 features),
    over its first MAX_TOKENS words: the router scores on the event loop, so a long prompt costs
    at most about half a millisecond."""
    toks = tokens(text[: MAX_TOKENS * 16])[:MAX_TOKENS]
    grams = [*toks, *(f"{a} {b}" for a, b in zip(toks, toks[1:])), f"#len{min(len(toks) // 8, 16)}"]
    return np.unique(np.fromiter((zlib.crc32(g.encode()) % DIM for g in grams), dtype=np.int64, count=len(grams)))


def _design(texts: Sequence[str]) -> np.ndarray:
    x = np.zeros((len(texts), DIM), dtype=np.float32)
    for i, text in enumerate(texts):
        idx = features(text)
        x[i, idx] = 1.0 / math.sqrt(len(idx))  # unit norm: one step size suits short and long prompts
    return x


class PromptRouter:
    """P(the tier answers right | prompt) = sigmoid(w . features + bias)."""

    def __init__(self, weights: np.ndarray, bias: float, trained_on: int = 0):
        if weights.shape != (DIM,):
            raise ValueError(f"weights: expected shape ({DIM},), got {weights.shape}")
        self.weights, self.bias, self.trained_on = weights.astype(np.float32), float(bias), trained_on

    def score(self, text: str) -> float:
        z = self.logit(text)
        return 1.0 / (1.0 + math.exp(-z)) if z > -60 else 0.0

    def logit(self, text: str) -> float:
        """The score's log odds (w . features + bias)."""
        idx = features(text)
        return float(self.weights[idx].sum()) / math.sqrt(len(idx)) + self.bias

    @classmethod
    def train(cls, texts: Sequence[str], right: Sequence[bool], l2: float = 1e-3, steps: int = 400) -> PromptRouter:
        """Fit by full-batch gradient descent on the mean log loss plus ``l2`` |w|^2; the bias
        is held at the base rate's log odds, so a prompt none of whose n-grams were seen scores
        the base rate (n-grams every prompt shares, like "?", learn any shift)."""
        if len(texts) != len(right) or not texts:
            raise ValueError("train: need as many labels as texts, and at least one")
        x, y = _design(texts), np.asarray(right, dtype=np.float32)
        rate = float(np.clip(y.mean(), 1e-3, 1 - 1e-3))
        w, b = np.zeros(DIM, dtype=np.float32), math.log(rate / (1 - rate))
        lr = 4.0  # features have unit norm, so the loss's curvature is at most 1/4 + l2
        for _ in range(steps):
            p = 1.0 / (1.0 + np.exp(-(x @ w + b)))
            err = p - y
            w -= lr * (x.T @ err / len(y) + 2 * l2 * w)
        return cls(w, b, trained_on=len(texts))

    def to_json(self) -> dict:
        nz = np.flatnonzero(np.abs(self.weights) > 1e-7)
        return {"format": FORMAT, "dim": DIM, "bias": self.bias, "trained_on": self.trained_on,
                "weights": {str(int(i)): round(float(self.weights[i]), 7) for i in nz}}

    @classmethod
    def from_json(cls, data: dict, source: str = "<router>") -> PromptRouter:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PromptRouterError(f"{source}: not a prompt router file (format must be {FORMAT!r})")
        if data.get("dim") != DIM:
            raise PromptRouterError(f"{source}: dim: this router hashes into {DIM} features, the file {data.get('dim')!r}")
        try:
            weights = np.zeros(DIM, dtype=np.float32)
            for key, value in data.get("weights", {}).items():
                weights[int(key)] = float(value)
            return cls(weights, float(data["bias"]), int(data.get("trained_on", 0)))
        except (KeyError, ValueError, IndexError, TypeError) as err:
            raise PromptRouterError(f"{source}: bad weights or bias: {err}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> PromptRouter:
        return cls.from_json(read_json(path, PromptRouterError), str(path))


def read_json(path: str | Path, error: type[ValueError]) -> object:
    """A model file's JSON, or ``error`` naming the file and why it cannot be read."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except OSError as err:
        raise error(f"{path}: cannot read: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise error(f"{path}: not JSON: {err}") from None


def fold_splits(n: int, folds: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(held out, fit on) index arrays of each of ``folds`` seeded folds over ``n`` items, those
    with an empty side skipped: the folds every cross-fit here shares."""
    order = np.random.default_rng(seed).permutation(n)
    for f in range(folds):
        test = order[f::folds]
        fit = np.setdiff1d(order, test)
        if len(test) and len(fit):
            yield test, fit


def cross_fit(texts: Sequence[str], right: Sequence[bool], folds: int = 5,
              seed: int = 0) -> tuple[list[float], PromptRouter]:
    """Each text's score from a router trained on the other folds (what a threshold may be picked
    on without the router having seen the answer it is scored on), and the router to use on new
    prompts: the fold routers' average (their mean logit), so new prompts score on the same scale
    as the picked threshold: one router trained on every text would score more boldly."""
    scores = [float(np.mean(right))] * len(texts)
    trained = []
    for test, train in fold_splits(len(texts), folds, seed):
        router = PromptRouter.train([texts[i] for i in train], [right[i] for i in train])
        trained.append(router)
        for i in test:
            scores[i] = router.score(texts[i])
    if not trained:
        return scores, PromptRouter.train(texts, right)
    mean = PromptRouter(np.mean([r.weights for r in trained], axis=0), float(np.mean([r.bias for r in trained])),
                        trained_on=len(texts))
    return scores, mean
