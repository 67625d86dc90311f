"""More processes on the router's HTTP port (``--http-workers N``): one Python process saturates a
core relaying SSE streams, so N-1 child processes each run an HTTP front of their own (a Router over
the same Redis state, ``create_app``, ``serve_http``) beside the parent's, and every listening socket
is bound with SO_REUSEPORT, so the kernel spreads new connections over the N processes.

    parent: gRPC front, HTTP front, index sweeper       child: HTTP front only
    a child that dies is logged and replaced            a child whose parent dies stops itself

Children start with multiprocessing's "spawn" context, a fresh interpreter: a fork would copy the
parent's gRPC threads and event loop (gRPC aborts in a forked child), and spawn rather than a
``subprocess`` of a module because the options cross as one typed dataclass and readiness comes back
over a Pipe, with no second command line to keep in step with the CLI's.

Only Redis is shared. Each process has its own Prometheus registry (a scrape of /metrics sees one
process), worker clients, tokenizers, in-flight counts and round-robin turn.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from contracts.tls import TlsFiles
from router.access import Access

log = logging.getLogger(__name__)

_SPAWN = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class HttpFrontOptions:
    """What a child's HTTP front needs: the parent's router options (their defaults live there)."""

    host: str
    port: int  # the port the parent bound: children join it
    redis_url: str
    key_prefix: str
    policy: str
    access: Access
    tls: TlsFiles | None
    cascade: str | None
    tokenizer: str | None
    max_body_bytes: int
    log_level: int = logging.INFO
    log_formatter: logging.Formatter | None = None  # the parent's, so children log like it

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ValueError("HTTP front processes share the registry and index through Redis: give a redis_url")
        if self.port <= 0:
            raise ValueError(f"HTTP front processes join the parent's bound port, got {self.port}")


async def _readable(fd: int) -> None:
    """Wait until ``fd`` can be read: a message or EOF on a pipe, a process sentinel's exit."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class HttpWorkers:
    """``count`` child processes serving HTTP on ``opts.port`` beside the caller's own front, kept at
    ``count``: ``start`` returns once every one accepts connections, ``stop`` ends them."""

    def __init__(self, opts: HttpFrontOptions, count: int, *, start_timeout_s: float = 60.0,
                 stop_timeout_s: float = 10.0, restart_delay_s: float = 1.0):
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.opts, self.count = opts, count
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.restart_delay_s = restart_delay_s
        # Set as soon as a process starts, so ``stop`` also ends one still starting.
        self._procs: list[BaseProcess | None] = [None] * count
        self._keepers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start them all at once; if one fails, stop the others and raise RuntimeError saying why."""
        try:  # each ends up ready, or failed and ended by itself: none is left half-started
            results = await asyncio.gather(*(self._spawn(slot) for slot in range(self.count)),
                                           return_exceptions=True)
        except BaseException:  # cancelled
            await self.stop()
            raise
        if errors := [r for r in results if isinstance(r, BaseException)]:
            await self.stop()
            raise errors[0]
        self._keepers = [asyncio.create_task(self._keep(slot), name=f"http-worker-{slot}")
                         for slot in range(self.count)]

    async def _spawn(self, slot: int) -> None:
        ready_r, ready_w = _SPAWN.Pipe(duplex=False)
        proc = _SPAWN.Process(target=_child_main, args=(self.opts, slot, ready_w), name=f"kvcascade-http-{slot}",
                              daemon=True)  # daemon: multiprocessing's exit handler ends it too
        self._procs[slot] = proc
        with ready_r:
            try:
                proc.start()  # a fork-exec: milliseconds on the loop
            finally:
                ready_w.close()  # the child holds the only writer now: its exit reads as EOF here
            message = await self._ready_message(proc, ready_r)
        if message != "ready":
            self._procs[slot] = None  # ended here, not by ``stop``: one process is joined by one thread
            await asyncio.to_thread(_end, [proc], self.stop_timeout_s)
            raise RuntimeError(f"HTTP front process {slot} (pid {proc.pid}): {message}")
        log.info("HTTP front process %d (pid %d) on http://%s:%d", slot, proc.pid, self.opts.host, self.opts.port)

    async def _ready_message(self, proc: BaseProcess, ready: Connection) -> str:
        """"ready" once the child accepts connections, else why not."""
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that lands
            # as its inner await completes (CPython gh-86296), and stop() would wait on a start
            async with asyncio.timeout(self.start_timeout_s):
                await _readable(ready.fileno())
            return ready.recv()
        except TimeoutError:
            return f"not accepting connections after {self.start_timeout_s:.0f}s"
        except EOFError:
            await asyncio.to_thread(proc.join, 5)
            return f"exited with code {proc.exitcode} while starting"

    async def _keep(self, slot: int) -> None:
        """Replace the slot's process whenever it exits, until ``stop`` cancels this."""
        while True:
            proc = self._procs[slot]
            assert proc is not None
            await _readable(proc.sentinel)
            proc.join()  # it has exited: at once
            log.error("HTTP front process %d (pid %d) exited with code %s; starting another",
                      slot, proc.pid, proc.exitcode)
            while True:
                await asyncio.sleep(self.restart_delay_s)  # one that cannot start must not spin
                try:
                    await self._spawn(slot)
                    break
                except RuntimeError as err:
                    log.error("%s; trying again", err)

    async def stop(self) -> None:
        """SIGTERM (each drains its open requests), then SIGKILL what is left after ``stop_timeout_s``."""
        for task in self._keepers:
            task.cancel()
        await asyncio.gather(*self._keepers, return_exceptions=True)
        self._keepers = []
        procs = [p for p in self._procs if p is not None]
        self._procs = [None] * self.count
        await asyncio.to_thread(_end, procs, self.stop_timeout_s)


