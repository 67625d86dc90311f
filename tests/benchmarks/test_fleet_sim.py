"""benchmarks/fleet_sim.py on a small fleet: the engine's scheduler and block manager per simulated
worker, the real policies and a real redis-server index, a few virtual seconds."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys

import pytest

from contracts.redis_state import RedisPrefixIndex, redis_client
from deploy.local import REPO, LocalRedis, redis_server_binary

spec = importlib.util.spec_from_file_location("fleet_sim", REPO / "benchmarks" / "fleet_sim.py")
fleet_sim = sys.modules["fleet_sim"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(fleet_sim)


def _args(**kw) -> argparse.Namespace:
    base = dict(prefix_aware_config=[], hot_from=0.0, prefixes=24, prefix_tokens=[512, 1024], question_tokens=[16, 48], output_tokens=[16, 48],
                blocks=320, max_num_seqs=32, max_batched_tokens=2048, hot=0.0, window=1.0, seed=3)
    return argparse.Namespace(**{**base, **kw})


def test_prefix_aware_routing_keeps_prefixes_where_they_are_cached_as_an_oracle_would():
    """6 workers whose pools hold about a third of 24 prefixes each: through the Redis index the
    prefix-aware policy reaches nearly the oracle's hit rate; round-robin spreads every prefix over
    every pool and misses most; every request finishes with each policy."""
    try:
        redis_server_binary()
    except FileNotFoundError:
        pytest.skip("redis-server is not installed")
    args = _args()
    reqs = fleet_sim.make_workload(args, rate=150.0, n=450, seed=1)
    redis = LocalRedis().start()

    async def run() -> dict:
        client = redis_client(redis.url)
        index = RedisPrefixIndex(client, "sim:")
        try:
            return {name: await fleet_sim.simulate(args, name, 6, reqs, index, run=i + 1)
                    for i, name in enumerate(["prefix_aware", "oracle", "round_robin"])}
        finally:
            await client.aclose()

    try:
        out = asyncio.run(run())
    finally:
        redis.stop()
    assert all(s["requests"] == len(reqs) for s in out.values())
    pa, oracle, rr = out["prefix_aware"], out["oracle"], out["round_robin"]
    assert pa["hit_rate"] >= 0.9 * oracle["hit_rate"], out
    assert pa["hit_rate"] > 1.5 * rr["hit_rate"], out
    assert pa["ttft_p90_s"] < rr["ttft_p90_s"], out
    assert 0 < pa["decision_p50_ms"] < 50


def test_the_step_cost_model_reproduces_the_gpu_steps_it_was_fitted_to():
    """StepCost against the H200 run of benchmarks/step_cost_gpu.py it was fitted to (every step's
    composition and measured time): the total within 3%, the median step within 6%."""
    import json
    import statistics

    run = json.loads((REPO / "docs" / "results" / "step_cost_h200_2026-11-26.json").read_text())
    cost = fleet_sim.StepCost()
    steps = run["steps"]
    predicted = [cost.step_ms(s["rows"], s["ctx"], [tuple(p) for p in s["prefill"]]) for s in steps]
    measured = [s["ms"] for s in steps]
    assert sum(predicted) == pytest.approx(sum(measured), rel=0.03)
    assert statistics.median(abs(p - m) / m for p, m in zip(predicted, measured)) < 0.06
    assert cost.step_ms(1, 600, []) < cost.step_ms(64, 64 * 3000, []) < cost.step_ms(64, 64 * 3000, [(512, 3000)])
