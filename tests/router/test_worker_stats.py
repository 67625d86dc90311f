"""What the router says of its workers' speculative decoding, from their heartbeats: the gRPC Stats
sums it over workers, /metrics has it per worker as counters, from which PromQL gets the
acceptance rate and the tokens per verification."""

from __future__ import annotations

import grpc
from prometheus_client.parser import text_string_to_metric_families

from contracts.memory_state import MemoryPrefixIndex, MemoryRegistry
from contracts.state import WorkerInfo, WorkerLoad
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from router.grpc_api import RouterServer
from router.router import Router

from .loop_thread import LoopThread

SPEC = ("spec_drafted_tokens", "spec_accepted_tokens", "spec_verifications")


def _worker(worker_id: str, drafted: int, accepted: int, verifications: int) -> WorkerInfo:
    load = WorkerLoad(running=1, kv_blocks_total=100, kv_blocks_free=60, spec_drafted_tokens=drafted,
                      spec_accepted_tokens=accepted, spec_verifications=verifications)
    return WorkerInfo(worker_id=worker_id, epoch="e1", address="127.0.0.1:1", model="m", load=load)


def _counters(router: Router) -> dict[str, dict[str, float]]:
    """kvcascade_worker_spec_* counters: metric name -> worker -> value."""
    families = text_string_to_metric_families(router.metrics.render().decode())
    out = {}
    for family in families:
        if family.name.startswith("kvcascade_worker_spec_"):
            assert family.type == "counter", family
            out[family.name] = {s.labels["worker"]: s.value for s in family.samples if s.name.endswith("_total")}
    return out


def test_stats_sums_the_workers_and_metrics_count_each():
    loop = LoopThread()
    registry = MemoryRegistry()

    async def start() -> tuple[Router, RouterServer]:
        await registry.register(_worker("w1", 100, 60, 30), ttl_s=60)
        await registry.register(_worker("w2", 20, 5, 10), ttl_s=60)
        router = Router(registry, MemoryPrefixIndex())
        server = RouterServer(router, "127.0.0.1", 0)
        await server.start()
        return router, server

    router, server = loop.run(start())
    try:
        with grpc.insecure_channel(server.address) as channel:
            stats = pb_grpc.KVCascadeStub(channel).Stats(pb.StatsRequest(), timeout=10)
        assert [getattr(stats, name) for name in SPEC] == [120, 65, 40]
        assert stats.running == 2  # the other sums are untouched

        counters = _counters(router)  # read by the Stats call
        assert counters == {
            "kvcascade_worker_spec_drafted_tokens": {"w1": 100, "w2": 20},
            "kvcascade_worker_spec_accepted_tokens": {"w1": 60, "w2": 5},
            "kvcascade_worker_spec_verifications": {"w1": 30, "w2": 10},
        }
        # The help says how: acceptance rate accepted / drafted, tokens per verification
        # (accepted + verifications) / verifications.
        render = router.metrics.render().decode()
        assert "rate(kvcascade_worker_spec_accepted_tokens_total[5m]) / rate(kvcascade_worker_spec_drafted" in render

        # A heartbeat moves a worker's counters on; a worker that leaves is no longer exported.
        w1 = _worker("w1", 150, 90, 45)
        assert loop.run(registry.heartbeat("w1", "e1", w1.load, ttl_s=60))
        loop.run(registry.deregister("w2", "e1"))
        loop.run(router.live_workers(fresh=True))
        assert _counters(router)["kvcascade_worker_spec_accepted_tokens"] == {"w1": 90}
    finally:
        loop.run(server.stop(0))
        loop.run(router.close())
        loop.close()