def _end(procs: list[BaseProcess], timeout_s: float) -> None:
    started = [p for p in procs if p.pid is not None]
    for proc in started:
        if proc.exitcode is None:
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in started:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            log.warning("HTTP front process (pid %d) did not stop in %.0fs; killing it", proc.pid, timeout_s)
            proc.kill()
            proc.join()


# --- in the child ---------------------------------------------------------------------------------


def _child_main(opts: HttpFrontOptions, slot: int, ready: Connection) -> None:
    """A child's life: logging like the parent's, the router's event loop, one HTTP front."""
    handler = logging.StreamHandler()  # stderr, inherited from the parent
    if opts.log_formatter is not None:
        handler.setFormatter(opts.log_formatter)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(opts.log_level)
    # A Ctrl-C reaches the terminal's whole process group: the parent decides when children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from contracts.tokenizers import hide_torch
    from router.event_loop import run

    hide_torch()  # an HTTP front only tokenizes: no torch for transformers to load
    run(_serve(opts, slot, ready))


async def _serve(opts: HttpFrontOptions, slot: int, ready: Connection) -> None:
    from router.http_api import create_app, serve_http, stop_http
    from router.router import Router, RouterConfig
    from contracts.stores import connect_state

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent = multiprocessing.parent_process()
    assert parent is not None, "run by HttpWorkers, in a child process"
    orphaned = False

    def parent_gone() -> None:  # its sentinel reads EOF: the parent exited, however it died
        nonlocal orphaned
        loop.remove_reader(parent.sentinel)
        orphaned = True
        stop.set()

    loop.add_reader(parent.sentinel, parent_gone)
    registry, index = connect_state(opts.redis_url, opts.key_prefix)
    watcher = None
    try:
        cascade = None
        if opts.cascade:
            from router.cascade_config import CascadeFile

            cascade = CascadeFile(opts.cascade)
            watcher = asyncio.create_task(cascade.watch(), name="cascade-watcher")
        router = Router(registry, index, RouterConfig(policy=opts.policy, tokenizer=opts.tokenizer), cascade=cascade)
        # Before it binds: the kernel sends no connection here while the tokenizers load.
        await router.load_tokenizers()
        app = create_app(router, access=opts.access, max_body_bytes=opts.max_body_bytes)
        server, task = await serve_http(app, opts.host, opts.port, reuse_port=True, tls=opts.tls)
    except Exception as err:
        ready.send(f"{type(err).__name__}: {err}")
        raise
    ready.send("ready")
    ready.close()
    await stop.wait()
    if orphaned:
        log.warning("HTTP front process %d: the router process is gone; stopping", slot)
    await stop_http(server, task)
    if watcher is not None:
        watcher.cancel()
    await router.close()
    await registry.aclose()
