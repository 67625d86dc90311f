"""Router test fixtures: a real redis-server on loopback, and async tests without a plugin.

redis-server must be installed (`apt-get install redis-server`; .ci/run does it): without it the
Redis tests fail, they do not skip, so a CI machine that lacks it cannot pass by testing less.
"""

from __future__ import annotations

import inspect
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from contracts.ports import free_port
from router.event_loop import run

REDIS_SERVER = shutil.which("redis-server")


class RedisServer:
    """One redis-server process on a fixed loopback port, without persistence; stop() and
    start() again keep the port, as a restarted Redis behind the same address would."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if REDIS_SERVER is None:
            pytest.fail("redis-server is not installed: `apt-get install -y redis-server` (CI's .ci/run does it)")
        log = self.workdir / "redis.log"
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        probe = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                if probe.ping():
                    break
            except redis.exceptions.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis-server on port {self.port} did not answer PING:\n"
                            + (log.read_text() if log.exists() else "(no log)"))
            time.sleep(0.02)
        probe.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def flushall(self) -> None:
        with redis.Redis(port=self.port) as r:
            r.flushall()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> RedisServer:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session's Redis, emptied for this test."""
    redis_server.flushall()
    return redis_server.url


@pytest.fixture
def restartable_redis(tmp_path) -> RedisServer:
    """A Redis of this test's own, which the test may stop() and start() (fault tests)."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run ``async def`` tests in a fresh event loop (the router's: uvloop where installed); afterwards,
    in that loop, await ``aclose()`` on each of the test's fixture values that has one (clients are
    bound to the loop)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in inspect.signature(pyfuncitem.obj).parameters}

    async def main():
        try:
            await pyfuncitem.obj(**kwargs)
        finally:
            for value in kwargs.values():
                if inspect.iscoroutinefunction(getattr(value, "aclose", None)):
                    await value.aclose()

    run(main())
    return True
