"""A fleet of simulated GPU workers behind the real routing policies and a real Redis prefix index,
in virtual time: how routing behaves at 8-64 workers, where no machine here reaches.

What is real and what is simulated:
- **Real**: the routing policies (router/policy.py), the block hash (protos/block_hash.py), the
  prefix index in a real redis-server (contracts/redis_state.py: its Lua match and apply scripts),
  and each worker's engine bookkeeping: the engine's own Scheduler and BlockManager
  (worker/engine/), so continuous batching, chunked prefill, preemption, the LRU prefix cache and
  the stored / evicted events it publishes are the engine's code.
- **Simulated**: the forward pass. A step takes the time a cost model gives for its decode rows,
  prefill tokens and live KV (StepCost below, fitted to the engine's steps on an H200 running this
  workload: benchmarks/step_cost_gpu.py);
  the sampled tokens are random ids. Heartbeats (load every 1 s) and cache events (every 50 ms)
  reach the router as the worker publisher sends them (worker/registration.py), in virtual time.

Every request's routing runs in real time: the block hashes of its prompt, one `match` round trip to
Redis, the policy's score; that wall time is the router's decision cost. A Poisson workload
(arrivals in virtual time): P system prompts of 2-4k tokens, each request one of them plus a short
question, a fixed number of output tokens. Each policy gets the same requests. An `oracle` policy
ranks with the prefix-aware score but reads every worker's pool directly (no index lag, no
eviction it has not seen): the hit rate a perfect index would give.

    python benchmarks/fleet_sim.py --workers 8 32 64 --loads 0.7 1.0 --out docs/results/fleet_sim.json
    python benchmarks/fleet_sim.py --workers 16 --hot 0.5 --hot-from 4 --loads 0.7   # prefix 0 takes half the traffic from t=4 s

Capacity: for each fleet size, the highest Poisson rate at which the prefix-aware policy keeps TTFT
p90 within --slo-s (a bisection between 0 and the rate every worker could finish with every prompt
cached); --loads are fractions of it, the same arrivals for every policy.
Reports per run: output throughput (tokens / (last finish - first arrival)), TTFT p50/p90/p99,
prefix-cache hit rate (cached / prompt tokens, at first admission), preemptions, the busiest
worker's prefill+decode work over the mean, and the decision cost (p50/p99, decisions per second
of one router process); per fleet size, Redis memory per indexed block.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from contracts.redis_state import RedisPrefixIndex, redis_client  # noqa: E402
from contracts.state import CacheEvent, WorkerInfo, WorkerLoad  # noqa: E402
from protos.block_hash import block_hashes  # noqa: E402
from router.policy import Candidate, PrefixAwareConfig, PrefixAwarePolicy, create_policy  # noqa: E402
from worker.engine.block_manager import BlockManager  # noqa: E402
from worker.engine.sampling_params import SamplingParams  # noqa: E402
from worker.engine.scheduler import Scheduler  # noqa: E402
from worker.engine.sequence import Sequence  # noqa: E402

MODEL = "sim-llama-3.1-8b"
BLOCK = 16
HEARTBEAT_S = 1.0  # worker/registration.py: heartbeat_s
EVENTS_S = 0.05  # worker/registration.py: event_interval_s


@dataclass(frozen=True)
class StepCost:
    """Milliseconds of one engine step of dummy:llama-3.1-8b in bf16 on one H200, fitted to the
    steps of the engine running this simulator's workload there (benchmarks/step_cost_gpu.py,
    docs/results/step_cost_h200_2026-11-26.json: 1,943 steps, the lookahead off so that each step's
    time is its own; median error per step 3.9%, p90 23%):
    - base: 7.83 ms a step (the 16 GB of weights, 4.48 ms with CUDA graphs at batch 1, plus the
      host's scheduling, sampling and output work, which the lookahead would partly hide);
    - per decode row 0.052 ms, plus its live KV (128 KiB a token) read at 93% of the H200's
      4.25 TB/s copy rate (kept from the physics: the runs' contexts, all ~3k tokens, cannot
      separate a per-row from a per-context cost);
    - per prefill token 0.025 ms (the GEMMs at 708 TFLOP/s, as profiled on an H100; held fixed in
      the fit, which then gives attention over these 2-4k prompts no cost of its own);
    - a step with any prefill: +10.2 ms (it runs eagerly, outside the CUDA graphs).
    """

    base_ms: float = 7.83
    row_ms: float = 0.052
    kv_bytes_per_token: int = 131072
    kv_bytes_per_ms: float = 4.25e9 * 0.93
    prefill_token_ms: float = 0.025
    mixed_ms: float = 10.2

    def step_ms(self, decode_rows: int, decode_context: int, prefill: list[tuple[int, int]]) -> float:
        """``prefill``: (new tokens, context they attend to) per prefilling sequence."""
        ms = self.base_ms + self.row_ms * decode_rows + decode_context * self.kv_bytes_per_token / self.kv_bytes_per_ms
        if prefill:
            ms += self.mixed_ms + self.prefill_token_ms * sum(new for new, _ in prefill)
        return ms


def composition(batch: list) -> tuple[int, int, list[tuple[int, int]]]:
    """What a step's cost depends on: decode rows, their context tokens, and per prefilling
    sequence (new tokens, the context they attend to on average)."""
    rows = ctx = 0
    prefill = []
    for it in batch:
        if it.num_new_tokens == 1:
            rows += 1
            ctx += it.seq.num_computed_tokens + 1
        else:
            prefill.append((it.num_new_tokens, it.seq.num_computed_tokens + it.num_new_tokens // 2))
    return rows, ctx, prefill


@dataclass
class Request:
    rid: int
    arrival: float
    prefix: int
    prompt: list[int]
    output_tokens: int
    worker: int = -1
    reason: str = ""
    first_token: float | None = None
    finish: float | None = None
    cached: int = 0


def worker_id(i: int) -> str:
    return f"sim-{i:03d}"


def epoch_of(run: int, i: int) -> str:
    return f"r{run}-{i}"


@dataclass
class SimWorker:
    index: int
    epoch: str  # new per run (epoch_of), so the index ignores what earlier runs left
    num_blocks: int
    max_num_seqs: int
    max_batched_tokens: int
    cost: StepCost
    rng: random.Random
    info: WorkerInfo = field(init=False)
    bm: BlockManager = field(init=False)
    sched: Scheduler = field(init=False)
    busy_until: float | None = None
    batch: list = field(default_factory=list)
    requests: dict = field(default_factory=dict)  # id(seq) -> Request
    busy_ms: float = 0.0
    open_requests: int = 0  # the router's in-flight count: sent and not finished

    def __post_init__(self) -> None:
        self.bm = BlockManager(self.num_blocks, BLOCK, MODEL)
        self.sched = Scheduler(self.bm, self.max_batched_tokens, self.max_num_seqs)
        self.info = WorkerInfo(worker_id=worker_id(self.index), epoch=self.epoch, address="", model=MODEL,
                               capacity=self.max_num_seqs, block_size=BLOCK, load=self.load())

    def load(self) -> WorkerLoad:
        seqs = self.sched.running + list(self.sched.waiting)
        return WorkerLoad(running=len(self.sched.running), waiting=len(self.sched.waiting),
                          kv_blocks_free=self.bm.num_free_blocks, kv_blocks_total=self.num_blocks,
                          queued_tokens=sum(s.num_prefill_pending for s in seqs))

    def add(self, req: Request) -> None:
        seq = Sequence(str(req.rid), req.prompt, SamplingParams(max_tokens=req.output_tokens, ignore_eos=True))
        self.requests[id(seq)] = req
        self.sched.add(seq)
        self.open_requests += 1

    def start_step(self, now: float) -> float | None:
        """Schedule a step; the virtual time it ends, or None when there is nothing to run."""
        batch, overflow = self.sched.schedule()
        for seq in overflow:  # cannot fit the pool at all: the engine finishes it by length
            self._done(seq, now)
        if not batch:
            return None
        ms = self.cost.step_ms(*composition(batch))
        self.busy_ms += ms
        self.batch = batch
        self.busy_until = now + ms / 1e3
        return self.busy_until

    def finish_step(self, now: float) -> list[Request]:
        """Apply the step that ends now: the requests it finished."""
        done = []
        for it in self.batch:
            seq = it.seq
            if seq.finished:
                continue
            seq.num_computed_tokens += it.num_new_tokens
            self.bm.cache_full_blocks(seq)
            if not it.samples:
                continue
            req = self.requests[id(seq)]
            if req.first_token is None:
                req.first_token = now
                req.cached = seq.num_cached_tokens or 0
            seq.token_ids.append(self.rng.randrange(1, 128_000))
            if seq.num_output_tokens >= req.output_tokens:
                done.append(self._done(seq, now))
        self.batch = []
        self.busy_until = None
        return done

    def _done(self, seq: Sequence, now: float) -> Request:
        req = self.requests.pop(id(seq))
        self.sched.finish(seq, "length")
        req.finish = now
        if req.first_token is None:
            req.first_token = now
        self.open_requests -= 1
        return req

    def cached_tokens(self, hashes: list[int]) -> int:
        """What the oracle sees: the leading blocks of the prompt in this pool now."""
        n = 0
        for h in hashes:
            if h not in self.bm.hash_to_block:
                break
            n += 1
        return n * BLOCK


def make_workload(args, rate: float | None, n: int, seed: int) -> list[Request]:
    """``n`` requests; Poisson arrivals at ``rate`` per second (None: all at t=0)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 128_000) for _ in range(rng.randint(*args.prefix_tokens))]
                for _ in range(args.prefixes)]
    t = 0.0
    reqs = []
    for i in range(n):
        if rate is not None:
            t += rng.expovariate(rate)
        hot = args.hot if t >= args.hot_from else 0.0
        p = 0 if hot and rng.random() < hot else rng.randrange(len(prefixes))
        question = [rng.randrange(1, 128_000) for _ in range(rng.randint(*args.question_tokens))]
        reqs.append(Request(i, t, p, prefixes[p] + question, rng.randint(*args.output_tokens)))
    return reqs


