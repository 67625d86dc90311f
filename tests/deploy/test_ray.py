"""`kvcascade serve --address RAY --workers 2 --tp 2`: a real local Ray cluster (`ray start --head`),
two Ray worker groups of two CPU ranks each (gloo) behind the router, a real redis-server.

The tests run in file order on one cluster: serve, kill a worker under load and watch it return,
then drain on shutdown.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from deploy.local import LocalRedis, free_port
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from contracts.redis_state import RedisRegistry, redis_client
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
           OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


class Cluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.ray_port = free_port()
        self.router_port = free_port()
        self.redis = LocalRedis(str(tmp)).start()
        self.serve: subprocess.Popen | None = None
        self.log = tmp / "serve.log"

    @property
    def ray_address(self) -> str:
        return f"127.0.0.1:{self.ray_port}"

    @property
    def router(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    def start(self) -> None:
        subprocess.run([RAY, "start", "--head", "--port", str(self.ray_port), "--num-cpus", "8",
                        "--temp-dir", str(self.tmp / "ray"), "--include-dashboard", "false",
                        "--disable-usage-stats"], env=ENV, check=True, capture_output=True, timeout=120)
        self.serve = subprocess.Popen(
            [sys.executable, "-m", "kvcascade", "serve", "--address", self.ray_address, "--workers", "2", "--tp", "2",
             "--quantization", "none", "--redis-url", self.redis.url, "--port", str(self.router_port),
             "--http-port", str(free_port()), "--grace-period", "20"],
            cwd=REPO, env=ENV, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            assert self.serve.poll() is None, self.log.read_text()[-4000:]
            if "kvcascade serve ready" in self.log.read_text():
                return
            time.sleep(1)
        raise TimeoutError(self.log.read_text()[-4000:])

    def workers(self) -> dict[str, object]:
        async def live():
            client = redis_client(self.redis.url)
            try:
                return await RedisRegistry(client).live_workers()
            finally:
                await client.aclose()

        return {w.worker_id: w for w in asyncio.run(live())}

    def stop(self) -> None:
        if self.serve is not None and self.serve.poll() is None:
            self.serve.kill()
        subprocess.run([RAY, "stop", "--force"], env=ENV, capture_output=True, timeout=120)
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster():
    tmp = Path(tempfile.mkdtemp(prefix="kvc-ray-", dir="/tmp"))  # Ray's socket paths must stay short
    c = Cluster(tmp)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_worker_that_cannot_start_ends_serve_with_its_error():
    """A worker failing in its actor's __init__ (here: a KV cache too small for one block) is not
    restarted over and over: `kvcascade serve` stops what it started and exits 1 with one line
    naming the worker and the cause. Runs first: its own local Ray, before the module's cluster."""
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kvcascade", "serve", "--workers", "1", "--kv-cache-memory", "1KiB",
         "--port", str(free_port()), "--http-port", str(free_port())],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - t
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last == ("kvcascade serve: error: worker ray-0 failed to start: "
                    "ValueError: kv_cache_bytes=1024 holds no KV block of this model"), proc.stderr[-3000:]
    assert "did not drain cleanly" not in proc.stderr
    assert elapsed < 180


def generate(target: str, ids: list[int], max_tokens: int, timeout: float = 300, on_first=None):
    """(token ids, final message) of one greedy request through the router; raises grpc.RpcError."""
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    req.token_ids.ids[:] = ids
    tokens, last = [], None
    with grpc.insecure_channel(target) as ch:
        for last in pb_grpc.KVCascadeStub(ch).Generate(req, timeout=timeout):
            if not tokens and on_first is not None:
                on_first()
            tokens += last.token_ids
    return tokens, last


