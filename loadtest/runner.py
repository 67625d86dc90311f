"""Running a scenario against one target: arrivals, the request and time bounds, progress.

Every run stops by itself, at the first of: the workload runs out, ``max_requests`` requests have
been sent, or ``max_duration_s`` has passed. At the time bound, requests still running are
cancelled (gRPC cancels the call, HTTP closes the stream, so the server frees their KV blocks)
and recorded as cut off. One request also stops at ``request_timeout_s`` (status ``timeout``).

A run is one asyncio loop in one process; loadtest/processes.py spreads a scenario over several
such runs, each sending its ``Part``, and merges their records.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from loadtest.tasks import score
from loadtest.clients import Client, Target, make_client
from loadtest.metrics import CUT_OFF, OK, RequestRecord, summarize
from loadtest.scenario import Scenario
from loadtest.workload import Session, sessions


@dataclass(frozen=True)
class Part:
    """Which share of a scenario's sessions and arrivals one run sends: every ``count``-th session
    from ``index`` on, so the parts of a scenario send its sessions between them, none twice."""

    index: int = 0
    count: int = 1


WHOLE = Part()


@dataclass
class RunResult:
    target: Target
    scenario: Scenario
    records: list[RequestRecord]
    duration_s: float
    stopped_by: str  # workload | max_requests | max_duration_s
    started_at: float = 0.0  # time.time() at the start: runs in other processes line up on it
    # Per harness process: CPU seconds of the whole process, and of the thread running its event
    # loop (the one that saturates: a loop busy all the run long may itself have been the limit).
    cpu_s: list[float] = field(default_factory=list)
    loop_cpu_s: list[float] = field(default_factory=list)

    def counts(self) -> Counts:
        return Counts(len(self.records), sum(r.ok and r.e2e_s is not None for r in self.records),
                      sum(r.status not in (OK, CUT_OFF) for r in self.records))

    def summary(self) -> dict[str, Any]:
        busiest = max(self.loop_cpu_s) / self.duration_s if self.loop_cpu_s and self.duration_s > 0 else None
        return {"target": str(self.target), "stopped_by": self.stopped_by,
                "harness": {"processes": max(1, len(self.cpu_s)), "cpu_s": sum(self.cpu_s), "loop_busy": busiest},
                **summarize(self.records, self.scenario.slo, self.duration_s)}


def arrival_gaps(scenario: Scenario, part: Part = WHOLE) -> Iterator[float]:
    """Seconds to wait before each new session of an open-loop run (the first comes at once).

    Each part of a Poisson run draws its gaps at its share of the rate from its own seed: N
    independent Poisson processes at rate r/N add up to one at rate r. Only part 0 starts at once,
    so the merged arrivals do not open with a burst of N."""
    a = scenario.arrival
    rng = random.Random(f"{scenario.seed}-arrivals" + (f"-{part.index}/{part.count}" if part.count > 1 else ""))
    if a.kind == "poisson":
        first = [0.0] if part.index == 0 else []
        return itertools.chain(first, (rng.expovariate(a.rate) for _ in itertools.count()))
    if a.kind == "burst":
        return ((a.interval_s if i and i % a.size == 0 else 0.0) for i in itertools.count())
    raise ValueError(f"arrival kind {a.kind!r} is not an open loop")


@dataclass(frozen=True)
class Counts:
    """What a progress line shows; ``ok`` and ``failed`` count finished requests only."""

    sent: int = 0
    ok: int = 0
    failed: int = 0
    in_flight: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.sent + other.sent, self.ok + other.ok, self.failed + other.failed,
                      self.in_flight + other.in_flight)


class Reporter(Protocol):
    """Told a run's counts every ``interval_s`` seconds, and once more at its end."""

    interval_s: float

    def update(self, counts: Counts, elapsed_s: float, final: bool = False) -> None: ...