async def find_capacity(args, n: int, index: RedisPrefixIndex, run: int) -> tuple[float, list[dict]]:
    """The highest arrival rate (requests/s) the prefix-aware policy sustains on ``n`` workers, to
    a bisection's resolution: sustained = TTFT p90 within --slo-s over --search-duration seconds."""
    lo, hi = 0.0, decode_bound(args) * n
    searched = []
    for step in range(args.search_steps):
        rate = (lo + hi) / 2
        reqs = make_workload(args, rate, int(rate * args.search_duration), args.seed)
        s = await simulate(args, "prefix_aware", n, reqs, index, run + step + 1)
        ok = s["ttft_p90_s"] <= args.slo_s
        searched.append({"rate": rate, "ttft_p90_s": s["ttft_p90_s"], "hit_rate": s["hit_rate"], "sustained": ok})
        lo, hi = (rate, hi) if ok else (lo, rate)
    return lo, searched


def decode_bound(args) -> float:
    """Requests/s one worker could finish at most: every prompt cached, --max-num-seqs decoding."""
    cost = StepCost()
    n = args.max_num_seqs
    mean_out = sum(args.output_tokens) / 2
    context = sum(args.prefix_tokens) / 2 + sum(args.question_tokens) / 2 + mean_out / 2
    step_s = cost.step_ms(n, int(n * context), []) / 1e3
    return n / step_s / mean_out


