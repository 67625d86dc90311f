"""``kvcascade loadtest``: run a scenario against one target, or ``compare`` several.

    kvcascade loadtest --target grpc://127.0.0.1:50051 --scenario shared-prefix-chat --out runs/a
    kvcascade loadtest compare --scenario multi-turn --target grpc=grpc://127.0.0.1:50051 \\
        --target http=http://127.0.0.1:8000 --out runs/b

This module imports only argparse at load time, so ``kvcascade --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", nargs="?", choices=["compare"],
                        help="compare: run the scenario against every --target NAME=ADDRESS in turn, "
                             "one table side by side")
    parser.add_argument("--target", action="append", default=[], metavar="[NAME=]ADDRESS",
                        help="grpc://host:port, http://host:port or host:port (the scenario's protocol, "
                             "else gRPC); repeat with NAME= for compare (default: grpc://127.0.0.1:50051)")
    parser.add_argument("--scenario", required=True,
                        help="a scenario YAML file, or the name of a bundled one (loadtest/scenarios/): "
                             "shared-prefix-chat, multi-turn, random-lengths, cascade-mix")
    parser.add_argument("--out", type=Path, default=Path("loadtest-out"),
                        help="folder for summary.json, requests.jsonl and the plots (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("KVCASCADE_API_KEY"),
                        help="API key to send (default: $KVCASCADE_API_KEY)")
    parser.add_argument("--max-requests", type=int, help="override the scenario's max_requests")
    parser.add_argument("--max-duration", type=float, metavar="SECONDS", help="override the scenario's max_duration_s")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def main(args: argparse.Namespace) -> int:
    import asyncio

    from loadtest import report
    from loadtest.clients import parse_target
    from loadtest.runner import run
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

    async def run_all():
        # One after another, never at once: targets often share the machine, and the load test too.
        return [await run(scenario, t, api_key=args.api_key, progress=None if args.no_progress else sys.stderr)
                for t in targets]

    try:
        results = asyncio.run(run_all())
    except KeyboardInterrupt:
        return 130
    print(report.table(scenario, {r.target.name: r.summary() for r in results}))
    paths = report.write(args.out, scenario, results)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
