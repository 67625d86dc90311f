"""``kvcascade loadtest``: run a scenario against one target, or ``compare`` several.

    kvcascade loadtest --target grpc://127.0.0.1:50051 --scenario shared-prefix-chat --out runs/a
    kvcascade loadtest compare --scenario multi-turn --target grpc=grpc://127.0.0.1:50051 \\
        --target http=http://127.0.0.1:8000 --out runs/b
    kvcascade loadtest --processes 4 ...   # the clients spread over 4 processes, one merged result

This module imports only argparse at load time, so ``kvcascade --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# A load-test process whose event loop was on the CPU this share of the run may have been the limit.
BUSY = 0.9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", nargs="?", choices=["compare"],
                        help="compare: run the scenario against every --target NAME=ADDRESS in turn, "
                             "one table side by side")
    parser.add_argument("--target", action="append", default=[], metavar="[NAME=]ADDRESS",
                        help="grpc://host:port, http://host:port or host:port (the scenario's protocol, "
                             "else gRPC); repeat with NAME= for compare (default: grpc://127.0.0.1:50051)")
    parser.add_argument("--scenario", required=True,
                        help="a scenario YAML file, or the name of a bundled one (loadtest/scenarios/): "
                             "shared-prefix-chat, multi-turn, random-lengths, cascade-mix, cascade-tasks")
    parser.add_argument("--out", type=Path, default=Path("loadtest-out"),
                        help="folder for summary.json, requests.jsonl and the plots (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("KVCASCADE_API_KEY"),
                        help="API key to send (default: $KVCASCADE_API_KEY)")
    parser.add_argument("--max-requests", type=int, help="override the scenario's max_requests")
    parser.add_argument("--max-duration", type=float, metavar="SECONDS", help="override the scenario's max_duration_s")
    parser.add_argument("--processes", type=_processes, default=1, metavar="N",
                        help="spread the clients over N processes (closed-loop users, arrival rate and "
                             "max_requests split between them; one merged result) so the load generator is "
                             "not the limit: one process reads some 10,000 to 30,000 streamed tokens/s at most "
                             "(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def _processes(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def main(args: argparse.Namespace) -> int:
    from loadtest import report
    from loadtest.clients import parse_target
    from loadtest.processes import run_in_processes, split
    from loadtest.scenario import ScenarioError, load_scenario

    try:
        scenario = load_scenario(args.scenario).bounded(args.max_requests, args.max_duration)
        specs = args.target or ["grpc://127.0.0.1:50051"]
        targets = [parse_target(t, scenario.protocol) for t in specs]
    except (ScenarioError, ValueError) as err:
        print(f"kvcascade loadtest: error: {err}", file=sys.stderr)
        return 2
    names = [t.name for t in targets]
    if args.mode == "compare" and len(targets) < 2:
        print("kvcascade loadtest: error: compare needs two or more --target NAME=ADDRESS", file=sys.stderr)
        return 2
    if args.mode != "compare" and len(targets) > 1:
        print("kvcascade loadtest: error: several targets: use `kvcascade loadtest compare`", file=sys.stderr)
        return 2
    if len(set(names)) != len(names):
        print(f"kvcascade loadtest: error: target names must differ, got {names} (use NAME=ADDRESS)",
              file=sys.stderr)
        return 2

    if (used := len(split(scenario, args.processes))) < args.processes:
        a = scenario.arrival
        load = {"closed": f"{a.concurrency} closed-loop users", "burst": f"bursts of {a.size}"}.get(a.kind, "")
        print(f"kvcascade loadtest: note: the scenario ({load or a.kind}, max_requests {scenario.max_requests}) "
              f"has work for {used} process(es), not {args.processes}", file=sys.stderr)
    progress = None if args.no_progress else sys.stderr
    try:
        # One after another, never at once: targets often share the machine, and the load test too.
        results = [run_in_processes(scenario, t, args.processes, api_key=args.api_key, progress=progress)
                   for t in targets]
    except KeyboardInterrupt:
        return 130
    summaries = {r.target.name: r.summary() for r in results}
    for name, summary in summaries.items():
        if (busy := summary["harness"]["loop_busy"]) is not None and busy >= BUSY:
            print(f"kvcascade loadtest: note: [{name}] a load-test process was busy {busy:.0%} of the run: "
                  "the numbers may be the harness's limit, not the server's (try --processes)", file=sys.stderr)
    print(report.table(scenario, summaries))
    paths = report.write(args.out, scenario, results)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
