"""Free TCP ports for servers that something else must be told about before they start.

A port a process picks with ``bind(0)`` and then releases comes from the kernel's ephemeral range:
the same range the kernel draws from for every later ``bind(0)`` (a gRPC server on port 0, an
embedded worker) and for outgoing connections. Handed to a server that binds a moment later, it can
already be someone else's, and with SO_REUSEPORT on both sides (gRPC's default, and the HTTP
processes of ``--http-workers``) the second bind succeeds and the kernel splits connections between
an HTTP server and a gRPC one. So ``free_port`` picks from below that range, where only explicit
binds land.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

# Ray's own defaults sit below 20000 (6379, 8265, 10001, worker ports 10002-19999).
_LOWEST = 20000
_lock = threading.Lock()
_handed_out: set[int] = set()


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's ephemeral range, (32768, 60999) where it does not say (Linux's default)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", *, tries: int = 64) -> int:
    """A port nothing listens on now, from outside the ephemeral range, never the same one twice in a
    process; a kernel-picked one only where that range leaves no room below it."""
    low, _ = ephemeral_range()
    with _lock:
        if low - _LOWEST >= 1024:
            for port in random.sample(range(_LOWEST, low), tries):
                if port in _handed_out:
                    continue
                with socket.socket() as s:
                    try:
                        s.bind((host, port))
                    except OSError:
                        continue
                _handed_out.add(port)
                return port
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port
