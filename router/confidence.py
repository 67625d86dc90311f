"""Confidence measures of a cascade tier: how sure a model was of the tokens it produced.

Each measure is one small class behind one interface, chosen by name in the cascade file:

    mean_logprob   mean log-probability of the chosen tokens            (higher: surer)
    sum_logprob    log-probability of the whole answer (or window)      (higher: surer)
    min_prob       probability of the least likely chosen token         (higher: surer)
    mean_entropy   mean entropy of the next-token distribution, in nats (lower: surer)

The workers return each chosen token's logprob, and with ``logprobs=N`` the N most likely
alternatives. The full distribution never leaves the worker, so ``mean_entropy`` is the entropy of
the top-N renormalised to sum to one (N = ``top_logprobs``, 20 by default): it ignores the tail,
so it reads somewhat lower than the true entropy, more so for flat distributions; with N = 20 the
tail rarely holds much mass after a confident token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Protocol

from protos import kvcascade_pb2 as pb


class ConfidenceMeasure(Protocol):
    name: ClassVar[str]
    higher_is_surer: ClassVar[bool]

    @property
    def top_logprobs(self) -> int:
        """The ``logprobs`` a tier must be asked for (0: the chosen tokens' logprobs only)."""
        ...

    def score(self, logprobs: Sequence[pb.TokenLogprob]) -> float:
        """The measure over these tokens (never called with none)."""
        ...


class MeanLogprob:
    name = "mean_logprob"
    higher_is_surer = True
    top_logprobs = 0

    def score(self, logprobs: Sequence[pb.TokenLogprob]) -> float:
        return sum(lp.logprob for lp in logprobs) / len(logprobs)


class SumLogprob:
    """The answer's own probability: unlike the mean, a longer answer must be surer at every
    token to score as high (on the calibration tasks it separated right from wrong answers best)."""

    name = "sum_logprob"
    higher_is_surer = True
    top_logprobs = 0

    def score(self, logprobs: Sequence[pb.TokenLogprob]) -> float:
        return sum(lp.logprob for lp in logprobs)


class MinProb:
    name = "min_prob"
    higher_is_surer = True
    top_logprobs = 0

    def score(self, logprobs: Sequence[pb.TokenLogprob]) -> float:
        return math.exp(min(lp.logprob for lp in logprobs))


class MeanEntropy:
    name = "mean_entropy"
    higher_is_surer = False

    def __init__(self, top_logprobs: int = 20):
        self.top_logprobs = top_logprobs

    def score(self, logprobs: Sequence[pb.TokenLogprob]) -> float:
        return sum(_entropy(lp) for lp in logprobs) / len(logprobs)


def _entropy(lp: pb.TokenLogprob) -> float:
    """Entropy of the returned top-N, renormalised (the chosen token alone when there is no top)."""
    values = [t.logprob for t in lp.top] or [lp.logprob]
    peak = max(values)
    weights = [math.exp(v - peak) for v in values]
    total = sum(weights)
    return -sum(w / total * math.log(w / total) for w in weights if w > 0)


MEASURES = {m.name: m for m in (MeanLogprob, SumLogprob, MinProb, MeanEntropy)}


def create_measure(name: str, top_logprobs: int = 20) -> ConfidenceMeasure:
    if name == MeanEntropy.name:
        return MeanEntropy(top_logprobs)
    return MEASURES[name]()
