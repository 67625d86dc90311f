"""How fast the load-test harness itself can go, so its numbers are the server's and not its own.

The target is loadtest/fake_server.py, a server that only streams: every request gets its
``--tokens`` made-up tokens, one message (or SSE event) each, as fast as the server can send,
with no model. The harness runs a closed loop of ``--concurrency`` users against it for
``--duration`` seconds, with 1 and with N processes (``kvcascade loadtest --processes N``), over
gRPC and over OpenAI-style HTTP.

    python benchmarks/loadtest_capacity.py --processes 1 2 --server-processes 1 --duration 8

Reports per run: streamed output tokens/s and requests/s as the harness reports them (requests
still running at the time bound are cut off and not counted, so both are a little low), the CPU
the harness used (cores, and its busiest event loop's share of the run), the fake server's CPU
(cores), what else ran meanwhile (cores) and how busy the whole machine was. When they fill the
machine, the number is the machine's limit; the harness's own is its tokens/s per core it used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy.local import free_port  # noqa: E402
from loadtest.clients import parse_target  # noqa: E402
from loadtest.processes import run_in_processes  # noqa: E402
from loadtest.scenario import scenario_from_dict  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
TARGET_TOKENS_PER_S = 50_000  # 5x the ~10,000 output tokens/s the served benchmarks report


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, every core."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / TICK, sum(values) / TICK


def start_servers(n: int, tokens_per_message: int) -> tuple[list[subprocess.Popen], int, int]:
    """``n`` fake-server processes sharing one gRPC and one HTTP port; returns once all listen."""
    port, http_port = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "loadtest.fake_server", "--port", str(port),
                               "--http-port", str(http_port), "--tokens-per-message", str(tokens_per_message)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    for p in procs:
        line = p.stdout.readline()
        if not line.startswith("fake server:"):
            raise SystemExit(f"fake server did not start (exit code {p.poll()})")
    return procs, port, http_port


def measure(args: argparse.Namespace, protocol: str, address: str, processes: int, servers: list) -> dict:
    scenario = scenario_from_dict({
        "name": "capacity", "api": "completion", "max_requests": 1_000_000_000, "max_duration_s": args.duration,
        "sampling": {"max_tokens": args.tokens, "ignore_eos": True},
        "arrival": {"kind": "closed", "concurrency": args.concurrency},
        "workload": {"kind": "random", "prompt_words": 8}})
    # The machine's counters span the harness processes' start too: ``window`` seconds, not the run's.
    server0, machine0, t0 = sum(cpu_s(p.pid) for p in servers), machine_busy(), time.perf_counter()
    result = run_in_processes(scenario, parse_target(address, protocol), processes)
    server1, machine1, window = sum(cpu_s(p.pid) for p in servers), machine_busy(), time.perf_counter() - t0
    s = result.summary()
    seconds = s["duration_s"]
    return {"protocol": protocol, "processes": s["harness"]["processes"], "server_processes": len(servers),
            "ok": s["requests"]["ok"], "errors": s["requests"]["errors"],
            "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
            "requests_per_s": s["throughput"]["requests_per_s"],
            "harness_cores": s["harness"]["cpu_s"] / seconds, "busiest_loop": s["harness"]["loop_busy"],
            "server_cores": (server1 - server0) / window,
            "machine_busy": (machine1[0] - machine0[0]) / (machine1[1] - machine0[1]),
            # Whatever else ran on the machine meanwhile: other users' processes, harness start-up.
            "other_cores": (machine1[0] - machine0[0] - s["harness"]["cpu_s"] - (server1 - server0)) / window,
            "tokens_per_harness_core_s": s["tokens"]["output"] / s["harness"]["cpu_s"]}


def table(rows: list[dict]) -> str:
    head = ["protocol", "harness procs", "server procs", "output tok/s", "req/s", "harness cores", "busiest loop",
            "server cores", "other cores", "machine busy", "tok/s per harness core", "ok / errors"]
    cells = [[r["protocol"], str(r["processes"]), str(r["server_processes"]), f"{r['output_tokens_per_s']:,.0f}",
              f"{r['requests_per_s']:,.0f}", f"{r['harness_cores']:.2f}", f"{r['busiest_loop']:.0%}",
              f"{r['server_cores']:.2f}", f"{max(0.0, r['other_cores']):.2f}", f"{r['machine_busy']:.0%}",
              f"{r['tokens_per_harness_core_s']:,.0f}", f"{r['ok']} / {r['errors']}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *cells, strict=True)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in [head, *cells]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main() -> int:
    cores = os.cpu_count() or 1
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, nargs="+", default=sorted({1, max(2, cores // 2)}),
                    help="harness process counts to measure (default: 1 and half the cores, at least 2)")
    ap.add_argument("--server-processes", type=int, default=max(1, cores // 2),
                    help="fake-server processes sharing its ports (default: half the cores)")
    ap.add_argument("--protocols", nargs="+", choices=["grpc", "http"], default=["grpc", "http"])
    ap.add_argument("--concurrency", type=int, default=64, help="closed-loop users in all (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--tokens-per-message", type=int, default=1, help="(default: %(default)s: one per decode step)")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per run (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args()
    servers, port, http_port = start_servers(args.server_processes, args.tokens_per_message)
    rows = []
    try:
        for protocol in args.protocols:
            address = f"grpc://127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{http_port}"
            for n in args.processes:
                rows.append(measure(args, protocol, address, n, servers))
                print(f"{protocol}, {n} harness process(es): {rows[-1]['output_tokens_per_s']:,.0f} tok/s",
                      file=sys.stderr)
                time.sleep(0.5)  # let the server settle between runs
    finally:
        for p in servers:
            p.terminate()
            p.wait()
    print(f"harness capacity: {cores} cores, {args.concurrency} users, {args.tokens} tokens a request, "
          f"{args.tokens_per_message} token(s) a message, {args.duration:g} s a run")
    print(table(rows))
    for protocol in args.protocols:
        mine = [r for r in rows if r["protocol"] == protocol]
        best = max(mine, key=lambda r: r["output_tokens_per_s"])
        per_core = max(r["tokens_per_harness_core_s"] for r in mine)
        verdict = "met" if best["output_tokens_per_s"] >= TARGET_TOKENS_PER_S else "not met on this machine"
        print(f"{protocol}: best {best['output_tokens_per_s']:,.0f} output tok/s ({best['processes']} harness "
              f"process(es)): {TARGET_TOKENS_PER_S:,} tok/s {verdict}; the harness streams {per_core:,.0f} tok/s per "
              f"core it uses, so {TARGET_TOKENS_PER_S:,} tok/s takes about --processes "
              f"{math.ceil(TARGET_TOKENS_PER_S / per_core)} with as many cores free of the server")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
