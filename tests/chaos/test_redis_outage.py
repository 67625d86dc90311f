"""Scenario 3: Redis killed for 20 s under load. The router keeps serving on the workers it last saw
(load-only routing, kvcascade_state_backend_up 0): no request over HTTP or gRPC fails. Redis restarted
empty on the same port, workers re-register with a snapshot of their caches and prefix routing
comes back on its own: a request sharing a long system prompt with an earlier one is a prefix_hit."""

from __future__ import annotations

import threading
import time
from collections import Counter

import grpc
import httpx
import pytest

from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc

from .fleet import completion_body, completion_request, rounds, wait_for

pytestmark = pytest.mark.slow

OUTAGE_S = 20
CLIENTS = 4  # half over HTTP, half over gRPC, each one request after another
SYSTEM = ("You are the support assistant of Northwind Outfitters, a shop for hiking and camping gear. Answer "
          "briefly and politely. Our return policy: unused items can be returned within 30 days with the receipt; "
          "sale items within 14 days. Shipping is free above 50 euros and takes two to four working days. ")


def _chat(system: str, question: str) -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    req.messages.messages.add(role="system", content=system)
    req.messages.messages.add(role="user", content=question)
    return req


def _backend_up(fleet) -> float:
    for line in httpx.get(f"{fleet.router.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvcascade_state_backend_up "):
            return float(line.split()[1])
    raise AssertionError("the router exports no kvcascade_state_backend_up")


class Load:
    """CLIENTS threads sending greedy requests through the router until stopped."""

    def __init__(self, fleet, stub):
        self.fleet, self.stub = fleet, stub
        self.stop = threading.Event()
        self.outcomes: Counter = Counter()
        self.failures: list[str] = []
        self.slowest = 0.0
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _client(self, i: int) -> None:
        http = httpx.Client(base_url=self.fleet.router.url, timeout=60)
        n = 0
        while not self.stop.is_set():
            n += 1
            prompt = f"Client {i} asks question {n}: what is {n} plus {i}?"
            start = time.monotonic()
            try:
                if i % 2:
                    msgs = list(self.stub.Generate(completion_request(prompt, 8), timeout=60))
                    ok = msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 8
                    self._count("grpc", ok, msgs[-1])
                else:
                    r = http.post("/v1/completions", json=completion_body(prompt, 8))
                    ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
                    self._count("http", ok, r.text[:200])
            except grpc.RpcError as exc:
                self._count("grpc", False, f"{exc.code().name}: {exc.details()}")
            except httpx.HTTPError as exc:
                self._count("http", False, repr(exc))
            self.slowest = max(self.slowest, time.monotonic() - start)
        http.close()

    def _count(self, via: str, ok: bool, detail) -> None:
        self.outcomes[via, "ok" if ok else "failed"] += 1
        if not ok:
            self.failures.append((time.monotonic(), via, str(detail)))


def test_redis_down_for_20s_under_load_fails_no_request_and_prefix_routing_recovers(fleet, soak_s):
    with grpc.insecure_channel(fleet.router.address) as channel:
        stub = pb_grpc.KVCascadeStub(channel)
        for n in rounds(soak_s):
            _outage_round(fleet, stub, n)
    assert not fleet.crashed(), fleet.crashed()


def _ask(stub, req) -> pb.GenerateResponse:
    return list(stub.Generate(req, timeout=60))[-1]


def _prefix_hit(stub, system: str, question: str) -> bool:
    try:
        return _ask(stub, _chat(system, question)).route_reason == "prefix_hit"
    except grpc.RpcError as err:  # the known empty-registry window (see EMPTY_REGISTRY_WINDOW_S)
        assert "no worker is live" in err.details(), err
        return False


def _outage_round(fleet, stub, n: int) -> None:
    system = f"Desk {n}. " + SYSTEM
    _ask(stub, _chat(system, "Hello"))
    assert wait_for(lambda: _prefix_hit(stub, system, "Can I return boots?"), 10) is not None, \
        "prefix routing should work before the outage"
    with Load(fleet, stub) as load:
        assert wait_for(lambda: load.outcomes.total() >= 8, 30) is not None
        before = load.outcomes.total()
        fleet.redis.stop()
        down_at = time.monotonic()
        try:
            assert wait_for(lambda: _backend_up(fleet) == 0, 10) is not None, "the router should notice"
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))  # the outage is the scenario
            during = load.outcomes.total() - before
        finally:
            fleet.redis.start()
        # The same system prompt as before the outage: the index is rebuilt from the workers' snapshots.
        hit = wait_for(lambda: _prefix_hit(stub, system, "Is shipping free?"), 20)
        state_up = wait_for(lambda: _backend_up(fleet) == 1, 10)

    # Redis comes back empty: until each worker re-registers (its next heartbeat), the router keeps
    # the workers it served with through the outage (registry_grace_s), so nothing fails then either.
    failures = load.failures
    print(f"\n[redis outage {n}] {OUTAGE_S}s down: {during} requests during it, {load.outcomes.total()} in the "
          f"round {dict(load.outcomes)}, slowest {load.slowest:.2f}s; failed: {len(failures)}; prefix_hit "
          f"{'never' if hit is None else f'{hit:.2f}s'} and state_backend_up 1 {state_up}s after Redis was back")
    assert not failures, failures[:5]
    assert during >= OUTAGE_S, "the load should go on through the outage"
    assert hit is not None, "prefix routing should recover within 20 s of Redis coming back"
    assert state_up is not None


SHORT_OUTAGE_S = 5  # longer than registry_grace_s (3 s) after the workers' last heartbeat


def test_requests_right_after_redis_comes_back_empty_do_not_fail(fleet):
    """Once found as a defect: after an outage longer than registry_grace_s, a Redis back empty listed no
    worker until their next heartbeats, and the router answered 'no worker is live' meanwhile."""
    failures = []
    with grpc.insecure_channel(fleet.router.address) as channel:
        stub = pb_grpc.KVCascadeStub(channel)
        total = sum(s.kv_blocks_total for s in fleet.worker_stats().values())
        for attempt in range(2):
            fleet.redis.stop()
            time.sleep(SHORT_OUTAGE_S)  # the outage is the point
            fleet.redis.start()
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                try:
                    list(stub.Generate(completion_request(f"Right after the restart {attempt}", 1), timeout=30))
                except grpc.RpcError as err:
                    failures.append(f"{err.code().name}: {err.details()}")
            both = wait_for(lambda: stub.Stats(pb.StatsRequest(), timeout=5).kv_blocks_total == total, 10)
            assert both is not None, "both workers should be back in the registry"
            if failures:
                break
    assert not failures, failures[:3]
