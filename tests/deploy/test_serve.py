"""`kvcascade serve` as a user runs it: a process with engine cores of its own, HTTP and gRPC."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from deploy.local import REPO, free_port


class Serve:
    def __init__(self, *args: str, scheme: str = "http", **client: object):
        """``client``: what httpx needs to reach it (verify=, headers=), with ``scheme`` https for TLS."""
        self.client = client
        self.port, self.http_port = free_port(), free_port()
        self.log = open(Path(tempfile.gettempdir()) / f"kvcascade-serve-{self.http_port}.log", "w")
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcascade", "serve", "--port", str(self.port), "--http-port", str(self.http_port),
             *args], cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"{scheme}://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout: float = 300) -> Serve:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2, **self.client).status_code == 200 and \
                        "kvcascade serve ready" in \
                        Path(self.log.name).read_text():
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(Path(self.log.name).read_text()[-3000:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def _chat(url: str, i: int, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": f"What is {i} plus {i + 1}?"}], "temperature": 0,
            "max_tokens": 12, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


@pytest.mark.slow
def test_a_cascade_serve_answers_many_concurrent_requests_to_both_tiers(tmp_path):
    """The reported crash: both tiers' engines stepping at once in one serve wrote into each other's
    KV cache (HTTP 500). Two models of different KV shapes, tiers pinned and the cascade, 4 at a time."""
    cascade = tmp_path / "cascade.yaml"
    cascade.write_text("tiers:\n  - name: small\n    model: dummy:smollm2-mini\n    measure: mean_logprob\n"
                       "    threshold: -0.5\n  - name: large\n    model: smollm2-135m\n")
    serve = Serve("--cascade", str(cascade)).wait_ready()
    try:
        asks = [{"tier": "small"}, {"tier": "large"}, {}] * 8
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda a: _chat(serve.url, a[0], **a[1]), enumerate(asks)))
        assert [r.status_code for r in answers] == [200] * len(asks), [r.text for r in answers if r.status_code != 200]
        bodies = [r.json() for r in answers]
        assert all(b["usage"]["completion_tokens"] >= 1 for b in bodies)
        assert {b["tier"] for b in bodies[0::3]} == {"small"} and {b["tier"] for b in bodies[1::3]} == {"large"}
        # Greedy answers do not depend on what ran beside them.
        again = _chat(serve.url, 1, tier="large").json()
        assert again["choices"][0]["message"]["content"] == bodies[1]["choices"][0]["message"]["content"]
    finally:
        assert serve.stop() == 0


@pytest.mark.slow
def test_serve_a_dummy_model_with_a_tokenizer_folder(tmp_path, smollm2):
    """--tokenizer: a machine without the bundled GGUF serves text for a dummy: model (the GPU benchmark)."""
    smollm2.tokenizer.save_pretrained(tmp_path / "tok")
    serve = Serve("--model", "dummy:smollm2-mini", "--tokenizer", str(tmp_path / "tok")).wait_ready()
    try:
        r = _chat(serve.url, 3, max_tokens=5, ignore_eos=True)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["message"]["content"]
        # The router tokenized the prompt with the same tokenizer as the worker.
        messages = [{"role": "user", "content": "What is 3 plus 4?"}]
        ids = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
        assert body["usage"]["prompt_tokens"] == len(ids)
    finally:
        assert serve.stop() == 0


def test_a_tokenizer_that_is_not_there_is_refused_before_loading(capsys):
    from kvcascade.cli import main

    for argv in (["serve", "--tokenizer", "/no/such/tok"], ["router", "--redis-url", "redis://x", "--tokenizer", "/nope"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "no such file or folder" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_with_http_workers_answers_and_leaves_no_process_behind():
    """--http-workers 2 without --redis-url: a redis-server of its own holds the embedded worker's
    registration and index for both HTTP processes on the port; SIGTERM stops all it started."""
    from contracts.models import resolve_model

    gguf = resolve_model("smollm2-135m").path
    serve = Serve("--model", "dummy:smollm2-mini", "--tokenizer", str(gguf), "--http-workers", "2").wait_ready()
    try:
        started = psutil.Process(serve.proc.pid).children(recursive=True)
        assert any("redis-server" in p.name() for p in started)
        listening = [p for p in [psutil.Process(serve.proc.pid), *started]
                     if any(c.status == psutil.CONN_LISTEN and c.laddr.port == serve.http_port
                            for c in p.net_connections("tcp"))]
        assert len(listening) == 2
        for i in range(4):  # each on a connection of its own, wherever the kernel puts it
            r = httpx.post(f"{serve.url}/v1/completions", json={"prompt": f"Count to {i}", "max_tokens": 5,
                                                               "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        assert serve.stop() == 0

    def alive(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    time.sleep(0.5)  # orphans the kernel reparents are reaped by init
    assert [p.pid for p in started if alive(p)] == [], "serve left processes behind"


@pytest.mark.slow
def test_serve_over_tls_with_keys_and_limits_in_every_http_process(tmp_path):
    """TLS, API keys and per-client limits reach both HTTP processes of --http-workers 2 and the gRPC
    front: 12 requests at once from one key with at most 2 under way (per process) are answered or
    refused 429 with retry-after, never anything else; ``kvcascade generate`` connects over TLS."""
    import ssl

    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    trust = ssl.create_default_context()
    ca.configure_trust(trust)
    key = "sk-serve-tls-key"
    from contracts.models import resolve_model

    serve = Serve("--model", "dummy:smollm2-mini", "--tokenizer", str(resolve_model("smollm2-135m").path),
                  "--http-workers", "2", "--tls-cert", str(tmp_path / "tls.crt"),
                  "--tls-key", str(tmp_path / "tls.key"),
                  "--api-key", key, "--max-concurrent-per-client", "2",
                  scheme="https", verify=trust, headers={"Authorization": f"Bearer {key}"}).wait_ready()
    try:
        def ask(i: int) -> httpx.Response:
            with httpx.Client(verify=trust, headers=serve.client["headers"], timeout=120) as c:  # own connection
                return c.post(f"{serve.url}/v1/completions", json={"prompt": f"Count to {i}", "max_tokens": 200,
                                                                   "ignore_eos": True})

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(12)))
        codes = [a.status_code for a in answers]
        print("status codes", sorted(codes))
        assert set(codes) <= {200, 429} and 2 <= codes.count(200) <= 10, codes
        assert all(a.headers["retry-after"] == "1" for a in answers if a.status_code == 429)
        assert httpx.get(f"{serve.url}/v1/models", verify=trust).status_code == 401  # no key
        done = subprocess.run(
            [sys.executable, "-m", "kvcascade", "generate", "--target", f"127.0.0.1:{serve.port}", "--prompt", "hi",
             "--max-tokens", "3", "--tls-ca", str(tmp_path / "ca.pem"), "--api-key", key],
            cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "completion 3 tokens" in done.stderr, done.stderr
        plain = subprocess.run(
            [sys.executable, "-m", "kvcascade", "generate", "--target", f"127.0.0.1:{serve.port}", "--prompt", "hi",
             "--max-tokens", "3", "--api-key", key, "--timeout", "10"],
            cwd=REPO, capture_output=True, text=True, timeout=120)
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
    finally:
        assert serve.stop() == 0


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "/no/such.crt"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/no/such.crt", "--tls-key", "/no/such.key"], "--tls-cert /no/such.crt: No such file"),
    (["--rate-limit", "0"], "rate must be > 0, got 0"),
    (["--rate-burst", "5"], "burst needs a rate"),
    (["--max-concurrent-per-client", "-1"], "concurrency must be > 0"),
    (["--protect-metrics"], "--protect-metrics needs an API key"),
    (["--max-body-mb", "65"], "--max-body-mb must be in (0, 64], got 65"),
])
def test_access_flags_that_make_no_sense_are_refused_before_loading(capsys, monkeypatch, flags, message):
    from kvcascade.cli import main

    monkeypatch.delenv("KVCASCADE_API_KEYS", raising=False)
    for argv in (["serve"], ["router", "--redis-url", "redis://x"]):
        with pytest.raises(SystemExit) as exit:
            main([*argv, *flags])
        assert exit.value.code == 2 and message in capsys.readouterr().err


def test_http_workers_below_one_is_refused_naming_the_flag(capsys):
    from kvcascade.cli import main

    for argv in (["serve"], ["router", "--redis-url", "redis://x"]):
        with pytest.raises(SystemExit) as exit:
            main([*argv, "--http-workers", "0"])
        assert exit.value.code == 2 and "--http-workers must be >= 1, got 0" in capsys.readouterr().err


def test_http_workers_without_redis_server_is_one_line_before_loading(monkeypatch, tmp_path, capsys):
    from kvcascade.cli import main

    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on it
    assert main(["serve", "--http-workers", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--http-workers 2 without --redis-url" in err and "redis-server is not installed" in err


@pytest.mark.slow
def test_serve_reaches_its_embedded_worker_in_process_with_grpc_semantics():
    """serve's router calls its own worker directly (worker.server.InProcessStub), not over loopback
    gRPC; what a client sees through the router is unchanged: 16 streams at once, a bad field named,
    a deadline, and a client that leaves mid-stream freeing the worker's KV blocks."""
    import grpc

    from protos import kvcascade_pb2 as pb
    from protos import kvcascade_pb2_grpc as pb_grpc

    serve = Serve("--model", "dummy:smollm2-mini").wait_ready()
    try:
        assert "calls worker 127.0.0.1:" in Path(serve.log.name).read_text()
        with grpc.insecure_channel(f"127.0.0.1:{serve.port}") as channel:
            stub = pb_grpc.KVCascadeStub(channel)

            def ids(n: int, i: int) -> pb.GenerateRequest:
                req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                req.token_ids.ids[:] = [1 + i, 2, 3, 4]
                return req

            with ThreadPoolExecutor(16) as pool:
                streams = list(pool.map(lambda i: list(stub.Generate(ids(20, i), timeout=120)), range(16)))
            assert all(sum(len(m.token_ids) for m in s) == 20 and s[-1].finish_reason == "length" for s in streams)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0)), timeout=60))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("sampling.top_p: ")
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(ids(0, 0), timeout=1.0))  # max_tokens 0: until the context ends
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            call = stub.Generate(ids(0, 1), timeout=120)
            next(call)
            call.cancel()

            def busy() -> pb.StatsResponse:
                return stub.Stats(pb.StatsRequest(), timeout=10)

            deadline = time.monotonic() + 15  # the router sums the workers' heartbeats
            while (stats := busy()).running or stats.kv_blocks_used:
                assert time.monotonic() < deadline, stats
                time.sleep(0.2)
    finally:
        assert serve.stop() == 0


