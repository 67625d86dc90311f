"""Prefix-aware routing against round-robin (and the other policies) on a shared-prefix workload.

Two or more real worker processes (CPU, SmolLM2) behind one in-process router, with a real
redis-server for the registry and prefix index. The workload: P long system prompts x U users,
each user asking one short question, arriving as a Poisson process. Each policy gets the same
requests (prompts salted per run, so no run inherits another's cache).

    python benchmarks/routing.py --workers 2 --prompts 10 --users 4 --rate 2 --out /tmp/routing.json

Each worker's KV pool (--worker-kv-cache) holds about half of the system prompts: a policy that
keeps each prompt on one worker keeps it cached, one that spreads every prompt over all workers
makes each worker cycle through all of them and evict.

Reports per policy: prefix-cache hit rate (cached / prompt tokens, from usage), TTFT p50/p90/p99,
end-to-end p50, output throughput, and the most loaded worker's share of requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from protos import kvcascade_pb2 as pb  # noqa: E402
from router.router import Router, RouterConfig  # noqa: E402
from contracts.stores import connect_state  # noqa: E402
from deploy.local import WorkerProcess, free_port  # noqa: E402

TOPICS = ["a hiking-gear shop's return and shipping rules", "a city library's opening hours and fees",
          "a bakery's allergy and ordering policy", "a bike repair shop's prices and warranty",
          "a language school's courses and enrolment", "a dentist's booking and cancellation rules",
          "a gym's membership terms", "a car rental's insurance options", "a hotel's check-in rules",
          "a museum's ticket prices", "a ferry line's timetable", "a garden centre's delivery terms"]


def system_prompt(topic: str, salt: str, words: int) -> str:
    rng = random.Random(topic)
    filler = " ".join(rng.choice(["policy", "customers", "always", "within", "days", "receipt", "friendly",
                                  "please", "note", "service", "hours", "price", "members", "weekend"])
                      for _ in range(words))
    return f"[{salt}] You are the assistant for {topic}. Rules: {filler}."


def workload(args, salt: str) -> list[tuple[float, pb.GenerateRequest]]:
    rng = random.Random(args.seed)
    reqs = []
    for p in range(args.prompts):
        system = system_prompt(TOPICS[p % len(TOPICS)], salt, args.system_words)
        for u in range(args.users):
            r = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                                              ignore_eos=True))
            r.messages.messages.add(role="system", content=system)
            r.messages.messages.add(role="user", content=f"User {u}: question {rng.randint(0, 999)}?")
            reqs.append(r)
    rng.shuffle(reqs)
    t, timed = 0.0, []
    for r in reqs:
        timed.append((t, r))
        t += rng.expovariate(args.rate) if args.rate > 0 else 0.0
    return timed


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def run_policy(policy: str, args, registry, index) -> dict:
    router = Router(registry, index, RouterConfig(policy=policy))
    timed = workload(args, salt=f"{policy}-{time.time_ns()}")
    results = []

    async def one(at: float, req: pb.GenerateRequest, t0: float):
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        start = time.monotonic()
        first = last = None
        async for msg in router.generate(req):
            now = time.monotonic()
            first = first or now
            last = msg
        results.append(dict(ttft=first - start, e2e=time.monotonic() - start, worker=last.worker_id,
                            prompt=last.usage.prompt_tokens, cached=last.usage.cached_tokens,
                            out=last.usage.completion_tokens))

    t0 = time.monotonic()
    await asyncio.gather(*(one(at, r, t0) for at, r in timed))
    wall = time.monotonic() - t0
    await router.close()
    share = Counter(r["worker"] for r in results)
    return dict(
        policy=policy, requests=len(results), wall_s=wall,
        hit_rate=sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
        ttft_p50=pct([r["ttft"] for r in results], 50), ttft_p90=pct([r["ttft"] for r in results], 90),
        ttft_p99=pct([r["ttft"] for r in results], 99), e2e_p50=statistics.median(r["e2e"] for r in results),
        out_tok_s=sum(r["out"] for r in results) / wall,
        max_worker_share=max(share.values()) / len(results), per_worker=dict(share),
    )


async def main_async(args, redis_url: str) -> list[dict]:
    registry, index = connect_state(redis_url)
    for _ in range(100):  # wait until every worker has registered
        if len(await registry.live_workers()) == args.workers:
            break
        await asyncio.sleep(0.2)
    # Warm-up outside the measurement: the router's tokenizer, each worker's first steps.
    warm = Router(registry, index, RouterConfig(policy="round_robin"))
    for i in range(2 * args.workers):
        r = pb.GenerateRequest(text=f"warm-up {i}", sampling=pb.SamplingParams(max_tokens=2, temperature=0))
        async for _ in warm.generate(r):
            pass
    await warm.close()
    rows = []
    for policy in args.policies:
        rows.append(await run_policy(policy, args, registry, index))
        print(f"{policy}: done", file=sys.stderr)
    await registry.aclose()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="distinct shared system prompts")
    ap.add_argument("--users", type=int, default=6, help="requests per system prompt")
    ap.add_argument("--system-words", type=int, default=220, help="words of filler per system prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s, Poisson (0: all at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", nargs="+", default=["prefix_aware", "round_robin"])
    ap.add_argument("--worker-kv-cache", default="96MiB",
                    help="each worker's KV pool: small enough that one worker cannot hold every prompt")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()

    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        sys.exit("redis-server is needed: apt-get install -y redis-server")
    tmp = tempfile.mkdtemp(prefix="kvc-bench-")
    port = free_port()
    redis_proc = subprocess.Popen([redis_bin, "--port", str(port), "--save", "", "--appendonly", "no",
                                   "--dir", tmp], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    workers = [WorkerProcess(f"w{i}", url, "--kv-cache-memory", args.worker_kv_cache) for i in range(args.workers)]
    try:
        time.sleep(0.3)
        for w in workers:  # one at a time: loading is CPU-heavy
            w.start()
        rows = asyncio.run(main_async(args, url))
    finally:
        for w in workers:
            w.stop()
        redis_proc.terminate()
    cols = ["policy", "hit_rate", "ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50", "out_tok_s", "max_worker_share"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=2))


if __name__ == "__main__":
    main()
