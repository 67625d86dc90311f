"""Routing policies: given the live workers, their load and how much of the prompt each holds in
KV cache, order the workers best first (the router falls back along that order).

The prefix-aware score of worker w for a prompt of P tokens (the one the router uses by default):

    saved(w)   = cached leading tokens of the prompt on w            (prefill work it avoids)
    backlog(w) = pending_prefill_tokens(w) + decode_cost * running(w) (work queued ahead of us)
               + in_flight(w) * P_avg                                (requests this router sent
                                                                      since w's last heartbeat)
    pressure(w)= 1 - kv_free(w) / kv_total(w)                        (0 empty .. 1 full)
    score(w)   = saved(w) - load_weight * backlog(w) - kv_weight * pressure(w) * P

A hot prefix therefore stays on its worker while the prefill it saves outweighs the queue in front
of it, and spills to a second worker once that worker's backlog is larger than the saving. The
knobs are `PrefixAwareConfig`; ties break on lower backlog, then worker id, so a choice is stable.
"""

from __future__ import annotations

import abc
import itertools
import random
from dataclasses import dataclass

from contracts.state import WorkerInfo


@dataclass
class Candidate:
    worker: WorkerInfo
    cached_tokens: int = 0  # leading prompt tokens held in the worker's prefix cache
    in_flight: int = 0  # requests this router has open on the worker right now


@dataclass(frozen=True)
class PrefixAwareConfig:
    # Tokens of backlog worth one token of saved prefill. Below 1 because a spill costs more than
    # the wait it avoids: the whole prompt's prefill is added to the fleet's work, and its copy
    # evicts other prefixes from the new holder's pool. At 1.0, 32 simulated H200 workers
    # (benchmarks/fleet_sim.py, 256 prompts of 2-4k tokens) near capacity spilled their way into a
    # collapse (prefix hit rate 0.40, 21k output tok/s, below round-robin's 27k); at 0.1 the same
    # arrivals kept a 0.89 hit rate and 53k tok/s, and a prefix taking half the traffic still
    # spread over 5-7 workers (docs/BENCHMARKS.md, "Routing at fleet scale").
    load_weight: float = 0.1
    decode_cost: float = 16.0  # a running decode, in prefill-token equivalents of work
    kv_weight: float = 0.5  # how strongly a full KV cache repels new prompts
    in_flight_tokens: float = 256.0  # assumed size of a request sent but not yet seen in a heartbeat

    def __post_init__(self) -> None:
        for name in ("load_weight", "decode_cost", "kv_weight", "in_flight_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


class RoutingPolicy(abc.ABC):
    name = "base"

    @abc.abstractmethod
    def order(self, candidates: list[Candidate], prompt_tokens: int) -> list[tuple[Candidate, str]]:
        """Candidates best first, each with the reason it was ranked there (for metrics)."""


class PrefixAwarePolicy(RoutingPolicy):
    name = "prefix_aware"

    def __init__(self, config: PrefixAwareConfig | None = None):
        self.config = config or PrefixAwareConfig()

    def backlog(self, c: Candidate) -> float:
        load = c.worker.load
        return load.queued_tokens + self.config.decode_cost * load.running + self.config.in_flight_tokens * c.in_flight

    def score(self, c: Candidate, prompt_tokens: int) -> float:
        load = c.worker.load
        pressure = 1 - load.kv_blocks_free / load.kv_blocks_total if load.kv_blocks_total else 0.0
        return (c.cached_tokens - self.config.load_weight * self.backlog(c)
                - self.config.kv_weight * pressure * prompt_tokens)

    def order(self, candidates, prompt_tokens):
        ranked = sorted(candidates, key=lambda c: (-self.score(c, prompt_tokens), self.backlog(c), c.worker.worker_id))
        if not ranked:
            return []
        best = ranked[0]
        most_cached = max(c.cached_tokens for c in ranked)
        if most_cached == 0:
            reason = "load"  # nothing cached anywhere: pure load balancing
        elif best.cached_tokens == most_cached:
            reason = "prefix_hit"
        else:
            reason = "prefix_spill"  # the holder of the prefix was too busy
        return [(best, reason)] + [(c, "fallback") for c in ranked[1:]]


class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def order(self, candidates, prompt_tokens):
        backlog = PrefixAwarePolicy().backlog
        ranked = sorted(candidates, key=lambda c: (backlog(c), c.worker.worker_id))
        return [(c, "least_load" if i == 0 else "fallback") for i, c in enumerate(ranked)]


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def order(self, candidates, prompt_tokens):
        ranked = sorted(candidates, key=lambda c: c.worker.worker_id)
        if not ranked:
            return []
        k = next(self._counter) % len(ranked)
        ranked = ranked[k:] + ranked[:k]
        return [(c, "round_robin" if i == 0 else "fallback") for i, c in enumerate(ranked)]


class RandomPolicy(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def order(self, candidates, prompt_tokens):
        ranked = list(candidates)
        self._rng.shuffle(ranked)
        return [(c, "random" if i == 0 else "fallback") for i, c in enumerate(ranked)]


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (PrefixAwarePolicy, LeastLoadPolicy, RoundRobinPolicy, RandomPolicy)
}


def create_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None
