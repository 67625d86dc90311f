"""A fleet of real processes for the chaos tests: a redis-server, ``kvcascade worker`` processes and a
``kvcascade router``, each a child process on loopback ports, and what the tests check of them:
which crashed, how much memory they hold, whether every worker is idle with no KV block in use."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil

from deploy.local import REPO, LocalRedis, WorkerProcess, free_port
from protos import kvcascade_pb2 as pb

# SmolLM2's tokenizer over a 2-layer model of random weights: loads in seconds and decodes a batch of
# 32 in ~25 ms on one CPU core; greedy answers to different text prompts differ, so they can be checked.
MODEL = "dummy:smollm2-mini"


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> float | None:
    """Seconds until ``predicate()`` held, or None if it did not within ``timeout``."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            return None
        time.sleep(interval)


def rounds(soak_s: float, minimum: int = 1) -> Iterator[int]:
    """Round numbers: ``minimum`` of them, then more while the soak time (0: none) lasts."""
    deadline = time.monotonic() + soak_s
    i = 0
    while i < minimum or time.monotonic() < deadline:
        yield i
        i += 1


def rss_mb(proc: subprocess.Popen | None) -> float:
    """Resident memory of a process and its children (a worker's engine core runs in a child)."""
    if proc is None or proc.poll() is not None:
        return 0.0
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


class RouterProcess:
    """``kvcascade router`` in a child process; start() returns once /readyz answers 200."""

    def __init__(self, redis_url: str, *extra: str):
        self.redis_url = redis_url
        self.extra = extra
        self.port, self.http_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.gettempdir()) / f"kvcascade-chaos-router-{self.http_port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> RouterProcess:
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvcascade", "router", "--redis-url", self.redis_url, "--port", str(self.port),
                 "--http-port", str(self.http_port), *self.extra], cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT)
        ready = wait_for(self._ready, timeout, interval=0.2)
        if ready is None:
            raise TimeoutError(f"the router did not get ready in {timeout}s:\n{self.log_tail()}")
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the router exited ({self.proc.returncode}):\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else "(no log)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Fleet:
    """Redis, workers w1..wN (same flags) and a router over them."""

    def __init__(self, workdir: Path, workers: int = 2, worker_flags: tuple[str, ...] = ()):
        self.redis = LocalRedis(str(workdir))
        self.worker_flags = ("--model", MODEL, *worker_flags)
        self.workers = {f"w{i + 1}": None for i in range(workers)}
        self.router: RouterProcess | None = None

    def start(self) -> Fleet:
        self.redis.start()
        self.workers = {wid: WorkerProcess(wid, self.redis.url, *self.worker_flags) for wid in self.workers}
        with concurrent.futures.ThreadPoolExecutor(len(self.workers)) as pool:  # load them at once
            list(pool.map(lambda w: w.start(), self.workers.values()))
        self.router = RouterProcess(self.redis.url).start()
        return self

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        workers = [w for w in self.workers.values() if w is not None]
        with concurrent.futures.ThreadPoolExecutor(max(1, len(workers))) as pool:  # each takes seconds
            list(pool.map(lambda w: w.stop(), workers))
        self.redis.stop()

    # --- what the tests look at ------------------------------------------------------------------

    def processes(self) -> dict[str, subprocess.Popen | None]:
        return {"router": self.router.proc, **{wid: w.proc for wid, w in self.workers.items()}}

    def crashed(self) -> dict[str, str]:
        """Processes that exited, with the end of their logs."""
        out = {}
        if self.router.proc.poll() is not None:
            out["router"] = self.router.log_tail()
        for wid, w in self.workers.items():
            if w.proc.poll() is not None:
                out[wid] = Path(w.log.name).read_text(errors="replace")[-3000:]
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            out["redis"] = "redis-server is not running"
        return out

    def rss(self) -> dict[str, float]:
        """MiB per process (a worker with its engine core)."""
        return {name: round(rss_mb(proc), 1) for name, proc in self.processes().items()}

    def worker_stats(self) -> dict[str, pb.StatsResponse]:
        """Each worker's own Stats, straight from its address (not through the router)."""
        return {wid: w.stats() for wid, w in self.workers.items()}

    def idle(self) -> bool:
        return all(s.kv_blocks_used == 0 and s.running == 0 and s.waiting == 0 for s in self.worker_stats().values())

    def wait_idle(self, timeout: float = 10.0) -> float | None:
        """Seconds until no worker runs anything or holds a KV block; None if not within ``timeout``."""
        return wait_for(self.idle, timeout, interval=0.1)

    def usage(self) -> str:
        return ", ".join(f"{wid}: running {s.running} waiting {s.waiting} kv_blocks_used {s.kv_blocks_used}"
                         for wid, s in self.worker_stats().items())


def completion_request(prompt: str, max_tokens: int) -> pb.GenerateRequest:
    """A greedy text completion of exactly ``max_tokens`` tokens (ignore_eos)."""
    return pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                      ignore_eos=True))


def completion_body(prompt: str, max_tokens: int, **fields) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **fields}
