"""Prometheus metrics of one router (a registry of its own, so several can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.state_up = Gauge("kvcascade_state_backend_up", "1 while the registry and prefix index answer; "
                              "0 means load-only routing on the last known workers", registry=r)
        self.worker_running = Gauge("kvcascade_worker_running", "Running requests per worker", ["worker"], registry=r)
        self.worker_waiting = Gauge("kvcascade_worker_waiting", "Waiting requests per worker", ["worker"], registry=r)
        self.worker_kv_free = Gauge("kvcascade_worker_kv_blocks_free", "Free KV blocks per worker", ["worker"],
                                    registry=r)
        self.workers_live = Gauge("kvcascade_workers_live", "Workers with a live heartbeat", registry=r)
        self.state_up.set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
