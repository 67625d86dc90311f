"""Start the ranks of one tensor-parallel worker.

    rank 0 (the worker process): the engine, its scheduler and sampler, the gRPC server
    ranks 1..T-1: run_rank -> join the group -> load their shard -> follow rank 0's steps

``kvcascade worker --tp T`` starts ranks 1..T-1 as child processes on its node (LocalRanks); the
Ray worker (kvcascade/ray_worker.py) starts each as an actor in the worker's placement group. Both
run ``run_rank``, so the GPU machine without Ray runs the code the actors run. The ranks of a
worker share one node and meet on loopback.

A worker whose rank dies cannot step: rank 0 watches its ranks and the ranks watch rank 0, and
either side exits at once, so whoever supervises the worker (Kubernetes, Ray) restarts all of it.
A rank that hangs instead (a collective one side never joins) can be asked where it is:
``kill -USR1 PID`` prints every thread's Python stack to its stderr and lets it run on.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from contracts.ports import free_port
from worker.engine.config import EngineConfig

log = logging.getLogger(__name__)


def local_rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """On a node's GPUs, ``cuda`` means GPU ``rank`` (a Ray actor sees only its own GPU, as cuda:0,
    and keeps ``cuda``)."""
    return dataclasses.replace(config, device=f"cuda:{rank}") if config.device == "cuda" else config


def join_group(config: EngineConfig, rank: int, init_method: str) -> None:
    from worker.distributed.group import init_tp

    init_tp(rank, config.tensor_parallel_size, init_method, config.device)


def run_rank(config: EngineConfig, rank: int, init_method: str) -> bool:
    """The whole life of rank ``rank`` > 0: join, load, follow; returns when rank 0 closes, once
    every rank has left the group together (group.leave_tp: False when its teardown hung, and the
    process should end with ``os._exit``)."""
    from worker.distributed.group import leave_tp
    from worker.engine.llm_engine import follow

    join_group(config, rank, init_method)
    follow(config)
    return leave_tp()


def join_as_rank0(config: EngineConfig, init_method: str, dead_rank: Callable[[], str | None]) -> None:
    """Join as rank 0 from a thread, so that a rank which dies before joining (``dead_rank`` says
    why) fails the start at once rather than after the rendezvous timeout."""
    error: list[BaseException] = []

    def join() -> None:
        try:
            join_group(config, 0, init_method)
        except BaseException as exc:  # handed to the starting thread
            error.append(exc)

    joiner = threading.Thread(target=join, name="tp-join", daemon=True)
    joiner.start()
    while joiner.is_alive():
        joiner.join(0.2)
        if joiner.is_alive() and (reason := dead_rank()) is not None:
            raise RuntimeError(f"{reason} before joining the tensor-parallel group (its log says why)")
    if error:
        raise error[0]


def exit_when_parent_dies(parent_pid: int, poll_s: float = 0.5) -> None:
    """A rank whose worker process died (even by SIGKILL) must not linger holding a GPU."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class LocalRanks:
    """Ranks 1..T-1 as child processes of this one, which then joins as rank 0."""

    def __init__(self, config: EngineConfig, env: dict[str, str] | None = None):
        """``env``: variables the ranks get on top of this process's (a replica's GPUs or threads)."""
        self.config = config
        self.env = env or {}
        self.procs: list[subprocess.Popen] = []
        self.init_method = f"tcp://127.0.0.1:{free_port()}"

    def spawn(self) -> EngineConfig:
        """Start ranks 1..T-1, which wait at ``init_method`` for rank 0; the configuration rank 0 runs
        with (the worker's engine core process joins as rank 0)."""
        dump_stacks_on_sigusr1()
        for rank in range(1, self.config.tensor_parallel_size):
            payload = json.dumps(dataclasses.asdict(local_rank_config(self.config, rank)))
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "worker.distributed.ranks", "--rank", str(rank), "--init-method",
                 self.init_method, "--parent-pid", str(os.getpid()), "--config", payload],
                env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env)))
        return local_rank_config(self.config, 0)

    def start(self) -> EngineConfig:
        """Spawn the ranks and join the group as rank 0 in this process (returns once every rank has
        joined; benchmarks run rank 0's engine in-process this way)."""
        config = self.spawn()
        try:
            join_as_rank0(config, self.init_method, self.dead_rank)
        except BaseException:
            self.stop(timeout_s=0)
            raise
        return config

    def dead_rank(self) -> str | None:
        """Why the worker cannot go on, or None while every rank runs."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} exited with code {proc.returncode}"
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """After rank 0's engine closed (the ranks leave their loop): where this process is rank 0
        (benchmarks), leave the group together with them; then wait for them, and make sure."""
        from worker.distributed.group import leave_tp

        leave_tp(timeout_s)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 prints every thread's stack to stderr and the process goes on (see the module doc)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank > 0 of a kvcascade worker (internal)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    exit_when_parent_dies(args.parent_pid)
    # A Ctrl-C in the terminal (or `timeout`) signals the whole process group; a rank leaves only
    # when rank 0 releases it after draining, or dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dump_stacks_on_sigusr1()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        clean = run_rank(EngineConfig(**json.loads(args.config)), args.rank, args.init_method)
    except Exception:
        log.exception("rank %d failed", args.rank)
        clean, code = False, 1  # its group was never left: the interpreter's exit could wait on it
    else:
        code = 0
    if not clean:
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