def _kv(text: str) -> tuple[str, float]:
    key, _, value = text.partition("=")
    return key.replace("-", "_"), float(value)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def simulate(args, policy_name: str, workers_n: int, reqs: list[Request], index: RedisPrefixIndex,
                   run: int) -> dict:
    """Run ``reqs`` through ``workers_n`` fresh workers with one policy; a summary dict."""
    cost = StepCost()
    workers = [SimWorker(i, epoch_of(run, i), args.blocks, args.max_num_seqs, args.max_batched_tokens, cost,
                         random.Random(run * 1000 + i)) for i in range(workers_n)]
    by_id = {w.info.worker_id: w for w in workers}
    oracle = policy_name == "oracle"
    config = PrefixAwareConfig(**dict(_kv(x) for x in args.prefix_aware_config))
    policy = PrefixAwarePolicy(config) if policy_name in ("prefix_aware", "oracle") else create_policy(policy_name)
    epochs = {w.info.worker_id: w.info.epoch for w in workers}
    heap: list[tuple[float, int, str, object]] = []
    counter = 0

    def push(t: float, kind: str, payload: object = None) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(heap, (t, counter, kind, payload))

    for r in reqs:
        r.worker, r.first_token, r.finish, r.cached, r.reason = -1, None, None, 0, ""
        push(r.arrival, "arrive", r)
    push(HEARTBEAT_S, "beat")
    push(EVENTS_S, "events")
    decisions: list[float] = []
    finished = 0
    timeline: list[tuple[float, int, int, float]] = []  # hot spot: (arrival, prefix, worker, ttft) per request
    wall = time.perf_counter()
    while heap and finished < len(reqs):
        now, _, kind, payload = heapq.heappop(heap)
        if kind == "arrive":
            req = payload
            t0 = time.perf_counter()
            hashes = block_hashes(req.prompt, BLOCK, MODEL)
            if oracle:
                cached = {w.info.worker_id: w.cached_tokens(hashes) for w in workers}
            else:  # every policy's router asks the index (router.route), whatever it then does with it
                held = await index.match(MODEL, hashes, epochs)
                cached = {wid: n * BLOCK for wid, n in held.items()}
            candidates = [Candidate(w.info, min(cached.get(w.info.worker_id, 0), len(req.prompt)), w.open_requests)
                          for w in workers]
            (best, reason), *_ = policy.order(candidates, len(req.prompt))
            decisions.append(time.perf_counter() - t0)
            worker = by_id[best.worker.worker_id]
            req.worker, req.reason = worker.index, reason
            worker.add(req)
            if worker.busy_until is None:
                end = worker.start_step(now)
                if end is not None:
                    push(end, "step", worker)
        elif kind == "step":
            worker = payload
            for req in worker.finish_step(now):
                finished += 1
                timeline.append((req.arrival, req.prefix, req.worker, req.first_token - req.arrival))
            end = worker.start_step(now)
            if end is not None:
                push(end, "step", worker)
        elif kind == "beat":
            for w in workers:
                w.info.load = w.load()
            push(now + HEARTBEAT_S, "beat")
        elif kind == "events":
            for w in workers:
                if (events := w.bm.drain_events()) and not oracle:
                    await index.apply(w.info.worker_id, w.info.epoch, MODEL,
                                      [CacheEvent(e.kind, e.block_hash) for e in events])
            push(now + EVENTS_S, "events")
    wall = time.perf_counter() - wall
    done = [r for r in reqs if r.finish is not None]
    start = min(r.arrival for r in reqs)
    end = max(r.finish for r in done)
    ttft = [r.first_token - r.arrival for r in done]
    prompt_tokens = sum(len(r.prompt) for r in done)
    work = [w.busy_ms for w in workers]
    served = [sum(1 for r in done if r.worker == w.index) for w in workers]
    mean_decision = statistics.fmean(decisions)
    summary = {
        "policy": policy_name, "workers": workers_n, "requests": len(done),
        "output_tok_s": sum(r.output_tokens for r in done) / (end - start),
        "requests_per_s": len(done) / (end - start), "makespan_s": end - start,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9), "ttft_p99_s": percentile(ttft, 0.99),
        "hit_rate": sum(r.cached for r in done) / prompt_tokens,
        "preemptions": sum(w.sched.num_preemptions for w in workers),
        "max_over_mean_busy": max(work) / statistics.fmean(work), "max_over_mean_requests": max(served) / statistics.fmean(served),
        "decision_p50_ms": percentile(decisions, 0.5) * 1e3, "decision_p99_ms": percentile(decisions, 0.99) * 1e3,
        "decisions_per_s": 1 / mean_decision, "sim_wall_s": wall,
    }
    if args.hot:
        summary["hot_timeline"] = hot_timeline(timeline, args.window)
    return summary