def test_two_tp2_workers_serve_through_the_router(cluster, smollm2, prompt_ids):
    workers = cluster.workers()
    assert sorted(workers) == ["ray-0", "ray-1"]
    assert all(w.tp_size == 2 for w in workers.values())
    expected = LLMEngine(EngineConfig(model="smollm2-135m", quantization="none"), tokenizer=smollm2.tokenizer,
                         model=smollm2.model).generate(prompt_ids, SamplingParams(max_tokens=12, temperature=0,
                                                                                  ignore_eos=True))
    results: dict[int, tuple] = {}

    def one(i):
        results[i] = generate(cluster.router, prompt_ids[i], 12)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompt_ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results[i][0] for i in range(len(prompt_ids))] == expected  # TP=2 on Ray == TP=1 in process
    assert {results[i][1].worker_id for i in results} == {"ray-0", "ray-1"}


def _pids(title: str) -> list[int]:
    """Processes whose command line starts with ``title`` (Ray names actor processes ray::Class)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(title.encode()):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def test_a_killed_worker_under_load_leaves_no_request_hanging_and_returns(cluster):
    import ray

    before = cluster.workers()
    ray.init(address=cluster.ray_address, namespace="kvcascade", log_to_driver=False)
    try:
        victim = ray.get_actor("ray-0")
        victim_pid = ray.get(victim.pid.remote())
        started = threading.Semaphore(0)
        outcomes: list = []

        def long(i):
            try:
                tokens, last = generate(cluster.router, [100 + i] * (20 + i), 150, timeout=120,
                                        on_first=started.release)
                outcomes.append((len(tokens), last.worker_id, last.route_reason))
            except grpc.RpcError as err:
                outcomes.append(err.code())

        threads = [threading.Thread(target=long, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for _ in range(6):
            assert started.acquire(timeout=120)  # every stream is under way
        ray.kill(victim, no_restart=False)  # a crash: Ray restarts it
        # At once (long before ray-0 is back), new requests are answered by the survivor.
        tokens, last = generate(cluster.router, [7] * 30, 4, timeout=60)
        assert len(tokens) == 4 and last.worker_id == "ray-1"
        for t in threads:
            t.join(150)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert len(outcomes) == 6
        # Every stream finishes whole on the survivor; those that were on the killed worker went on
        # there from the tokens already sent (the router's request migration).
        assert all(isinstance(o, tuple) and o[:2] == (150, "ray-1") for o in outcomes), outcomes
        assert any(reason == "migrated" for _, _, reason in outcomes), "no stream was on the killed worker"

        # Ray restarts the actor: new process, new epoch, registered again.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            back = cluster.workers().get("ray-0")
            if back is not None and back.epoch != before["ray-0"].epoch:
                break
            time.sleep(1)
        else:
            pytest.fail("ray-0 did not come back")
        assert ray.get(victim.pid.remote()) != victim_pid

        # A rank actor's death takes its worker down with it (rank 0 exits), and Ray restarts it.
        epochs = {wid: w.epoch for wid, w in cluster.workers().items()}
        assert sorted(epochs) == ["ray-0", "ray-1"]
        ranks = _pids("ray::RankActor")
        assert len(ranks) == 2, ranks
        os.kill(ranks[0], signal.SIGKILL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            now = {wid: w.epoch for wid, w in cluster.workers().items()}
            if sorted(now) == ["ray-0", "ray-1"] and sum(now[w] != epochs[w] for w in now) == 1:
                break
            time.sleep(1)
        else:
            pytest.fail(f"no worker came back under a new epoch after losing a rank: {epochs} -> {now}")
        seen = {generate(cluster.router, [11 + i] * 40, 3, timeout=120)[1].worker_id for i in range(6)}
        assert seen <= {"ray-0", "ray-1"}
    finally:
        ray.shutdown()


def test_shutdown_drains_requests_under_way(cluster):
    result: dict = {}

    def one():
        try:
            result["out"] = generate(cluster.router, [42] * 25, 60, timeout=120)
        except grpc.RpcError as err:
            result["err"] = err

    t = threading.Thread(target=one)
    t.start()
    time.sleep(3)  # under way
    cluster.serve.send_signal(signal.SIGTERM)
    t.join(120)
    assert "out" in result, result
    tokens, last = result["out"]
    assert len(tokens) == 60 and last.finish_reason == "length"
    assert cluster.serve.wait(120) == 0
    assert cluster.workers() == {}  # deregistered
