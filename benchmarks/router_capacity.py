"""How many streamed tokens a second one router process relays before it saturates a core.

    python benchmarks/router_capacity.py --tokenizer TOKDIR [--concurrency 128 256 512 1024]
        [--protocols grpc http] [--processes 4] [--server-processes 4] [--workers 4] [--interval-ms 20]
        [--max-tokens 256] [--duration 20] [--router-args "--http-workers 4"] [--out router_capacity.json]
        [--overhead 200]

Behind one `kvcascade router` (--tokenizer TOKDIR, so no model files; --router-args adds flags): a
redis-server of its own and --server-processes fake workers (loadtest/fake_server.py), each sending
one token a message every --interval-ms (a busy GPU's decode step: 20 ms is ~50 tok/s a stream), so
the closed loop's concurrency sets the offered rate. They are registered in Redis as --workers
workers, the way `kvcascade worker --model dummy:smollm2-135m --tokenizer TOKDIR` registers, with a
TTL longer than the benchmark. In front: the load-test harness (loadtest/processes.py) from
--processes processes, a closed loop of each --concurrency over each of --protocols, every user
sending about --duration seconds' worth of --max-tokens requests back to back (at least one).

Reports per run: output tok/s delivered to the clients, what the workers offered (users x 1000 /
interval) and the messages/s they sent (one token each), TTFT p50 and TPOT p50/p90 (a TPOT above
the interval: the relay lags), and the cores (CPU seconds / seconds of the run, from /proc, read
between the run's own start and end) of the router's process tree (summed, and its busiest process),
of the fake workers, of redis-server and of the harness, with how busy the whole machine was. The
router's capacity is the most tok/s it relayed with its busiest process below 0.95 of a core, and its
saturation the most tok/s with it at or above; a short table comes last, the rows as JSON in --out.

With --overhead N, first the router's own latency at low load: N requests one at a time (prompts of
about 580 words, as workload (b)'s mean, 8 tokens each), straight to a fake worker over gRPC, then
through the router over gRPC and over HTTP; the TTFT p50/p90 of each and p50 minus the straight
p50. A fake worker neither tokenizes nor computes, so the difference is the router's alone: its
hop, the registry snapshot, tokenizing the prompt and the prefix-index lookup (a real worker given
text tokenizes it too, so against one the router's share is smaller by the tokenizing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadtest_capacity import machine_busy  # noqa: E402
from benchmarks.served_gpu import cpu_s, process_tree, start, stop  # noqa: E402
from deploy.local import LocalRedis, free_port  # noqa: E402
from loadtest.clients import parse_target  # noqa: E402
from loadtest.processes import run_in_processes  # noqa: E402
from loadtest.scenario import scenario_from_dict  # noqa: E402
from contracts.state import WorkerInfo, WorkerLoad  # noqa: E402
from contracts.stores import connect_state  # noqa: E402

MODEL = "dummy:smollm2-135m"  # what the fake workers say they serve: the router resolves it without files
SATURATED = 0.95  # of a core: a Python process this busy is at its limit
REGISTRATION_TTL_S = 7 * 24 * 3600.0  # outlives any run, so nothing needs to heartbeat


class CpuSampler:
    """CPU seconds of some processes and the machine's busy and total seconds, read from /proc every
    ``interval_s`` in a thread, so a run's cores are those between its own start and end
    (interpolated), not diluted by the harness processes' start-up around it."""

    def __init__(self, pids: list[int], interval_s: float = 0.1):
        self.pids, self.interval_s = pids, interval_s
        self.samples: list[tuple[float, list[float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def _sample(self) -> None:
        self.samples.append((time.time(), [*(cpu_s(p) for p in self.pids), *machine_busy()]))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> CpuSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _at(self, t: float) -> list[float]:
        after = next((i for i, (ts, _) in enumerate(self.samples) if ts >= t), len(self.samples) - 1)
        (t0, a), (t1, b) = self.samples[max(0, after - 1)], self.samples[after]
        f = 0.0 if t1 <= t0 else min(1.0, max(0.0, (t - t0) / (t1 - t0)))
        return [x + (y - x) * f for x, y in zip(a, b, strict=True)]

    def between(self, start_s: float, end_s: float) -> tuple[dict[int, float], float]:
        """Cores each pid used from ``start_s`` to ``end_s`` (time.time()), and the machine's busy share."""
        a, b = self._at(start_s), self._at(end_s)
        seconds = max(end_s - start_s, 1e-9)
        cores = {p: (b[i] - a[i]) / seconds for i, p in enumerate(self.pids)}
        total = b[-1] - a[-1]
        return cores, (b[-2] - a[-2]) / total if total > 0 else 0.0


def start_fake_workers(n: int, interval_ms: float) -> tuple[list[subprocess.Popen], list[str]]:
    """``n`` fake-worker processes, each on a gRPC port of its own; returns once all listen. Not one
    shared port: the router keeps one channel (one TCP connection) per address, and the kernel hands
    a connection to one of the processes sharing a port, so the others would stand idle."""
    procs, addresses = [], []
    for _ in range(n):
        port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "loadtest.fake_server", "--port", str(port), "--http-port", str(free_port()),
             "--interval-ms", str(interval_ms)], cwd=REPO, stdout=subprocess.PIPE, text=True))
        addresses.append(f"127.0.0.1:{port}")
    for p in procs:
        if not p.stdout.readline().startswith("fake server:"):
            raise SystemExit(f"fake server did not start (exit code {p.poll()})")
    return procs, addresses