def hot_timeline(timeline: list[tuple[float, int, int, float]], window: float) -> list[dict]:
    """Per window of arrivals: TTFT p50/p90 of the hot prefix's requests and of the others, and how
    many workers served the hot prefix."""
    out = []
    end = max(t for t, *_ in timeline)
    t = 0.0
    while t <= end:
        hot = [(w, f) for a, p, w, f in timeline if t <= a < t + window and p == 0]
        cold = [f for a, p, w, f in timeline if t <= a < t + window and p != 0]
        out.append({"t": t, "hot_requests": len(hot), "hot_workers": len({w for w, _ in hot}),
                    "hot_ttft_p50_s": percentile([f for _, f in hot], 0.5), "hot_ttft_p90_s": percentile([f for _, f in hot], 0.9),
                    "other_ttft_p90_s": percentile(cold, 0.9)})
        t += window
    return out


async def router_cost(args, n: int, index: RedisPrefixIndex, run: int, requests: int = 2000) -> dict:
    """The prefix-aware decision alone, as a router process makes it: block hashes, one match round
    trip against the index that run ``run`` left (full pools of ``n`` workers), the policy's order over
    ``n`` candidates, back to back. The simulated fleet's objects are frozen out of the garbage
    collector first: a router's heap does not hold a fleet. Also the tokenizing of the same prompts
    as chat text, where the bundled SmolLM2 tokenizer is installed."""
    reqs = make_workload(args, None, requests, args.seed + 2)
    workers = [WorkerInfo(worker_id=worker_id(i), epoch=epoch_of(run, i), address="", model=MODEL, block_size=BLOCK,
                          load=WorkerLoad(running=64, waiting=2, kv_blocks_free=1000, kv_blocks_total=args.blocks,
                                          queued_tokens=3000)) for i in range(n)]
    epochs = {w.worker_id: w.epoch for w in workers}
    policy = PrefixAwarePolicy()
    gc.collect()
    gc.freeze()
    times = []
    try:
        for r in reqs:
            t0 = time.perf_counter()
            hashes = block_hashes(r.prompt, BLOCK, MODEL)
            held = await index.match(MODEL, hashes, epochs)
            candidates = [Candidate(w, min(held.get(w.worker_id, 0) * BLOCK, len(r.prompt)), 3) for w in workers]
            policy.order(candidates, len(r.prompt))
            times.append(time.perf_counter() - t0)
    finally:
        gc.unfreeze()
    out = {"decision_p50_ms": percentile(times, 0.5) * 1e3, "decision_p99_ms": percentile(times, 0.99) * 1e3,
           "decisions_per_s": len(times) / sum(times)}
    try:
        from contracts.models import resolve_model
        from contracts.tokenizers import load_tokenizer

        tok = load_tokenizer(resolve_model("smollm2-135m"))
        words = ["policy", "customers", "always", "within", "days", "receipt", "service", "hours", "price"]
        rng = random.Random(5)
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(*args.prefix_tokens))) for _ in range(50)]
        tt = []
        for text in texts:
            t0 = time.perf_counter()
            tok.apply_chat_template([{"role": "system", "content": text}, {"role": "user", "content": "A question?"}],
                                    add_generation_prompt=True, tokenize=True)
            tt.append(time.perf_counter() - t0)
        out.update(tokenize_p50_ms=percentile(tt, 0.5) * 1e3, tokenize_p99_ms=percentile(tt, 0.99) * 1e3)
    except Exception as exc:  # no bundled model here: the decision alone
        out["tokenize"] = f"not measured: {exc}"
    return out


