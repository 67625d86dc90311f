"""Prometheus metrics of one router (a registry of its own, so several can live in one process)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from contracts.state import WorkerLoad

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvcascade_requests", "Requests by final status", ["status"], registry=r)
        self.ttft = Histogram("kvcascade_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvcascade_tpot_seconds", "Time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.routing = Counter("kvcascade_routing_decisions", "Worker choices by reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("kvcascade_prompt_tokens", "Prompt tokens routed", registry=r)
        self.cached_tokens = Counter("kvcascade_prefix_hit_tokens", "Prompt tokens served from a prefix cache",
                                     registry=r)
        self.completion_tokens = Counter("kvcascade_completion_tokens", "Tokens generated", registry=r)
        self.retries = Counter("kvcascade_worker_retries", "Requests moved to another worker before the "
                               "first token", registry=r)
        self.migrations = Counter("kvcascade_stream_migrations", "Streams moved to another worker after their "
                                  "worker failed mid-stream, by result", ["result"], registry=r)
        self.limited = Counter("kvcascade_requests_limited", "Requests refused (429 / RESOURCE_EXHAUSTED) for their "
                               "client's limits, by which (rate, concurrency)", ["reason"], registry=r)
        self.state_up = Gauge("kvcascade_state_backend_up", "1 while the registry and prefix index answer; "
                              "0 means load-only routing on the last known workers", registry=r)
        self.worker_running = Gauge("kvcascade_worker_running", "Running requests per worker", ["worker"], registry=r)
        self.worker_waiting = Gauge("kvcascade_worker_waiting", "Waiting requests per worker", ["worker"], registry=r)
        self.worker_kv_free = Gauge("kvcascade_worker_kv_blocks_free", "Free KV blocks per worker", ["worker"],
                                    registry=r)
        self.workers_live = Gauge("kvcascade_workers_live", "Workers with a live heartbeat", registry=r)
        self.worker_speculation = WorkerSpeculation(r)
        # The cascade (router/cascade.py). Escalation rate of a tier:
        # decisions{outcome="escalate"} / decisions, both per tier.
        self.cascade_decisions = Counter("kvcascade_cascade_decisions", "Cascade decisions by tier and outcome "
                                         "(accept, escalate; skip: its prompt router sent the request on before it ran)", ["tier", "outcome"], registry=r)
        self.cascade_escalations = Counter("kvcascade_cascade_escalations", "Escalations away from a tier by reason "
                                           "(confidence, judge, limit, error, unavailable, route)", ["tier", "reason"],
                                           registry=r)
        self.cascade_answers = Counter("kvcascade_cascade_answers", "Cascade requests by the tier that answered",
                                       ["tier", "escalated"], registry=r)
        self.cascade_tokens = Counter("kvcascade_cascade_tokens", "Tokens generated per tier: kept (sent to the "
                                      "client) or discarded (an escalated trial)", ["tier", "outcome"], registry=r)
        self.cascade_tier_seconds = Histogram("kvcascade_cascade_tier_seconds", "Time a tier took, from its call "
                                              "to its answer or its escalation", ["tier"],
                                              buckets=_LATENCY_BUCKETS, registry=r)
        self.cascade_confidence = Histogram("kvcascade_cascade_confidence", "Confidence of judged trials (the "
                                            "tier's measure)", ["tier"],
                                            buckets=(-5, -2, -1, -0.5, -0.25, -0.1, 0, 0.25, 0.5, 0.75, 0.9, 1, 2, 5),
                                            registry=r)
        self.cascade_judgements = Counter("kvcascade_cascade_judgements", "Drafts of a tier the next tier "
                                          "judged, by result (accept, reject)", ["tier", "result"], registry=r)
        self.cascade_judge_score = Histogram("kvcascade_cascade_judge_score", "The judge's score of a tier's "
                                             "drafts (its measure over the draft tokens)", ["tier"],
                                             buckets=(-5, -2, -1, -0.5, -0.25, -0.1, 0, 0.25, 0.5, 0.75, 0.9, 1),
                                             registry=r)
        # What the cascade costs, per tier: total compute is about 2 x parameters x (prompt - cached
        # + completion) summed over tiers and roles (answer, trial: escalated from, judge: a prefill).
        self.cascade_usage_tokens = Counter("kvcascade_cascade_usage_tokens", "Tokens a tier processed for "
                                            "cascade requests by role (answer, trial, judge) and kind (prompt, "
                                            "cached: of the prompt, from a prefix cache, completion)",
                                            ["tier", "role", "kind"], registry=r)
        self.cascade_reloads = Counter("kvcascade_cascade_reloads", "Changed cascade files by result (ok; error: "
                                       "refused, the previous one kept)", ["result"], registry=r)
        self.state_up.set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# (WorkerLoad field, metric name, help): exported as counters (name_total), so PromQL rate()
# takes a worker's restart as a counter reset.
_SPECULATION = (
    ("spec_drafted_tokens", "kvcascade_worker_spec_drafted_tokens",
     "Draft tokens a worker proposed (--speculative) since it started. Acceptance rate: "
     "rate(kvcascade_worker_spec_accepted_tokens_total[5m]) / rate(kvcascade_worker_spec_drafted_tokens_total[5m])"),
    ("spec_accepted_tokens", "kvcascade_worker_spec_accepted_tokens",
     "Draft tokens a worker's model accepted (of kvcascade_worker_spec_drafted_tokens) since it started"),
    ("spec_verifications", "kvcascade_worker_spec_verifications",
     "Verifications on a worker (a sequence's step with drafts) since it started. Tokens a verification emits: "
     "(rate(kvcascade_worker_spec_accepted_tokens_total[5m]) + rate(kvcascade_worker_spec_verifications_total[5m])) "
     "/ rate(kvcascade_worker_spec_verifications_total[5m])"),
)


class WorkerSpeculation:
    """Each live worker's speculative-decoding totals, which it keeps and heartbeats (WorkerLoad),
    as counters labelled by worker. Counters, not gauges: the router only relays the workers' own
    running totals, and a worker that restarts starts again from 0, which rate() handles."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._loads: dict[str, WorkerLoad] = {}
        registry.register(self)

    def set(self, loads: Mapping[str, WorkerLoad]) -> None:
        """The workers of the last registry read; one no longer live is no longer exported."""
        self._loads = dict(loads)

    def collect(self) -> Iterator[CounterMetricFamily]:
        for field, name, documentation in _SPECULATION:
            family = CounterMetricFamily(name, documentation, labels=["worker"])
            for worker, load in self._loads.items():
                family.add_metric([worker], getattr(load, field))
            yield family