async def register(redis_url: str, addresses: list[str], workers: int, tokenizer: Path) -> None:
    """``workers`` registrations over ``addresses`` in turn, each what worker/registration.py writes."""
    registry, _ = connect_state(redis_url)
    try:
        for i in range(workers):
            await registry.register(WorkerInfo(
                worker_id=f"fake-{i}", epoch=uuid.uuid4().hex[:12], address=addresses[i % len(addresses)],
                model=MODEL, model_source=MODEL, tokenizer=str(tokenizer), capacity=256, load=WorkerLoad()),
                REGISTRATION_TTL_S)
    finally:
        await registry.aclose()


def _label(pid: int, name: str, root: int) -> str:
    """A router tree process's part: the router, its resource tracker, or a child (an HTTP front)."""
    return "router" if pid == root else "resource tracker" if "resource_tracker" in name else "child"


def measure(args: argparse.Namespace, protocol: str, address: str, users: int, max_tokens: int, duration: float,
            router_pid: int, other_pids: dict[str, list[int]], per_user: int | None = None) -> dict[str, Any]:
    """A closed-loop run of ``users`` for about ``duration`` seconds (or of ``per_user`` requests each,
    however long they take), and what each side used meanwhile."""
    stream_s = max_tokens * args.interval_ms / 1000
    if per_user is not None:
        bound = 120.0
    elif stream_s:  # whole requests only, so every token is counted
        per_user = max(1, round(duration / stream_s))
        bound = max(duration, 3 * per_user * stream_s) + 10
    else:  # flat out: the time bound cuts the last requests off
        per_user, bound = 1_000_000_000, duration
    scenario = scenario_from_dict({
        "name": f"router-{protocol}-{users}", "api": "completion", "max_requests": users * per_user,
        "max_duration_s": bound, "sampling": {"max_tokens": max_tokens, "ignore_eos": True},
        "arrival": {"kind": "closed", "concurrency": users}, "workload": {"kind": "random", "prompt_words": 8}})
    tree = process_tree(router_pid)  # again each run: --http-workers replaces a child that died
    pids = [*tree, *(p for group in other_pids.values() for p in group)]
    with CpuSampler(pids) as sampler:
        result = run_in_processes(scenario, parse_target(address, protocol), args.processes)
    s = result.summary()
    seconds = s["duration_s"]
    cores, busy = sampler.between(result.started_at, result.started_at + seconds)
    router = {f"{_label(p, name, router_pid)} ({p})": cores[p] for p, name in tree.items()}
    groups = {name: sum(cores[p] for p in group) for name, group in other_pids.items()}
    harness = s["harness"]["cpu_s"] / seconds
    delivered = sum(r.output_tokens for r in result.records)  # cut-off gRPC streams count what came
    return {
        "protocol": protocol, "users": users, "max_tokens": max_tokens, "duration_s": seconds,
        "ok": s["requests"]["ok"], "errors": s["requests"]["errors"], "cut_off": s["requests"]["cut_off"],
        "errors_by_status": s["errors_by_status"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "offered_tokens_per_s": users * 1000 / args.interval_ms if args.interval_ms else None,
        "worker_messages_per_s": delivered / seconds,  # one token a message
        "ttft_p50_s": s["ttft_s"]["p50"], "tpot_p50_s": s["tpot_s"]["p50"], "tpot_p90_s": s["tpot_s"]["p90"],
        "router_cores": sum(router.values()), "router_busiest_cores": max(router.values()),
        "router_processes": router, "server_cores": groups["servers"], "redis_cores": groups["redis"],
        "harness_cores": harness, "harness_busiest_loop": s["harness"]["loop_busy"],
        "machine_busy": busy,
        "other_cores": busy * (os.cpu_count() or 1) - sum(router.values()) - sum(groups.values()) - harness,
    }


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ms(x: float | None, spec: str = ".0f") -> str:
    return _f(None if x is None else x * 1000, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = ["protocol", "users", "offered tok/s", "output tok/s", "worker msg/s", "TTFT p50", "TPOT p50/p90",
            "router cores", "per process", "fake cores", "redis", "harness", "other", "machine",
            "ok/err/cut"]
    cells = [[r["protocol"], str(r["users"]), _f(r["offered_tokens_per_s"], ",.0f"),
              _f(r["output_tokens_per_s"], ",.0f"), f"{r['worker_messages_per_s']:,.0f}",
              f"{_ms(r['ttft_p50_s'])} ms", f"{_ms(r['tpot_p50_s'], '.1f')}/{_ms(r['tpot_p90_s'], '.1f')} ms",
              f"{r['router_cores']:.2f}",
              "/".join(f"{c:.2f}" for c in sorted(r["router_processes"].values(), reverse=True) if c >= 0.005),
              f"{r['server_cores']:.2f}", f"{r['redis_cores']:.2f}", f"{r['harness_cores']:.2f}",
              f"{max(0.0, r['other_cores']):.2f}", f"{r['machine_busy']:.0%}",
              f"{r['ok']}/{r['errors']}/{r['cut_off']}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *cells, strict=True)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in [head, *cells]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def capacity(rows: list[dict[str, Any]], protocol: str) -> dict[str, Any]:
    """The most tok/s below saturation and the most at it, with the runs they came from."""
    mine = [r for r in rows if r["protocol"] == protocol]
    below = [r for r in mine if r["router_busiest_cores"] < SATURATED]
    at = [r for r in mine if r["router_busiest_cores"] >= SATURATED]
    best = max(below, key=lambda r: r["output_tokens_per_s"], default=None)
    top = max(at, key=lambda r: r["output_tokens_per_s"], default=None)
    return {"protocol": protocol,
            "capacity_tokens_per_s": best and best["output_tokens_per_s"], "capacity_users": best and best["users"],
            "capacity_router_busiest_cores": best and best["router_busiest_cores"],
            "saturated_tokens_per_s": top and top["output_tokens_per_s"], "saturated_users": top and top["users"]}


def verdict(c: dict[str, Any], most_users: int) -> str:
    if c["capacity_tokens_per_s"] is None:
        below = "no run below it: lower --concurrency"
    else:
        below = (f"{c['capacity_tokens_per_s']:,.0f} tok/s with its busiest process at "
                 f"{c['capacity_router_busiest_cores']:.2f} of a core ({c['capacity_users']} users)")
    at = (f"saturated: {c['saturated_tokens_per_s']:,.0f} tok/s ({c['saturated_users']} users)"
          if c["saturated_tokens_per_s"] is not None else f"not saturated up to {most_users} users")
    return f"{c['protocol']}: router capacity {below}; {at}"


OVERHEAD_WORDS = 580  # workload (b)'s mean prompt, in words (about a token each)


def overhead(worker: str, router_grpc: str, router_http: str, n: int, interval_ms: float) -> dict[str, Any]:
    """TTFTs of ``n`` requests one at a time, straight to ``worker`` and through the router; each path's
    prompts are new (none cached), the same lengths on every path."""
    import random

    from benchmarks.served_gpu import _sequential, pct
    from loadtest.text import words

    def prompts(salt: str) -> list[tuple[str, int]]:
        rng = random.Random(0)
        return [(f"{salt}-{i} {words(rng, OVERHEAD_WORDS)}", 8) for i in range(n + 5)]  # 5 unmeasured first

    out: dict[str, Any] = {"requests": n, "prompt_words": OVERHEAD_WORDS, "interval_ms": interval_ms}
    paths = [("grpc_worker", "grpc", worker), ("grpc_router", "grpc", router_grpc),
             ("http_router", "http", router_http)]
    measured = _sequential([(protocol, address) for _, protocol, address in paths],
                           [prompts(label) for label, _, _ in paths])
    ttfts = {label: t for (label, _, _), t in zip(paths, measured)}
    for label, t in ttfts.items():
        out[f"{label}_ttft_p50_ms"], out[f"{label}_ttft_p90_ms"] = 1e3 * pct(t, 50), 1e3 * pct(t, 90)
        if label != "grpc_worker":
            out[f"{label}_overhead_p50_ms"] = 1e3 * (pct(t, 50) - pct(ttfts["grpc_worker"], 50))
    return out


def main() -> int:
    cores = os.cpu_count() or 1
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder the router (and workers) use")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[128, 256, 512, 1024],
                    help="closed-loop users of each run (default: %(default)s)")
    ap.add_argument("--protocols", nargs="+", choices=["grpc", "http"], default=["grpc", "http"])
    ap.add_argument("--processes", type=int, default=4, help="harness processes (default: %(default)s)")
    ap.add_argument("--server-processes", type=int, default=4, help="fake-worker processes (default: %(default)s)")
    ap.add_argument("--workers", type=int, help="workers registered over them (default: one each)")
    ap.add_argument("--interval-ms", type=float, default=20.0,
                    help="ms between a stream's messages, an engine step (default: %(default)s; 0: flat out)")
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens a request (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=20.0, help="about this many seconds a run (default: %(default)s)")
    ap.add_argument("--router-args", default="", help="extra router flags, e.g. '--http-workers 4'")
    ap.add_argument("--logs", type=Path, help="router log folder (default: a new temporary one)")
    ap.add_argument("--out", type=Path, help="write the rows and capacities as JSON here")
    ap.add_argument("--overhead", type=int, default=0, metavar="N",
                    help="first, N requests one at a time straight to a fake worker and through the router (TTFTs)")
    args = ap.parse_args()
    if not args.tokenizer.is_dir():
        ap.error(f"--tokenizer {args.tokenizer}: not a folder")
    workers = args.workers or args.server_processes
    if workers < args.server_processes:
        ap.error("--workers: at least one per server process, or some processes get no traffic")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="router-capacity-"))
    logs.mkdir(parents=True, exist_ok=True)
    redis = LocalRedis().start()
    servers: list[subprocess.Popen] = []
    router = None
    rows: list[dict[str, Any]] = []
    try:
        servers, addresses = start_fake_workers(args.server_processes, args.interval_ms)
        asyncio.run(register(redis.url, addresses, workers, args.tokenizer.resolve()))
        port, http_port = free_port(), free_port()
        router = start(["router", "--redis-url", redis.url, "--host", "127.0.0.1", "--port", str(port),
                        "--http-port", str(http_port), "--tokenizer", str(args.tokenizer.resolve()),
                        *shlex.split(args.router_args)], logs / "router.log", http_port, timeout=120)
        others = {"servers": [p.pid for p in servers], "redis": [redis.proc.pid]}
        targets = {"grpc": f"grpc://127.0.0.1:{port}", "http": f"http://127.0.0.1:{http_port}"}
        if args.overhead:
            low_load = overhead(addresses[0], f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", args.overhead,
                                args.interval_ms)
            print(f"router overhead at low load: {json.dumps(low_load)}", flush=True)
        for protocol in args.protocols:
            # Short requests first, as long as they take: every router process loads its tokenizer
            # (seconds) and dials the workers.
            measure(args, protocol, targets[protocol], 8 * args.processes, 4, 0.0, router.pid, others, per_user=4)
            for users in args.concurrency:
                rows.append(measure(args, protocol, targets[protocol], users, args.max_tokens, args.duration,
                                    router.pid, others))
                r = rows[-1]
                print(f"{protocol}, {users} users: {r['output_tokens_per_s']:,.0f} tok/s, router "
                      f"{r['router_cores']:.2f} cores (busiest {r['router_busiest_cores']:.2f})", file=sys.stderr)
    finally:
        if router is not None:
            stop(router)
        for p in servers:
            p.terminate()
            p.wait()
        redis.stop()
    print(f"router capacity: {cores} cores, {workers} workers in {args.server_processes} fake-worker process(es) "
          f"at {args.interval_ms:g} ms a token, {args.max_tokens} tokens a request, {args.processes} harness "
          f"process(es), router args {args.router_args!r} (log: {logs / 'router.log'})")
    if args.overhead:
        o = low_load
        print(f"router overhead at low load (TTFT p50 minus straight to the worker's, "
              f"{o['grpc_worker_ttft_p50_ms']:.2f} ms): gRPC +{o['grpc_router_overhead_p50_ms']:.2f} ms, "
              f"HTTP +{o['http_router_overhead_p50_ms']:.2f} ms")
    caps = [capacity(rows, protocol) for protocol in args.protocols]
    for c in caps:
        print(verdict(c, max(args.concurrency)))
    if any(r["machine_busy"] > 0.9 for r in rows):
        print("the machine was over 90% busy in some runs: there the numbers are the machine's, not the router's")
    if any((r["harness_busiest_loop"] or 0) > 0.9 for r in rows):
        print("a harness event loop was over 90% busy in some runs: there it may be the limit (raise --processes)")
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cores": cores,
                                        "capacity": caps, "rows": rows,
                                        "overhead": low_load if args.overhead else None}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