async def redis_bytes_per_block(client, index: RedisPrefixIndex, args) -> dict:
    """Memory Redis spends per indexed block: 8 workers' pools of distinct blocks stored, then a
    ninth worker holding one of those pools again (what a second holder of a prefix costs)."""
    await client.flushdb()
    before = (await client.info("memory"))["used_memory"]
    rng = random.Random(7)
    pools = [[rng.getrandbits(63) for _ in range(args.blocks)] for _ in range(8)]
    for w, hashes in enumerate(pools):
        for s in range(0, len(hashes), 512):
            await index.apply(f"mem-{w}", "e", MODEL, [CacheEvent("stored", h) for h in hashes[s:s + 512]])
    distinct = (await client.info("memory"))["used_memory"]
    for s in range(0, args.blocks, 512):
        await index.apply("mem-copy", "e", MODEL, [CacheEvent("stored", h) for h in pools[0][s:s + 512]])
    copied = (await client.info("memory"))["used_memory"]
    return {"blocks": 8 * args.blocks, "bytes_per_block": (distinct - before) / (8 * args.blocks),
            "bytes_per_second_holder": (copied - distinct) / args.blocks}


async def main_async(args) -> dict:
    from deploy.local import LocalRedis  # here: the GPU cost check imports this module without gRPC

    redis = LocalRedis().start()
    client = redis_client(redis.url)
    index = RedisPrefixIndex(client, "sim:", timeout_s=10)
    results: dict = {"args": vars(args), "cost": asdict(StepCost()), "runs": [], "capacity": {}}
    run = 0
    try:
        for n in args.workers:
            await client.flushdb()
            run += 1
            capacity, searched = await find_capacity(args, n, index, run)
            run += len(searched)
            results["capacity"][n] = {"requests_per_s": capacity, "search": searched}
            print(f"{n} workers: capacity {capacity:,.0f} requests/s (prefix-aware, TTFT p90 <= {args.slo_s} s)", flush=True)
            for load in args.loads:
                rate = load * n if args.rates else load * capacity
                reqs = make_workload(args, rate, int(rate * args.duration), args.seed + 1)
                for name in args.policies:
                    await client.flushdb()
                    run += 1
                    s = await simulate(args, name, n, reqs, index, run)
                    s.update(load=load, rate=rate)
                    results["runs"].append(s)
                    print(f"{n:3d} workers load {load:.2f} {name:13s}: {s['output_tok_s']:10,.0f} out tok/s  "
                          f"TTFT p50 {s['ttft_p50_s']:7.3f} p90 {s['ttft_p90_s']:7.3f} s  hit {s['hit_rate']:.3f}  "
                          f"busiest {s['max_over_mean_busy']:.2f}x  preempt {s['preemptions']}  "
                          f"decision p99 {s['decision_p99_ms']:.2f} ms ({s['decisions_per_s']:,.0f}/s)  "
                          f"[{s['sim_wall_s']:.0f} s]", flush=True)
        results["router_cost"] = {n: await router_cost(args, n, index, run) for n in args.workers}
        for n, c in results["router_cost"].items():
            print(f"{n} workers, router alone: decision p50 {c['decision_p50_ms']:.2f} ms p99 {c['decision_p99_ms']:.2f} ms "
                  f"({c['decisions_per_s']:,.0f}/s); tokenize p50 {c.get('tokenize_p50_ms', float('nan')):.2f} ms "
                  f"p99 {c.get('tokenize_p99_ms', float('nan')):.2f} ms", flush=True)
        results["redis"] = await redis_bytes_per_block(client, index, args)
        print(f"redis: {results['redis']['bytes_per_block']:.0f} bytes per indexed block, "
              f"{results['redis']['bytes_per_second_holder']:.0f} per second holder", flush=True)
    finally:
        await client.aclose()
        redis.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", nargs="+", type=int, default=[8, 32, 64])
    ap.add_argument("--policies", nargs="+", default=["prefix_aware", "oracle", "round_robin", "least_load"])
    ap.add_argument("--loads", nargs="+", type=float, default=[0.7, 1.0], help="fractions of the measured capacity")
    ap.add_argument("--duration", type=float, default=10.0, help="virtual seconds of arrivals")
    ap.add_argument("--prefixes-per-worker", type=int, default=8,
                    help="system prompts per worker of the fleet (a pool holds about --blocks / 200 of them)")
    ap.add_argument("--prefix-tokens", nargs=2, type=int, default=[2048, 4096])
    ap.add_argument("--question-tokens", nargs=2, type=int, default=[32, 160])
    ap.add_argument("--output-tokens", nargs=2, type=int, default=[64, 192])
    ap.add_argument("--blocks", type=int, default=4096, help="KV blocks of 16 tokens per worker (8 GiB of bf16 KV)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--hot", type=float, default=0.0, help="share of requests on prefix 0 (the hot-spot run)")
    ap.add_argument("--hot-from", type=float, default=0.0, help="virtual second at which prefix 0 turns hot")
    ap.add_argument("--window", type=float, default=1.0, help="hot-spot timeline window, virtual seconds")
    ap.add_argument("--slo-s", type=float, default=1.0, help="capacity: the TTFT p90 a sustained rate keeps")
    ap.add_argument("--search-steps", type=int, default=5)
    ap.add_argument("--search-duration", type=float, default=6.0)
    ap.add_argument("--rates", action="store_true", help="--loads are requests/s per worker, not fractions of capacity")
    ap.add_argument("--prefix-aware-config", nargs="*", default=[], metavar="KEY=VALUE",
                    help="PrefixAwareConfig fields for prefix_aware and oracle (router/policy.py), e.g. load_weight=0.5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    for n in args.workers:  # the prefix count scales with the fleet
        args.prefixes = args.prefixes_per_worker * n
        r = asyncio.run(main_async(argparse.Namespace(**{**vars(args), "workers": [n]})))
        if not results:
            results = r
        else:
            results["runs"] += r["runs"]
            results["capacity"].update(r["capacity"])
            results["router_cost"].update(r["router_cost"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
