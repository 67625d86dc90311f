"""No cluster can run here; this is the closest thing. The chart is rendered, and Redis, one
worker and the router start as local processes exactly as their rendered containers say:
command, args and env, with Secrets and the downward API filled in as the kubelet would and
$(VARs) expanded as Kubernetes does. The only changes are the ones a pod network makes
unnecessary: Service names and pod IPs become loopback addresses, container ports free local
ports, emptyDirs temporary folders, `kvcascade` this interpreter, and Redis binds loopback.
Readiness is the manifests' own probes; then one completion goes through the router the way
`python -m deploy.smoke` sends it, with the API key from the rendered Secret.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.local import free_port
from deploy.smoke import completion_body, exchange, parse_response, raw_request, send_url
from tests.helm.chart import PREFIX, Obj, Rendered, expand, render

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# CPU workers (the chart's GPU default otherwise), one of them, a small KV cache; API keys on so
# their Secret wiring is exercised too. Cascade stays off: its --cascade flag is not in the CLI yet.
VALUES = {
    "workers": {"device": "cpu", "replicas": 1, "tolerations": [],
                "engine": {"kv-cache-memory": "64MiB", "max-num-seqs": 8}},
    "router": {"apiKeys": {"enabled": True, "keys": ["local-smoke-key-1"]}},
}
REPO = Path(__file__).resolve().parents[2]


@dataclass
class LocalPod:
    name: str
    container: Obj
    ports: dict[int, int]  # containerPort -> local port
    env: dict[str, str]
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        return f"--- {self.name}: {' '.join(self.argv)}\n{self.log.read_text()[-3000:]}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _local_path(path: str, volumes: dict[str, Path]) -> str:
    for mount, local in volumes.items():
        if path == mount or path.startswith(mount + "/"):
            return str(local) + path[len(mount):]
    return path


def local_pod(rendered: Rendered, component: str, pod_name: str, volume_root: Path,
              endpoints: dict[str, str], shared: dict[str, Path]) -> LocalPod:
    """The pod's first container as a local process (not started)."""
    template = rendered.pods(component)[0]
    c = template["spec"]["containers"][0]
    volumes = {}
    for m in c.get("volumeMounts", []):
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == m["name"])
        assert "emptyDir" in volume, f"{component}: only emptyDirs can be stood in for here ({m['name']})"
        volumes[m["mountPath"]] = shared.get(m["name"]) or volume_root / pod_name / m["name"]
        volumes[m["mountPath"]].mkdir(parents=True, exist_ok=True)
    # The env as the kubelet builds it: the image's PATH, then the container's variables in order.
    env = {"PATH": os.environ["PATH"]}
    for e in c.get("env", []):
        if "value" in e:
            value = expand(e["value"], env)
        elif "fieldRef" in e["valueFrom"]:
            value = {"metadata.name": pod_name, "status.podIP": "127.0.0.1"}[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            value = rendered.secret_value(ref["name"], ref["key"])
        env[e["name"]] = _local_path(value, volumes)
    ports = {p["containerPort"]: free_port() for p in c.get("ports", [])}
    own = {f"127.0.0.1:{container}": f"127.0.0.1:{local}" for container, local in ports.items()}  # its pod IP
    args = [expand(a, env) for a in c["args"]]
    local = []
    for i, arg in enumerate(args):
        flag = args[i - 1] if i else ""
        if flag in ("--port", "--http-port"):
            arg = str(ports[int(arg)])
        elif flag == "--host" and arg == "0.0.0.0":
            arg = "127.0.0.1"
        else:
            arg = re.sub(r"[\w.-]+:\d+", lambda m: {**endpoints, **own}.get(m.group(0), m.group(0)), arg)
            arg = _local_path(arg, volumes)
        local.append(arg)
    command = c["command"]
    if command[0] == "kvcascade":
        argv = [sys.executable, "-m", "kvcascade", *command[1:], *local]
    else:
        argv = [shutil.which(command[0]) or pytest.fail(f"{command[0]} is not installed"), *command[1:], *local]
    return LocalPod(pod_name, c, ports, env, argv, volume_root / f"{pod_name}.log")


def probe(pod: LocalPod, spec: Obj) -> bool:
    """One run of a Kubernetes probe (grpc, httpGet, exec, tcpSocket) against the local process."""
    named = {p["name"]: p["containerPort"] for p in pod.container.get("ports", [])}

    def local(port: int | str) -> int:
        return pod.ports[named[port] if isinstance(port, str) else port]

    try:
        if "grpc" in spec:
            with grpc.insecure_channel(f"127.0.0.1:{local(spec['grpc']['port'])}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        if "httpGet" in spec:
            get = spec["httpGet"]
            with urllib.request.urlopen(f"http://127.0.0.1:{local(get['port'])}{get['path']}", timeout=2) as r:
                return 200 <= r.status < 400
        if "tcpSocket" in spec:
            with socket.create_connection(("127.0.0.1", local(spec["tcpSocket"]["port"])), timeout=2):
                return True
        if "exec" in spec:
            command = [re.sub(r"-p (\d+)", lambda m: f"-p {pod.ports[int(m.group(1))]}", part)
                       for part in spec["exec"]["command"]]
            return subprocess.run(command, env=pod.env, capture_output=True, timeout=5).returncode == 0
    except (grpc.RpcError, OSError, subprocess.TimeoutExpired):
        return False
    raise AssertionError(f"unknown probe {spec}")


def wait_until(pod: LocalPod, probe_name: str, timeout_s: float) -> None:
    spec = pod.container[probe_name]
    deadline = time.monotonic() + timeout_s
    while not probe(pod, spec):
        if pod.proc.poll() is not None:
            pytest.fail(f"{pod.name} exited ({pod.proc.returncode}) before its {probe_name} passed\n{pod.tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{pod.name}: {probe_name} not passing after {timeout_s}s\n{pod.tail()}")
        time.sleep(0.5)


def test_router_and_worker_run_as_the_manifests_say(tmp_path):
    rendered = render(VALUES)
    pods: list[LocalPod] = []
    try:
        # Redis, as its StatefulSet says; its Service name then resolves to it.
        redis = local_pod(rendered, "redis", f"{PREFIX}-redis-0", tmp_path, {}, {})
        redis.argv += ["--bind", "127.0.0.1"]
        pods.append(redis)
        redis.start()
        wait_until(redis, "readinessProbe", 20)  # redis-cli with REDISCLI_AUTH from the Secret
        service = rendered.one("Service", f"{PREFIX}-redis")
        redis_port = redis.ports[service["spec"]["ports"][0]["port"]]
        endpoints = {f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}": f"127.0.0.1:{redis_port}"}

        # Worker and router; each pod has its own emptyDirs, but they share the cache one here, so
        # the tokenizer the worker converts from GGUF is not converted again by the router.
        cache = {"cache": tmp_path / "cache"}
        worker = local_pod(rendered, "worker", f"{PREFIX}-worker-0", tmp_path, endpoints, cache)
        router = local_pod(rendered, "router", f"{PREFIX}-router-7d9f-x2k4p", tmp_path, endpoints, cache)
        assert f"redis://:{rendered.secret_value(f'{PREFIX}-redis', 'redis-password')}@127.0.0.1:{redis_port}/0" \
            in worker.argv and "--device" in worker.argv and "cpu" in worker.argv
        pods += [worker, router]
        worker.start()
        router.start()
        wait_until(router, "startupProbe", 60)  # /healthz: up before any worker
        wait_until(worker, "startupProbe", 180)  # the model loaded, gRPC health SERVING
        wait_until(worker, "readinessProbe", 10)
        wait_until(router, "readinessProbe", 30)  # SERVING once the worker's registration is seen
        wait_until(router, "livenessProbe", 5)

        http_port = router.ports[8000]
        key = rendered.secret_value(f"{PREFIX}-api-keys", "api-keys")
        with socket.create_connection(("127.0.0.1", http_port), timeout=10) as sock:
            request = raw_request(completion_body("The capital of France is", 4), key)
            answer = parse_response(exchange(sock, request, 120))
        assert answer.ok, answer.summary() + "\n" + router.tail() + worker.tail()
        assert answer.body["model"] == "smollm2-135m" and answer.text
        assert answer.body["usage"]["completion_tokens"] == 4
        # Without the key the router refuses: the Secret's keys reached it through KVCASCADE_API_KEYS.
        refused = send_url(f"http://127.0.0.1:{http_port}", completion_body("hi", 4), None, 30)
        assert refused.status == 401, refused.summary()
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
            assert b"kvcascade_state_backend_up 1" in r.read()
    finally:
        for pod in reversed(pods):
            pod.stop()
