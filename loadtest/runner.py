"""Running a scenario against one target: arrivals, the request and time bounds, progress.

Every run stops by itself, at the first of: the workload runs out, ``max_requests`` requests have
been sent, or ``max_duration_s`` has passed. At the time bound, requests still running are
cancelled (gRPC cancels the call, HTTP closes the stream, so the server frees their KV blocks)
and recorded as cut off. One request also stops at ``request_timeout_s`` (status ``timeout``).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from loadtest.clients import Client, Target, make_client
from loadtest.metrics import CUT_OFF, OK, RequestRecord, summarize
from loadtest.scenario import Scenario
from loadtest.workload import Session, sessions


@dataclass
class RunResult:
    target: Target
    scenario: Scenario
    records: list[RequestRecord]
    duration_s: float
    stopped_by: str  # workload | max_requests | max_duration_s

    def summary(self) -> dict[str, Any]:
        return {"target": str(self.target), "stopped_by": self.stopped_by,
                **summarize(self.records, self.scenario.slo, self.duration_s)}


def arrival_gaps(scenario: Scenario) -> Iterator[float]:
    """Seconds to wait before each new session of an open-loop run (the first comes at once)."""
    a, rng = scenario.arrival, random.Random(f"{scenario.seed}-arrivals")
    if a.kind == "poisson":
        return itertools.chain([0.0], (rng.expovariate(a.rate) for _ in itertools.count()))
    if a.kind == "burst":
        return ((a.interval_s if i and i % a.size == 0 else 0.0) for i in itertools.count())
    raise ValueError(f"arrival kind {a.kind!r} is not an open loop")


class _Run:
    def __init__(self, scenario: Scenario, client: Client):
        self.scenario, self.client = scenario, client
        self.sessions = sessions(scenario)
        self.records: list[RequestRecord] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.in_flight = 0
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + scenario.max_duration_s

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
            for gap in arrival_gaps(self.scenario):
                offset += gap
                await asyncio.sleep(max(0.0, self.t0 + offset - time.perf_counter()))
                if (session := self.next_session()) is None:
                    break
                self._spawn(self._session(session))
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
        return answer if rec.status == OK else None

    async def cancel_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def run(scenario: Scenario, target: Target, *, api_key: str | None = None,
              progress: TextIO | None = sys.stderr) -> RunResult:
    """Run ``scenario`` against ``target`` until one of its bounds; returns every request's record."""
    client = make_client(target, scenario, api_key)
    state = _Run(scenario, client)
    bar = _Progress(progress, target.name, scenario, state) if progress is not None else None
    driver = asyncio.create_task(state.drive())
    ticker = asyncio.create_task(bar.tick()) if bar else None
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
    if bar:
        bar.draw(final=True)
    return RunResult(target, scenario, state.records, duration, stopped_by)


class _Progress:
    """One status line on stderr, redrawn in place on a terminal, else printed every few seconds."""

    def __init__(self, out: TextIO, name: str, scenario: Scenario, state: _Run):
        self.out, self.name, self.scenario, self.state = out, name, scenario, state
        self.tty = out.isatty()

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(0.2 if self.tty else 5.0)
            self.draw()

    def draw(self, final: bool = False) -> None:
        s, records = self.state, self.state.records
        elapsed = min(time.perf_counter() - s.t0, self.scenario.max_duration_s)
        done = max(len(records) / self.scenario.max_requests, elapsed / self.scenario.max_duration_s)
        filled = int(20 * (1.0 if final else min(1.0, done)))
        ok = sum(r.ok and r.e2e_s is not None for r in records)  # in flight: ok so far, no e2e yet
        failed = sum(r.status not in (OK, CUT_OFF) for r in records)
        line = (f"[{self.name}] |{'#' * filled}{'.' * (20 - filled)}| {len(records)}/{self.scenario.max_requests} "
                f"sent, {ok} ok, {failed} failed, {s.in_flight} in flight, "
                f"{elapsed:.1f}/{self.scenario.max_duration_s:g} s")
        end = "\n" if final or not self.tty else ""
        self.out.write(("\r\x1b[K" if self.tty else "") + line + end)
        self.out.flush()