class _Run:
    def __init__(self, scenario: Scenario, client: Client, part: Part):
        self.scenario, self.client, self.part = scenario, client, part
        self.sessions = itertools.islice(sessions(scenario), part.index, None, part.count)
        self.records: list[RequestRecord] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.in_flight = self.ok = self.failed = 0
        self.started_at, self.t0 = time.time(), time.perf_counter()
        self.deadline = self.t0 + scenario.max_duration_s

    def counts(self) -> Counts:
        return Counts(len(self.records), self.ok, self.failed, self.in_flight)

    def budget_left(self) -> bool:
        return len(self.records) < self.scenario.max_requests and time.perf_counter() < self.deadline

    def next_session(self) -> Session | None:
        return next(self.sessions, None) if self.budget_left() else None

    async def drive(self) -> None:
        if self.scenario.arrival.kind == "closed":
            for _ in range(self.scenario.arrival.concurrency or 1):
                self._spawn(self._closed_user())
        else:
            offset = 0.0
            for gap in arrival_gaps(self.scenario, self.part):
                # The next session is taken before waiting for its arrival: when the workload or
                # max_requests is done, the run ends now, not one arrival gap (a burst interval) later.
                if (session := self.next_session()) is None:
                    break
                offset += gap
                await asyncio.sleep(max(0.0, self.t0 + offset - time.perf_counter()))
                if time.perf_counter() >= self.deadline:
                    break
                self._spawn(self._session(session))
                await asyncio.sleep(0)  # it records its request now, so the next budget check counts it
        while self.tasks:
            await asyncio.wait(set(self.tasks))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _closed_user(self) -> None:
        while (session := self.next_session()) is not None:
            await self._session(session)

    async def _session(self, session: Session) -> None:
        for turn in range(session.turns):
            if turn and session.think_time_s:
                await asyncio.sleep(session.think_time_s)
            if not self.budget_left():
                return
            answer = await self._send(session, turn)
            if answer is None:
                return  # a failed turn ends its conversation: the next one would need its answer
            session.answered(turn, answer)

    async def _send(self, session: Session, turn: int) -> str | None:
        req = session.request(turn)
        rec = RequestRecord(index=len(self.records), session=session.id, turn=turn, tag=req.tag,
                            start_s=time.perf_counter() - self.t0)
        self.records.append(rec)
        self.in_flight += 1
        answer = None
        try:
            async with asyncio.timeout(self.scenario.timeout_s):
                answer = await self.client.send(req, rec)
        except TimeoutError:
            rec.status, rec.error = "timeout", f"no answer within {self.scenario.timeout_s} s"
        except asyncio.CancelledError:
            rec.status, rec.error = CUT_OFF, "still running at the run's time bound"
            raise
        except Exception as err:  # a client bug must not stop the run; it shows up in the errors
            rec.status, rec.error = "client_error", f"{type(err).__name__}: {err}"
        finally:
            self.in_flight -= 1
            self.ok += rec.ok and rec.e2e_s is not None
            self.failed += rec.status not in (OK, CUT_OFF)
        if rec.status != OK or answer is None:
            return None
        if session.task is not None:
            rec.correct = score(session.task, answer)
        return answer

    async def cancel_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def run(scenario: Scenario, target: Target, *, api_key: str | None = None,
              progress: Reporter | None = None, part: Part = WHOLE) -> RunResult:
    """Run ``scenario`` (or its ``part``) against ``target`` until one of its bounds; returns
    every request's record."""
    client = make_client(target, scenario, api_key)
    cpu0, loop_cpu0 = time.process_time(), time.thread_time()
    state = _Run(scenario, client, part)
    driver = asyncio.create_task(state.drive())
    ticker = asyncio.create_task(_tick(progress, state)) if progress else None
    stopped_by = "workload"
    try:
        done, _ = await asyncio.wait({driver}, timeout=max(0.0, state.deadline - time.perf_counter()))
        if done:
            driver.result()
            if len(state.records) >= scenario.max_requests:
                stopped_by = "max_requests"
        else:
            stopped_by = "max_duration_s"
            driver.cancel()
            await state.cancel_all()
            await asyncio.gather(driver, return_exceptions=True)
    finally:
        duration = time.perf_counter() - state.t0
        if ticker:
            ticker.cancel()
        await client.aclose()
    if progress:
        progress.update(state.counts(), duration, final=True)
    return RunResult(target, scenario, state.records, duration, stopped_by, state.started_at,
                     [time.process_time() - cpu0], [time.thread_time() - loop_cpu0])


async def _tick(progress: Reporter, state: _Run) -> None:
    while True:
        await asyncio.sleep(progress.interval_s)
        progress.update(state.counts(), time.perf_counter() - state.t0)


class ProgressLine:
    """One status line on stderr, redrawn in place on a terminal, else printed every few seconds."""

    def __init__(self, out: TextIO, name: str, scenario: Scenario):
        self.out, self.name, self.scenario = out, name, scenario
        self.tty = out.isatty()
        self.interval_s = 0.2 if self.tty else 5.0

    def update(self, counts: Counts, elapsed_s: float, final: bool = False) -> None:
        c, s = counts, self.scenario
        elapsed = min(elapsed_s, s.max_duration_s)
        done = max(c.sent / s.max_requests, elapsed / s.max_duration_s)
        filled = int(20 * (1.0 if final else min(1.0, done)))
        line = (f"[{self.name}] |{'#' * filled}{'.' * (20 - filled)}| {c.sent}/{s.max_requests} sent, "
                f"{c.ok} ok, {c.failed} failed, {c.in_flight} in flight, {elapsed:.1f}/{s.max_duration_s:g} s")
        end = "\n" if final or not self.tty else ""
        self.out.write(("\r\x1b[K" if self.tty else "") + line + end)
        self.out.flush()