def _ask_with_system(url: str, system: int, question: str) -> dict:
    body = {"messages": [{"role": "system", "content": f"System prompt number {system}. " + "Answer briefly. " * 30},
                         {"role": "user", "content": question}], "temperature": 0, "max_tokens": 4}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_serve_replicas_route_a_prefix_to_its_holder_and_share_concurrent_load():
    """--replicas 2: two engine cores (an equal share of the cores each) behind the embedded router and
    its in-memory index, fed by both replicas' cache events: a repeated system prompt finds the replica
    that holds it, 16 requests at once are all answered and both replicas work, SIGTERM stops everything."""
    serve = Serve("--replicas", "2").wait_ready()
    try:
        cores = [p for p in psutil.Process(serve.proc.pid).children(recursive=True)
                 if "worker.core.process" in " ".join(p.cmdline())]
        assert len(cores) == 2
        assert all(p.environ().get("OMP_NUM_THREADS") == "1" for p in cores)  # min(1 set here, cores // 2)
        metrics = httpx.get(f"{serve.url}/metrics", timeout=10).text
        assert "kvcascade_workers_live 2.0" in metrics
        for system in range(3):  # a new prefix, then a second question under it: routed to the holder
            first = _ask_with_system(serve.url, system, "first?")
            second = _ask_with_system(serve.url, system, "second?")
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # the system prompt's blocks
        before = [sum(p.cpu_times()[:2]) for p in cores]
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: _ask_with_system(serve.url, i % 3, f"question {i}?"), range(16)))
        assert all(a["usage"]["completion_tokens"] >= 1 for a in answers)
        used = [sum(p.cpu_times()[:2]) - b for p, b in zip(cores, before)]
        assert min(used) > 0.5, f"CPU seconds per replica under load: {used}"
    finally:
        assert serve.stop() == 0
    assert not [p.pid for p in cores if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_replica_placements_give_each_engine_its_gpus_or_its_share_of_the_cores(monkeypatch):
    from kvcascade.launch import replica_placements
    from worker.engine.config import EngineConfig

    gpus = [str(i) for i in range(8)]
    assert replica_placements(4, EngineConfig(device="cuda", tensor_parallel_size=2), gpus) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"}]
    uuids = ["GPU-a", "GPU-b", "GPU-c"]  # CUDA_VISIBLE_DEVICES may hold UUIDs: passed on as they are
    assert replica_placements(3, EngineConfig(device="cuda"), uuids) == [{"CUDA_VISIBLE_DEVICES": g} for g in uuids]
    with pytest.raises(ValueError, match=r"--replicas with --tp 2 needs 6 GPUs \(3 engines x 2\); 4 visible"):
        replica_placements(3, EngineConfig(device="cuda", tensor_parallel_size=2), gpus[:4])
    with pytest.raises(ValueError, match="use --device cuda, not cuda:1"):
        replica_placements(2, EngineConfig(device="cuda:1"), gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert replica_placements(2, EngineConfig(device="cuda")) == [{"CUDA_VISIBLE_DEVICES": "3"},
                                                                 {"CUDA_VISIBLE_DEVICES": "5"}]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert replica_placements(2, EngineConfig(), cpus=16) == [{"OMP_NUM_THREADS": "8"}] * 2
    assert replica_placements(4, EngineConfig(tensor_parallel_size=2), cpus=16) == [{"OMP_NUM_THREADS": "2"}] * 4
    assert replica_placements(3, EngineConfig(), cpus=2) == [{"OMP_NUM_THREADS": "1"}] * 3
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert replica_placements(2, EngineConfig(), cpus=16) == [{"OMP_NUM_THREADS": "4"}] * 2


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--replicas", "2", "--workers", "2"], "use one or the other"),
    (["--replicas", "2", "--device", "cuda"], "--replicas with --tp 1 needs 2 GPUs (2 engines x 1); 0 visible"),
])
def test_replica_flags_that_cannot_work_are_refused_before_loading(capsys, monkeypatch, flags, message):
    from kvcascade.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit) as exit:
        main(["serve", *flags])
    assert exit.value.code == 2 and message in capsys.readouterr().err
