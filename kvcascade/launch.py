"""What each ``kvcascade`` server command runs, as plain async functions (the CLI parses flags;
tests and the Ray actor can call these with the same arguments).

    serve   = worker(s) + router in one process, in-memory state unless --redis-url is given
              (or a redis-server of its own, for Ray workers or --http-workers N > 1); with
              --replicas N, N engines per model, each on GPUs of its own (replica_placements)
    worker  = one engine behind gRPC; with --redis-url it registers and publishes its cache events
    router  = the gRPC and HTTP fronts over the workers found in Redis; with --http-workers N,
              N-1 more processes serve HTTP on the same port (router/http_workers.py)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from collections.abc import Collection
from dataclasses import dataclass, field

from contracts.tls import TlsFiles
from router.access import Access
from worker.engine.config import EngineConfig

log = logging.getLogger("kvcascade")


class StartupError(RuntimeError):
    """A part of the deployment could not start; the message says which and why (the CLI prints it
    as one line and exits 1, the part's own log has the traceback)."""


@dataclass
class WorkerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    redis_url: str | None = None
    worker_id: str | None = None  # default: hostname-port
    advertise_address: str | None = None  # what routers dial; default host:port
    heartbeat_ttl_s: float = 5.0
    key_prefix: str = "kvc:"
    # Exit the process when the engine loop or a tensor-parallel rank dies, so its supervisor
    # (Kubernetes, Ray) restarts it whole; always on with tensor parallelism.
    exit_on_failure: bool = False  # the CLI's worker and serve set it: a worker with no engine must go
    advertise_host: str | None = None  # routers dial advertise_host:<the port bound> (port 0 included)
    grace_s: float = 5.0  # seconds requests under way get to finish when the worker stops


@dataclass
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int | None = 8000
    redis_url: str | None = None
    policy: str = "prefix_aware"
    access: Access = field(default_factory=Access)  # API keys, per-client limits, /metrics behind a key
    tls: TlsFiles | None = None  # both fronts over TLS (--tls-cert, --tls-key)
    max_body_bytes: int = 16 * 2**20  # the HTTP API's largest request body (--max-body-mb)
    key_prefix: str = "kvc:"
    cascade: str | None = None  # a cascade file (router/cascade_config.py), re-read when it changes
    tokenizer: str | None = None  # one tokenizer for every model, instead of each worker's (--tokenizer)
    # Processes serving HTTP on http_port (router/http_workers.py): this one and http_workers - 1
    # children; more than one needs redis_url, where they all find the workers and the index.
    http_workers: int = 1

    def __post_init__(self) -> None:
        from contracts.grpc_server import INTERNAL_MESSAGE_BYTES

        if not 0 < self.max_body_bytes <= INTERNAL_MESSAGE_BYTES:  # what the router may pass on to a worker
            raise ValueError(f"--max-body-mb must be in (0, {INTERNAL_MESSAGE_BYTES / 2**20:g}], got "
                             f"{self.max_body_bytes / 2**20:g}")
        if self.http_workers < 1:
            raise ValueError(f"http_workers must be >= 1, got {self.http_workers}")
        if self.http_workers > 1 and self.http_port is None:
            raise ValueError("http_workers > 1 needs an http_port: the other processes serve HTTP only")


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES's entries where it is set, else the
    indices nvidia-smi lists; [] where neither says (no GPU, or no driver tools). No torch import:
    the process that runs serve's router stays torch-free."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def replica_placements(groups: int, config: EngineConfig, gpus: list[str] | None = None,
                       cpus: int | None = None) -> list[dict[str, str]]:
    """Where each of ``groups`` engines (serve's replicas, of every model it serves) runs, as the
    environment its engine core and ranks start with:
    - CUDA: ``tensor_parallel_size`` GPUs of its own, in order (group i gets GPUs i*T .. i*T+T-1 of
      ``gpus``), as CUDA_VISIBLE_DEVICES, so each engine sees its GPUs as cuda:0..T-1;
    - CPU: an equal share of the cores (OMP_NUM_THREADS; never more than an OMP_NUM_THREADS already
      set), so the engines do not oversubscribe them.
    Raises ValueError naming the flags when the GPUs do not suffice."""
    tp = config.tensor_parallel_size
    if config.device.startswith("cuda"):
        if config.device != "cuda":
            raise ValueError(f"--replicas places each replica on GPUs of its own: use --device cuda, not "
                             f"{config.device}")
        gpus = visible_gpus() if gpus is None else gpus
        if len(gpus) < groups * tp:
            raise ValueError(f"--replicas with --tp {tp} needs {groups * tp} GPUs ({groups} engines x {tp}); "
                             f"{len(gpus)} visible")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp:(i + 1) * tp])} for i in range(groups)]
    cpus = cpus or len(os.sched_getaffinity(0))
    share = max(1, cpus // (groups * tp))
    if (preset := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(preset) > 0:
        share = min(share, int(preset))
    return [{"OMP_NUM_THREADS": str(share)} for _ in range(groups)]


class Running:
    """Things started, stopped in reverse order."""

    def __init__(self) -> None:
        self._stops: list = []

    def on_stop(self, fn) -> None:
        self._stops.append(fn)

    async def stop(self) -> None:
        for fn in reversed(self._stops):
            try:
                result = fn()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("error while stopping")


async def start_worker(config: EngineConfig, opts: WorkerOptions, running: Running, *, registry=None,
                       index=None, engine=None, ranks=None, env: dict[str, str] | None = None):
    """Start one worker: engine, gRPC server and, with shared state, its publisher. Returns the server.

    The engine runs in an engine core process of its own (worker/core/process.py), so its step loop
    never shares an interpreter with the servers; an ``engine`` passed in (tests, library use) is
    driven in this process instead. With ``config.tensor_parallel_size`` > 1 the core is rank 0 and
    ``ranks`` starts the others (worker/distributed/ranks.LocalRanks, child processes, by default;
    the Ray worker passes its own). ``env``: variables the engine core and its ranks start with on
    top of this process's (a replica's placement: ``replica_placements``)."""
    from worker.engine.async_engine import AsyncEngine
    from worker.core.client import EngineCoreClient
    from worker.server import WorkerServer

    if engine is not None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
    else:
        init_method = None
        if config.tensor_parallel_size > 1:
            if ranks is None:
                from worker.distributed.ranks import LocalRanks

                ranks = LocalRanks(config, env)
            config = await asyncio.to_thread(ranks.spawn)
            init_method = ranks.init_method
            running.on_stop(ranks.stop)  # last: after the core has released them
        async_engine = EngineCoreClient(config, init_method=init_method, env=env)
        watch = ranks.dead_rank if ranks is not None else (lambda: None)
        try:
            await asyncio.to_thread(async_engine.start, None, watch)
        except RuntimeError as err:
            raise StartupError(str(err)) from err
    running.on_stop(async_engine.shutdown)
    if opts.exit_on_failure or ranks is not None:
        watchdog = Watchdog(async_engine, ranks)
        watchdog.start()
        running.on_stop(watchdog.stop)  # first: a clean shutdown is not a failure
    server = WorkerServer(async_engine, opts.host, opts.port)
    await server.start()
    running.on_stop(lambda: server.stop(opts.grace_s))
    if registry is None and opts.redis_url:
        from contracts.stores import connect_state

        registry, index = connect_state(opts.redis_url, opts.key_prefix)
        running.on_stop(registry.aclose)
    if registry is not None:
        from worker.registration import WorkerPublisher

        address = opts.advertise_address or (f"{opts.advertise_host}:{server.port}" if opts.advertise_host
                                             else server.address)
        publisher = WorkerPublisher(async_engine, registry, index,
                                    worker_id=opts.worker_id or f"{socket.gethostname()}-{server.port}",
                                    address=address, model_source=config.model, ttl_s=opts.heartbeat_ttl_s)
        await publisher.start()
        running.on_stop(publisher.stop)  # runs before the server stops: routers stop sending first
    log.info("worker ready: model %s on %s", async_engine.model_id, server.address)
    return server


class Watchdog:
    """Exits the process when the engine loop dies or a tensor-parallel rank exits: a worker that
    cannot step must go away at once, so routers stop sending to it and its supervisor restarts it."""

    def __init__(self, engine, ranks=None, poll_s: float = 0.5):
        self.engine, self.ranks, self.poll_s = engine, ranks, poll_s
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="worker-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            reason = self.ranks.dead_rank() if self.ranks is not None else None
            if reason is None and not self.engine.is_healthy():
                reason = "the engine loop died"
            if reason is not None and not self._stop.is_set():
                log.critical("worker cannot serve: %s; exiting so that it is restarted", reason)
                logging.shutdown()
                os._exit(70)


async def start_router(opts: RouterOptions, running: Running, *, registry=None, index=None, grace_s: float = 5.0,
                       local_workers: Collection = ()):
    """Start the router's gRPC (and HTTP) fronts. Returns the Router. ``local_workers``: WorkerServers
    of this process (serve's embedded workers), which the router calls directly, not over loopback."""
    from router.grpc_api import RouterServer
    from router.limits import ClientLimiter
    from router.router import Router, RouterConfig
    from contracts.stores import connect_state

    if opts.http_workers > 1 and opts.redis_url is None:
        raise StartupError(f"--http-workers {opts.http_workers} needs --redis-url: every HTTP process finds the "
                           "workers and the prefix index there")
    if registry is None:
        registry, index = connect_state(opts.redis_url, opts.key_prefix)
        running.on_stop(registry.aclose)
    cascade = None
    if opts.cascade:
        from router.cascade_config import CascadeFile

        cascade = CascadeFile(opts.cascade)  # a bad file fails the start, naming key and line
        watcher = asyncio.create_task(cascade.watch(), name="cascade-watcher")
        running.on_stop(watcher.cancel)
        log.info("cascade from %s: tiers %s, mode %s", opts.cascade,
                 [f"{t.name}={t.model}" for t in cascade.config.tiers], cascade.config.mode)
    router = Router(registry, index, RouterConfig(policy=opts.policy, tokenizer=opts.tokenizer), cascade=cascade)
    if local_workers:
        from worker.server import InProcessStub

        for server in local_workers:
            router.clients.add_local(server.address, InProcessStub(server.servicer))
            log.info("router calls worker %s in-process (no loopback gRPC)", server.address)
    await router.load_tokenizers()  # before the fronts open: no first request waits for one
    running.on_stop(router.close)
    sweeper = asyncio.create_task(router.run_sweeper(), name="index-sweeper")
    running.on_stop(sweeper.cancel)
    limiter = ClientLimiter(opts.access.limits)  # one per process: a client counts once on both fronts
    server = RouterServer(router, opts.host, opts.port, access=opts.access, limiter=limiter, tls=opts.tls,
                          max_message_bytes=opts.max_body_bytes)
    await server.start()
    running.on_stop(lambda: server.stop(grace_s))
    log.info("router gRPC%s on %s (policy %s)", " (TLS)" if opts.tls else "", server.address, router.policy.name)
    if opts.http_port is not None:
        from router.http_api import create_app, http_port, serve_http, stop_http

        app = create_app(router, access=opts.access, limiter=limiter, max_body_bytes=opts.max_body_bytes)
        http_server, task = await serve_http(app, opts.host, opts.http_port,
                                             reuse_port=opts.http_workers > 1, tls=opts.tls)
        running.on_stop(lambda: stop_http(http_server, task))
        port = http_port(http_server)  # with --http-port 0, the children join the port bound here
        if opts.http_workers > 1:
            await _start_http_workers(opts, port, running)
        log.info("router HTTP (OpenAI-style) on %s://%s:%d/v1%s", "https" if opts.tls else "http", opts.host, port,
                 f" in {opts.http_workers} processes" if opts.http_workers > 1 else "")
    return router


async def _start_http_workers(opts: RouterOptions, port: int, running: Running) -> None:
    """The other ``opts.http_workers - 1`` processes on the HTTP port, logging as this one does."""
    from router.http_workers import HttpFrontOptions, HttpWorkers

    root = logging.getLogger()
    # basicConfig's (the CLI's); one of another type (a test runner's) may not cross to a child.
    formatter = next((h.formatter for h in root.handlers if type(h.formatter) is logging.Formatter), None)
    workers = HttpWorkers(HttpFrontOptions(
        host=opts.host, port=port, redis_url=opts.redis_url, key_prefix=opts.key_prefix, policy=opts.policy,
        access=opts.access, tls=opts.tls, cascade=opts.cascade, tokenizer=opts.tokenizer,
        max_body_bytes=opts.max_body_bytes,
        log_level=root.getEffectiveLevel(), log_formatter=formatter), opts.http_workers - 1)
    try:
        await workers.start()
    except RuntimeError as err:
        raise StartupError(f"--http-workers: {err}") from err
    running.on_stop(workers.stop)


async def wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def api_keys_from_env() -> list[str]:
    """KVCASCADE_API_KEYS: comma-separated keys (from a Secret in Kubernetes), added to --api-key."""
    return [k.strip() for k in os.environ.get("KVCASCADE_API_KEYS", "").split(",") if k.strip()]
