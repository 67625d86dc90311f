"""An event loop on a background thread, so synchronous tests can drive async servers. It is the
loop the router runs on (uvloop where installed, router/event_loop.py)."""

from __future__ import annotations

import asyncio
import threading

from router.event_loop import new_event_loop


class LoopThread:
    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="test-loop")
        self._thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
