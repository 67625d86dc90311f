"""Which registry and index a deployment uses: the one place that picks an implementation, so the
interfaces (contracts/state.py) never import what implements them."""

from __future__ import annotations

from contracts.state import PrefixIndex, Registry


def connect_state(url: str | None, key_prefix: str = "kvc:") -> tuple[Registry, PrefixIndex]:
    """The registry and index for a deployment: in memory (one process) when ``url`` is None,
    else Redis at ``url`` (``redis://``, ``rediss://`` for TLS, ``redis://:password@host``...;
    see contracts/redis_state.py), under ``key_prefix`` so deployments can share one Redis.
    Connects lazily: a Redis that is down shows as ``StateUnavailable`` on first use."""
    if url is None:
        from contracts.memory_state import MemoryPrefixIndex, MemoryRegistry

        return MemoryRegistry(), MemoryPrefixIndex()
    from contracts.redis_state import RedisPrefixIndex, RedisRegistry, redis_client

    client = redis_client(url)
    return RedisRegistry(client, key_prefix), RedisPrefixIndex(client, key_prefix)
