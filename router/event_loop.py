"""The event loop the router's fronts run on: uvloop where it is installed, asyncio's own elsewhere.

The gRPC and HTTP fronts share the loop of the process that starts them (``serve_http`` runs
uvicorn's ``Server.serve`` in it, so uvicorn's own ``loop=`` setting never applies); that loop is
made where the process starts, with ``run`` (or ``new_event_loop``) instead of ``asyncio.run``.
uvloop's sockets and callbacks cost less per SSE event and per gRPC message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # not installed (it has no Windows build): asyncio's loop serves as well
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    return loop_factory()()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the fastest loop available."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
