"""Who may use the router's fronts, and how much: the API keys both fronts accept, who a request
is for the per-client limits (router/limits.py), and whether /metrics needs a key too.

Health endpoints (/healthz, /readyz, gRPC health) are always open: Kubernetes probes send no keys.
/metrics is open by default (Prometheus in the cluster scrapes it); ``protect_metrics`` puts it
behind the API keys as well.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection
from dataclasses import dataclass, field

from router.limits import Limits


@dataclass(frozen=True)
class Access:
    """What the HTTP and gRPC fronts check before a request reaches the router."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never in a log line
    limits: Limits = field(default_factory=Limits)
    protect_metrics: bool = False  # /metrics needs an API key too (with keys configured)

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", tuple(k for k in self.api_keys if k))


class ApiKeys:
    """The configured keys (none: the API is open). Keys are never logged nor echoed: a refused key
    is "incorrect", and a client is named by the key's position, not by the key."""

    def __init__(self, keys: Collection[str] = ()):
        self._keys = [k.encode() for k in keys if k]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def match(self, given: str | None) -> int | None:
        """The position of ``given`` among the keys, or None. Every key is compared, in constant
        time, so how long this takes says nothing about which key nearly matched."""
        if not given:
            return None
        raw = given.encode()
        hits = [secrets.compare_digest(raw, k) for k in self._keys]
        return hits.index(True) if any(hits) else None

    def client(self, given: str | None, address: str) -> str:
        """Who a request counts against: its key when it has a valid one, else its address."""
        index = self.match(given) if self._keys else None
        return f"key#{index}" if index is not None else f"address {address}"
