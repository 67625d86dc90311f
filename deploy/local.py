"""Local `kvcascade worker` processes on loopback: for tests, benchmarks and trying things out."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from contracts.ports import free_port
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]


class WorkerProcess:
    """``kvcascade worker`` in a child process; start() returns once its gRPC server answers."""

    def __init__(self, worker_id: str, redis_url: str | None, *extra: str, port: int | None = None):
        self.worker_id = worker_id
        self.redis_url = redis_url
        self.extra = extra
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> "WorkerProcess":
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.log = open(Path(tempfile.gettempdir()) / f"kvcascade-{self.worker_id}-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcascade", "worker", "--port", str(self.port), "--worker-id", self.worker_id,
             *(["--redis-url", self.redis_url] if self.redis_url else []), "--heartbeat-ttl", "2", *self.extra],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.worker_id} exited: {open(self.log.name).read()[-3000:]}")
            try:
                with grpc.insecure_channel(self.address) as ch:
                    pb_grpc.KVCascadeStub(ch).Stats(pb.StatsRequest(), timeout=1)
                return self
            except grpc.RpcError:
                time.sleep(0.5)
        raise TimeoutError(f"worker {self.worker_id} did not start in {timeout}s")

    def stats(self) -> pb.StatsResponse:
        with grpc.insecure_channel(self.address) as ch:
            return pb_grpc.KVCascadeStub(ch).Stats(pb.StatsRequest(), timeout=5)

    def kill(self) -> None:
        """SIGKILL: no clean deregistration, like a crashed node."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def redis_server_binary() -> str:
    """The path of redis-server, or FileNotFoundError saying how to get one (the CLI checks early)."""
    import shutil

    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install -y redis-server); "
                                "or pass --redis-url")
    return binary


class LocalRedis:
    """A redis-server child process on a free loopback port, no persistence: `kvcascade serve
    --workers N` and `--http-workers N` use one when no --redis-url is given, so Ray workers and
    HTTP processes share a registry and index."""

    def __init__(self, workdir: str | None = None):
        self.binary = redis_server_binary()
        self.port = free_port()
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvcascade-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "LocalRedis":
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True)  # a Ctrl-C to the terminal's group must not stop it before the drain
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server on port {self.port} did not answer in {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None
