"""A run spread over N processes, so the load generator is never the limit: one Python process
reads some 10,000 to 30,000 streamed messages a second at most (gRPC the fewer; its event loop
runs on one core), about what one served GPU streams (benchmarks/loadtest_capacity.py).

    split    the scenario into parts: closed-loop users, burst sizes and Poisson rates divided
             between the parts, max_requests too (the totals match exactly), the sessions dealt out
             (part i sends sessions i, i+N, i+2N, ...: together the single-process run's sessions)
    run_in_processes
             one spawned process per part, all started at once when every one is ready, and
    merge    their records into one RunResult, as if one process had sent them all: start times
             on one clock, the run from the earliest start to the latest end

A part never gets nothing to do: a closed loop of concurrency 3 runs in at most 3 processes. A
finite multi-turn workload may leave one part short of its share while another hits its own,
so such a run can send a few requests fewer than one process would.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import multiprocessing
import queue
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any, TextIO

from loadtest.clients import Target
from loadtest.runner import WHOLE, Counts, Part, ProgressLine, RunResult, run
from loadtest.scenario import Scenario


def apportion(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights``, summing exactly to ``total`` (largest
    remainders, ties to the first)."""
    whole = sum(weights)
    shares = [total * w // whole for w in weights]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def split(scenario: Scenario, n: int) -> list[tuple[Scenario, Part]]:
    """The scenario as at most ``n`` parts, each a scenario of its own and the ``Part`` it sends."""
    assert n >= 1, n
    if n == 1:
        return [(scenario, WHOLE)]
    a = scenario.arrival
    units = {"closed": a.concurrency, "burst": a.size}.get(a.kind)
    weights = [w for w in apportion(units, [1] * n) if w] if units else [1] * n
    requests = apportion(scenario.max_requests, weights)
    kept = [(w, m) for w, m in zip(weights, requests, strict=True) if m]
    parts = []
    for i, (w, m) in enumerate(kept):
        if a.kind == "closed":
            arrival = dataclasses.replace(a, concurrency=w)
        elif a.kind == "burst":
            arrival = dataclasses.replace(a, size=w)
        else:
            arrival = dataclasses.replace(a, rate=a.rate / len(kept))
        parts.append((dataclasses.replace(scenario, arrival=arrival, max_requests=m), Part(i, len(kept))))
    return parts


def merge(target: Target, scenario: Scenario, parts: list[RunResult]) -> RunResult:
    """The parts' records as one run of ``scenario``: start times moved onto the earliest part's
    clock, indexes renumbered in order of sending, the duration from the earliest start to the
    latest end."""
    start = min(p.started_at for p in parts)
    records = [dataclasses.replace(rec, start_s=rec.start_s + p.started_at - start)
               for p in parts for rec in p.records]
    records.sort(key=lambda rec: rec.start_s)
    for i, rec in enumerate(records):
        rec.index = i
    duration = max(p.started_at + p.duration_s for p in parts) - start
    # What one process would have said: the time bound if any part hit it, else whether the
    # requests sent add up to the scenario's bound.
    if any(p.stopped_by == "max_duration_s" for p in parts):
        stopped_by = "max_duration_s"
    else:
        stopped_by = "max_requests" if len(records) >= scenario.max_requests else "workload"
    return RunResult(target, scenario, records, duration, stopped_by, start, [c for p in parts for c in p.cpu_s],
                     [c for p in parts for c in p.loop_cpu_s])


def run_in_processes(scenario: Scenario, target: Target, processes: int, *, api_key: str | None = None,
                     progress: TextIO | None = None) -> RunResult:
    """Run ``scenario`` against ``target`` from ``processes`` processes (fewer when it has not
    enough work for them: see ``split``). A run of one part runs here, in this process."""
    parts = split(scenario, processes)
    line = ProgressLine(progress, target.name, scenario) if progress else None
    if len(parts) == 1:
        return asyncio.run(run(scenario, target, api_key=api_key, progress=line))
    ctx = multiprocessing.get_context("spawn")  # no fork: grpc's threads and a running loop do not survive one
    inbox, go = ctx.Queue(), ctx.Event()
    counts = ctx.Array("q", 4 * len(parts), lock=False)
    procs = [ctx.Process(target=_part_main, args=(i, s, p, target, api_key, inbox, go, counts),
                         name=f"loadtest-{i}", daemon=True) for i, (s, p) in enumerate(parts)]
    for p in procs:
        p.start()
    try:
        _collect(inbox, procs, "ready")
        go.set()
        t0 = last = time.perf_counter()

        def draw() -> None:
            nonlocal last
            if line and time.perf_counter() - last >= line.interval_s:
                last = time.perf_counter()
                line.update(sum((_SharedCounts(counts, i).read() for i in range(len(parts))), Counts()), last - t0)

        results = _collect(inbox, procs, "done", draw)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    merged = merge(target, scenario, [results[i] for i in range(len(parts))])
    if line:
        line.update(merged.counts(), merged.duration_s, final=True)
    return merged


def _collect(inbox: Queue, procs: list[BaseProcess], kind: str, idle: Callable[[], None] | None = None
             ) -> dict[int, Any]:
    """Every process's ``kind`` message, by process index; a process that failed or died raises."""
    got: dict[int, Any] = {}
    while len(got) < len(procs):
        # Whoever is dead before the wait has its last message in the pipe already, so a wait
        # that comes back empty means it died without sending it.
        dead = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in got]
        try:
            what, i, payload = inbox.get(timeout=0.1)
        except queue.Empty:
            if dead:
                code = procs[dead[0]].exitcode
                raise RuntimeError(f"load-test process {dead[0]} exited with code {code}") from None
            if idle:
                idle()
            continue
        if what == "failed":
            raise RuntimeError(f"load-test process {i} failed:\n{payload}")
        assert what == kind, (what, kind)
        got[i] = payload
    return got


class _SharedCounts:
    """A part's counts in memory shared with the parent, whose one progress line adds them up."""

    interval_s = 0.2

    def __init__(self, array: ctypes.Array[ctypes.c_longlong], index: int):
        self.array, self.offset = array, 4 * index

    def update(self, counts: Counts, elapsed_s: float, final: bool = False) -> None:
        c = counts
        self.array[self.offset: self.offset + 4] = [c.sent, c.ok, c.failed, c.in_flight]

    def read(self) -> Counts:
        return Counts(*self.array[self.offset: self.offset + 4])


def _part_main(index: int, scenario: Scenario, part: Part, target: Target, api_key: str | None,
               inbox: Queue, go: Event, counts: ctypes.Array[ctypes.c_longlong]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops every part
    try:
        inbox.put(("ready", index, None))
        go.wait()
        result = asyncio.run(run(scenario, target, api_key=api_key, progress=_SharedCounts(counts, index), part=part))
        inbox.put(("done", index, result))
    except BaseException:
        inbox.put(("failed", index, traceback.format_exc()))
