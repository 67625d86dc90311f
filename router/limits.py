"""Per-client limits on the router's fronts: a sustained request rate (a token bucket with a burst)
and a cap on requests under way, so one client cannot take the fleet from the others.

A client is its API key when the server has keys (the same key over HTTP and gRPC is one client),
else its address. A refused request gets how long to wait (HTTP 429 with ``retry-after``, gRPC
RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata) and costs nothing: it never reaches a
worker. Limits hold per router process (``--http-workers N`` gives each of the N its own), like
the in-flight counts the routing policy reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one client may do; None: no limit of that kind."""

    rate: float | None = None  # requests per second, sustained
    burst: int | None = None  # requests taken at once above the rate; default: the rate, at least 1
    concurrency: int | None = None  # requests under way at once (a stream counts until it ends)

    def __post_init__(self) -> None:
        for name in ("rate", "burst", "concurrency"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.burst is not None and self.rate is None:
            raise ValueError("burst needs a rate")

    @property
    def active(self) -> bool:
        return self.rate is not None or self.concurrency is not None

    @property
    def bucket_size(self) -> float:
        return float(self.burst if self.burst is not None else max(1.0, self.rate or 1.0))


class Limited(Exception):
    """A request over its client's limit: ``reason`` ("rate" or "concurrency") and how many
    seconds until one would be taken."""

    def __init__(self, reason: str, message: str, retry_after_s: float):
        super().__init__(message)
        self.reason, self.message, self.retry_after_s = reason, message, retry_after_s

    @property
    def retry_after(self) -> str:
        """The ``retry-after`` value: whole seconds, at least 1 (what HTTP clients parse)."""
        return str(max(1, math.ceil(self.retry_after_s)))


def _nothing() -> None:
    pass


class _Client:
    __slots__ = ("tokens", "at", "running")

    def __init__(self, tokens: float, at: float):
        self.tokens, self.at, self.running = tokens, at, 0


class ClientLimiter:
    """The limits of every client this process has seen. Not thread-safe: one event loop uses it."""

    MAX_IDLE_CLIENTS = 10_000  # past it, clients with a full bucket and nothing running are forgotten

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self._clients: dict[str, _Client] = {}

    def admit(self, client: str) -> Callable[[], None]:
        """Take one request of ``client``, or raise Limited. Returns what to call when the request
        ends (its answer sent, failed or cancelled); calling it again does nothing."""
        if not self.limits.active:
            return _nothing
        state = self._take(client)
        state.running += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                state.running -= 1

        return release

    def _take(self, client: str) -> _Client:
        limits, now = self.limits, self.clock()
        state = self._clients.get(client)
        if state is None:
            if len(self._clients) >= self.MAX_IDLE_CLIENTS:
                self._forget_idle(now)
            state = self._clients[client] = _Client(limits.bucket_size, now)
        if limits.concurrency is not None and state.running >= limits.concurrency:
            raise Limited("concurrency", f"too many requests under way: {state.running} of this client's at most "
                                         f"{limits.concurrency} (--max-concurrent-per-client); retry when one ends",
                          1.0)
        if limits.rate is not None:
            state.tokens = min(limits.bucket_size, state.tokens + (now - state.at) * limits.rate)
            state.at = now
            if state.tokens < 1.0:
                raise Limited("rate", f"rate limit reached: {limits.rate:g} requests/s with bursts of "
                                      f"{limits.bucket_size:g} (--rate-limit, --rate-burst)",
                              (1.0 - state.tokens) / limits.rate)
            state.tokens -= 1.0
        return state

    def _forget_idle(self, now: float) -> None:
        size, rate = self.limits.bucket_size, self.limits.rate or 0.0
        self._clients = {k: s for k, s in self._clients.items()
                         if s.running or s.tokens + (now - s.at) * rate < size}

    def __len__(self) -> int:
        return len(self._clients)
