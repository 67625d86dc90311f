"""``--http-workers N`` (router/http_workers.py): N processes on the router's HTTP port over a real
redis-server, with a fake worker registered there. Which process serves a connection is read from
the kernel (psutil: the process holding the server side of the socket), not from anything the
router says: many streams at once come back whole from more than one process; a child killed with
SIGKILL is replaced while the port keeps answering; children go when their parent goes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from deploy.local import REPO
from kvcascade.launch import RouterOptions, Running, start_router
from router.event_loop import run
from contracts.state import WorkerInfo
from contracts.stores import connect_state

from .conftest import free_port
from .fake_worker import FakeWorker, token_text
from .loop_thread import LoopThread

MODEL = "fake"
TOKENS = 8
ANSWER = "".join(token_text(i) for i in range(TOKENS))


@pytest.fixture
def worker(redis_url) -> Iterator[FakeWorker]:
    """A fake worker, registered in the test's Redis as a real one would be."""
    fake = FakeWorker()
    info = WorkerInfo(worker_id="fake-1", epoch="e1", address=fake.address, model=MODEL,
                      model_source="smollm2-135m", capacity=256)

    async def register() -> None:
        registry, _ = connect_state(redis_url)
        await registry.register(info, ttl_s=3600)
        await registry.aclose()

    run(register())
    yield fake
    fake.close()


def serving(root: int, port: int, status: str) -> dict[int, int]:
    """pid -> how many TCP sockets on ``port`` in ``status`` it holds, over ``root`` and its descendants."""
    counts = {}
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return counts
    for proc in procs:
        try:
            n = sum(c.status == status and c.laddr.port == port for c in proc.net_connections("tcp"))
        except psutil.NoSuchProcess:  # exited meanwhile
            continue
        if n:
            counts[proc.pid] = n
    return counts


def complete(base_url: str) -> str:
    """One streamed completion on a connection of its own; the text it carried."""
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": TOKENS, "stream": True}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return "".join(_texts(r.iter_lines()))


def _texts(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: {"):
            yield json.loads(line.removeprefix("data: "))["choices"][0]["text"]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(condition, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {within_s}s"
        time.sleep(0.05)


class RouterProcess:
    """``kvcascade router`` as a user runs it, in a child process; ready once it logs so."""

    def __init__(self, redis_url: str, *args: str):
        self.http_port = free_port()
        self.log = Path(tempfile.gettempdir()) / f"kvcascade-router-{self.http_port}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvcascade", "router", "--port", "0", "--http-port", str(self.http_port),
                 "--redis-url", redis_url, *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout: float = 60) -> RouterProcess:
        wait_for(lambda: self.proc.poll() is not None or "kvcascade router ready" in self.log.read_text(),
                 timeout, "router ready")
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        return self

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def test_streams_spread_over_the_processes_and_children_go_with_their_parent(redis_url, worker):
    router = RouterProcess(redis_url, "--http-workers", "3").wait_ready()
    try:
        assert len(serving(router.proc.pid, router.http_port, psutil.CONN_LISTEN)) == 3
        # 48 streams held open after their first token, so every connection is still up when counted.
        n = 48
        worker.servicer.gate.clear()
        all_started = threading.Barrier(n + 1, timeout=60)

        def stream(i: int) -> str:
            body = {"model": MODEL, "prompt": [1, 2, 3, i], "max_tokens": TOKENS, "stream": True}
            try:
                with httpx.Client(timeout=60) as client, client.stream("POST", f"{router.url}/v1/completions",
                                                                       json=body) as r:
                    assert r.status_code == 200, r.read()
                    lines = r.iter_lines()
                    first = next(_texts(lines))
                    all_started.wait()
                    return first + "".join(_texts(lines))
            except BaseException:
                all_started.abort()  # the others and the test stop waiting for this one
                raise

        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(stream, i) for i in range(n)]
            all_started.wait()
            open_streams = serving(router.proc.pid, router.http_port, psutil.CONN_ESTABLISHED)
            worker.servicer.gate.set()
            texts = [f.result(timeout=60) for f in futures]
        assert texts == [ANSWER] * n
        assert sum(open_streams.values()) == n, open_streams
        assert len(open_streams) > 1, f"every stream was served by one process: {open_streams}"

        # A router that dies without stopping them takes its HTTP processes with it.
        children = psutil.Process(router.proc.pid).children(recursive=True)
        router.proc.send_signal(signal.SIGKILL)
        router.proc.wait()
        wait_for(lambda: not any(_alive(c) for c in children), 15, "the children exit after their parent")
    finally:
        worker.servicer.gate.set()
        router.close()


def test_a_killed_process_is_replaced_while_the_port_keeps_answering(redis_url, worker, caplog):
    """In this process, with --http-port 0: the children join the port this process bound."""
    caplog.set_level(logging.INFO, "kvcascade")
    loop, running = LoopThread(), Running()
    try:
        loop.run(start_router(RouterOptions(port=0, http_port=0, redis_url=redis_url, http_workers=3), running))
        port = next(r.args[2] for r in caplog.records if r.msg.startswith("router HTTP"))  # (scheme, host, port, ...)
        url = f"http://127.0.0.1:{port}"
        before = serving(os.getpid(), port, psutil.CONN_LISTEN)
        assert len(before) == 3 and os.getpid() in before, before
        victim = min(pid for pid in before if pid != os.getpid())
        os.kill(victim, signal.SIGKILL)
        answered = 0
        deadline = time.monotonic() + 30
        while len(now := serving(os.getpid(), port, psutil.CONN_LISTEN)) < 3 or victim in now:
            assert time.monotonic() < deadline, f"no process took pid {victim}'s place: {now}"
            assert complete(url) == ANSWER
            answered += 1
        assert answered > 0
        assert any("exited with code -9; starting another" in r.getMessage() for r in caplog.records)
        for _ in range(6):  # three processes on the port again
            assert complete(url) == ANSWER
    finally:
        loop.run(running.stop())
        loop.close()
    children = [pid for pid in now if pid != os.getpid()]
    assert not any(psutil.pid_exists(pid) for pid in children), "stop left HTTP processes behind"
