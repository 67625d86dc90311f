"""What the containers run: commands and flags (read by the real `kvcascade` parser), env,
Secrets and $(VARs), mounts, probes, GPUs, and KubeRay running the same worker."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from kvcascade.cli import build_parser
from router.limits import Limits
from tests.helm.chart import CHART, PREFIX, VARIANTS, args_after_script, containers, env_of, expand, flag, render


def test_every_variable_in_args_is_defined(rendered):
    """Kubernetes leaves an undefined $(VAR) as it is: a password would silently be the text."""
    for owner, _, c in containers(rendered):
        env = env_of(c)
        for text in c.get("command", []) + c.get("args", []):
            for name in re.findall(r"\$\((\w+)\)", text):
                assert name in env, f"{owner}/{c['name']}: $({name}) is not in its env"


def test_redis_url_reaches_redis(rendered):
    values = rendered.values["redis"]
    for component in ("router", "worker"):
        c = rendered.container(component)
        url = flag(args_after_script(c), "--redis-url")
        env = env_of(c)
        if values["bundled"]["enabled"]:
            svc = rendered.one("Service", f"{PREFIX}-redis")
            assert url == f"redis://:$(REDIS_PASSWORD)@{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}/0"
            ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
            redis = rendered.container("redis")
            assert ref == env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]  # the same password both sides
            assert flag(redis["args"], "--requirepass") == "$(REDIS_PASSWORD)"
        elif values["external"]["urlKey"]:
            assert url == "$(REDIS_URL)"
            assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-creds", "key": "url"}
        elif values["external"]["passwordKey"]:
            assert url == "rediss://:$(REDIS_PASSWORD)@redis.example.internal:6380/2"
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-creds", "key": "password"}
        else:
            assert url == values["external"]["url"] and "REDIS_PASSWORD" not in env
        assert flag(args_after_script(c), "--key-prefix") == (values["keyPrefix"] or None)


def _parse(command: str, args: list[str]) -> tuple[object, list[str]]:
    """The args as the real `kvcascade` parser reads them, with $(VARs) filled in."""
    filled = [expand(a, {"POD_NAME": "w-0", "POD_IP": "10.0.0.7", "REDIS_PASSWORD": "pw",
                         "REDIS_URL": "redis://r:6379/0"}) for a in args]
    return build_parser().parse_known_args([command, *filled])


def test_router_flags_are_the_clis(rendered):
    c = rendered.container("router")
    assert c["command"] == ["kvcascade", "router"]
    args, unknown = _parse("router", c["args"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (args.host, args.port, args.http_port) == ("0.0.0.0", ports["grpc"], ports["http"])
    assert args.policy == (rendered.values["router"]["policy"] or "prefix_aware")
    # One process is the CLI's default: the flag is passed only for more.
    assert args.http_workers == rendered.values["router"]["httpWorkers"]
    assert ("--http-workers" in c["args"]) == (rendered.values["router"]["httpWorkers"] > 1)
    cascade = rendered.values["cascade"]
    assert unknown == []
    assert args.cascade == (f"{cascade['mountPath']}/cascade.yaml" if cascade["enabled"] else None)
    router = rendered.values["router"]
    assert (args.tls_cert is not None) == (args.tls_key is not None) == router["tls"]["enabled"]
    # Limits: exactly the values set (0 or null: no flag), and ones the router itself accepts.
    limits = router["limits"]  # (Helm drops the keys whose value is null)
    assert (args.rate_limit, args.rate_burst, args.max_concurrent_per_client) == tuple(
        limits.get(name) or None for name in ("rateLimit", "rateBurst", "maxConcurrentPerClient"))
    Limits(rate=args.rate_limit, burst=args.rate_burst, concurrency=args.max_concurrent_per_client)
    assert args.protect_metrics == router["metrics"]["protect"]
    if args.protect_metrics:  # the router refuses to start without keys to check /metrics against
        assert "KVCASCADE_API_KEYS" in env_of(c)


def test_worker_flags_are_the_clis(rendered):
    w = rendered.values["workers"]
    c = rendered.container("worker")
    args, unknown = _parse("worker", args_after_script(c))
    assert (args.host, args.port) == ("0.0.0.0", w["port"])
    assert (args.worker_id, args.advertise_address) == ("w-0", f"10.0.0.7:{w['port']}")
    assert (args.model, args.device) == (w["model"], w["device"])
    for name, value in w["engine"].items():
        assert flag(args_after_script(c), f"--{name}") == str(value)
    # Running requests get the grace period; the kubelet's SIGKILL comes later.
    assert args.grace_period < rendered.pods("worker")[0]["spec"]["terminationGracePeriodSeconds"]
    # One rank per GPU of the pod; --tp is passed only for more than one.
    assert unknown == []
    assert getattr(args, "tensor_parallel_size", 1) == w["tp"]
    assert ("--tp" in args_after_script(c)) == (w["tp"] > 1)


def test_schema_engine_flags_are_the_clis():
    """workers.engine takes the `kvcascade worker` engine flags: one source of names (the CLI)."""
    from kvcascade.cli import _ENGINE_FLAGS

    schema = json.loads((CHART / "values.schema.json").read_text())
    engine = set(schema["properties"]["workers"]["properties"]["engine"]["properties"])
    cli = {spec.flag.removeprefix("--") for spec in _ENGINE_FLAGS} - {"model", "device", "tp"}  # workers.tp
    assert engine == cli, f"values.schema.json workers.engine: add {sorted(cli - engine)}, drop {sorted(engine - cli)}"


def test_schema_policies_are_the_routers():
    from router.policy import POLICIES

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["router"]["properties"]["policy"]["enum"]) == {"", *POLICIES}


def test_mounts_have_volumes_and_caches_are_writable(rendered):
    for owner, template, c in containers(rendered):
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        for m in mounts.values():
            assert m["name"] in volumes, f"{owner}/{c['name']}: mount {m['name']} has no volume"
        writable = [path for path, m in mounts.items() if not m.get("readOnly")
                    and {"emptyDir", "hostPath", "persistentVolumeClaim"} & set(volumes[m["name"]])]
        # The root filesystem is read-only: everything that writes must land in a writable volume.
        for name in ("HOME", "KVCASCADE_CACHE", "HF_HOME", "TRITON_CACHE_DIR"):
            if name in env_of(c):
                path = env_of(c)[name]["value"]
                assert any(path == w or path.startswith(w + "/") for w in writable), f"{owner}: {name}={path}"
        if c["name"] in ("router", "worker"):
            assert "/tmp" in writable and "/cache" in writable


def test_model_volume_is_shared_read_only_by_workers_and_routers():
    r = render(VARIANTS["model-volume"])
    for component in ("router", "worker"):
        pod = r.pods(component)[0]
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model")
        # The router reads the tokenizer from the path the worker registers as its model.
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert flag(r.container("worker")["args"], "--model") == "/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert "qwen2.5-coder-1.5b-instruct-q4_k_m" in r.notes  # the model id a first request names
    assert not any(v["name"] == "model" for v in render().pods("worker")[0]["spec"]["volumes"])


def test_the_workers_cache_can_outlive_the_pod():
    """workers.cacheVolume: /cache in every worker pod (Triton's kernels and the tuned Gluon tiles
    there, through TRITON_CACHE_DIR and KVCASCADE_CACHE) from the given volume; an emptyDir by
    default, and the router's stays one."""
    for variant in (VARIANTS["cache-volume"], {**VARIANTS["cache-volume"], "workers": {
            **VARIANTS["cache-volume"]["workers"], "kuberay": {"enabled": True}}}):
        r = render(variant)
        workers = [t for owner, t in r.pod_templates() if "worker" in owner or owner.endswith("/gpu")]
        assert workers
        for template in workers:
            volume = next(v for v in template["spec"]["volumes"] if v["name"] == "cache")
            assert volume == {"name": "cache", **variant["workers"]["cacheVolume"]}
            c = template["spec"]["containers"][0]
            assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]
            assert env_of(c)["KVCASCADE_CACHE"]["value"].startswith("/cache/")
        router = next(v for v in r.pods("router")[0]["spec"]["volumes"] if v["name"] == "cache")
        assert router == {"name": "cache", "emptyDir": {}}
    default = next(v for v in render().pods("worker")[0]["spec"]["volumes"] if v["name"] == "cache")
    assert default == {"name": "cache", "emptyDir": {}}


def test_cascade_file_is_a_mounted_config_map():
    r = render(VARIANTS["cascade"])
    cm = r.one("ConfigMap", f"{PREFIX}-router-cascade")
    assert yaml.safe_load(cm["data"]["cascade.yaml"]) == VARIANTS["cascade"]["cascade"]["config"]
    pod = r.pods("router")[0]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "cascade")
    mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "cascade")
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    # A directory mount, not subPath: the kubelet swaps the file in place on change, so it can be reloaded.
    assert "subPath" not in mount and mount["readOnly"]
    assert flag(r.container("router")["args"], "--cascade") == f"{mount['mountPath']}/cascade.yaml"
    assert "--cascade" not in render().container("router")["args"]


def test_api_keys_come_from_a_secret():
    for variant in ("api-keys", "api-keys-inline"):
        r = render(VARIANTS[variant])
        ref = env_of(r.container("router"))["KVCASCADE_API_KEYS"]["valueFrom"]["secretKeyRef"]
        if variant == "api-keys":
            assert ref == {"name": "demo-api-keys", "key": "keys"}
            assert r.get("Secret", "demo-api-keys") is None  # the user's Secret, not the chart's
        else:
            assert r.secret_value(ref["name"], ref["key"]) == "key-one-123,key-two-456"
        assert "Authorization: Bearer" in r.notes
    assert "KVCASCADE_API_KEYS" not in env_of(render().container("router"))


def test_router_probes(rendered):
    c = rendered.container("router")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    https = {"scheme": "HTTPS"} if rendered.values["router"]["tls"]["enabled"] else {}
    # Ready = gRPC health SERVING (a live worker, as /readyz); alive = /healthz, which needs no worker,
    # so routers are not restarted while the workers load.
    if https:  # the kubelet's grpc probe cannot speak TLS: /readyz, the same condition, over HTTPS
        assert "grpc" not in c["readinessProbe"]
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http", **https}
    else:
        assert c["readinessProbe"]["grpc"] == {"port": ports["grpc"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http", **https}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http", **https}


def test_tls_secret_is_mounted_read_only_for_the_flags():
    r = render(VARIANTS["tls"])
    pod = r.pods("router")[0]
    c = pod["spec"]["containers"][0]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "router-tls"
    assert volume["secret"]["defaultMode"] & 0o007 == 0  # the private key is not world-readable
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    # A directory mount, not subPath: a renewed Secret reaches the files (read at the next start).
    assert mount["readOnly"] and "subPath" not in mount
    assert flag(c["args"], "--tls-cert") == f"{mount['mountPath']}/tls.crt"
    assert flag(c["args"], "--tls-key") == f"{mount['mountPath']}/tls.key"
    http = next(p for p in r.one("Service", f"{PREFIX}-router")["spec"]["ports"] if p["name"] == "http")
    assert http["appProtocol"] == "https"
    assert "https://demo-kvcascade-router.serving.svc:8000/v1" in r.notes and "http://" not in r.notes
    assert "--cacert" in r.notes and "over TLS" in r.notes
    plain = render()
    assert "--tls-cert" not in plain.container("router")["args"]
    assert not any(v["name"] == "tls" for v in plain.pods("router")[0]["spec"]["volumes"])


@pytest.mark.parametrize("limits, expected", [
    ({}, []),
    ({"rateLimit": 0, "rateBurst": None, "maxConcurrentPerClient": 0}, []),
    ({"maxConcurrentPerClient": 8}, ["--max-concurrent-per-client", "8"]),
    ({"rateLimit": 50}, ["--rate-limit", "50"]),
    ({"rateLimit": 2.5, "rateBurst": 10, "maxConcurrentPerClient": 4},
     ["--rate-limit", "2.5", "--rate-burst", "10", "--max-concurrent-per-client", "4"]),
])  # fmt: skip
def test_limits_render_exactly_the_flags_given(limits, expected):
    args = render({"router": {"limits": limits}}).container("router")["args"]
    names = ("--rate-limit", "--rate-burst", "--max-concurrent-per-client")
    assert [a for i, a in enumerate(args) if a in names or (i and args[i - 1] in names)] == expected


def test_protected_metrics():
    r = render(VARIANTS["protected-metrics"])
    assert "--protect-metrics" in r.container("router")["args"]
    assert "/metrics needs an API key too" in r.notes
    assert "--protect-metrics" not in render().container("router")["args"]


def test_worker_probes(rendered):
    w = rendered.values["workers"]
    c = rendered.container("worker")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": w["port"]}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # minutes to load weights


def test_gpus_equal_tp(rendered):
    w = rendered.values["workers"]
    for pod in rendered.pods("worker"):
        c = pod["spec"]["containers"][0]
        limits = c["resources"].get("limits", {})
        if w["device"] == "cuda":
            assert limits["nvidia.com/gpu"] == w["tp"]
            assert any(t.get("key") == "nvidia.com/gpu" for t in pod["spec"].get("tolerations", []))
        else:
            assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in c["resources"].get("requests", {})
        assert pod["spec"].get("nodeSelector", {}) == w["nodeSelector"]
    for component in ("router", "redis", "ray-head"):
        for pod in rendered.pods(component):
            assert "nvidia.com/gpu" not in str(pod["spec"]["containers"][0]["resources"]), component


def test_kuberay_runs_the_same_worker_in_a_ray_cluster():
    plain, ray = render({"workers": {"tp": 2}}), render({"workers": {"tp": 2, "kuberay": {"enabled": True}}})
    assert plain.all("RayCluster") == [] and ray.all("StatefulSet") == [s for s in ray.all("StatefulSet")
                                                                      if "redis" in s["metadata"]["name"]]
    cluster = ray.one("RayCluster", f"{PREFIX}-ray")
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head, (group,) = cluster["spec"]["headGroupSpec"], cluster["spec"]["workerGroupSpecs"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert group["rayStartParams"]["num-gpus"] == "2" and group["replicas"] == 2
    worker = group["template"]["spec"]["containers"][0]
    assert worker["command"] == ["/bin/bash", "-c", "--"]
    script = worker["args"][0]
    assert "$KUBERAY_GEN_RAY_START_CMD &" in script and script.endswith('exec kvcascade worker "$@"')
    # The flags after the script are exactly those of the plain StatefulSet's worker.
    assert args_after_script(worker) == plain.container("worker")["args"]
    assert worker["env"] == plain.container("worker")["env"]
    assert "$KUBERAY_GEN_RAY_START_CMD" in head["template"]["spec"]["containers"][0]["args"][0]
    assert {m["mountPath"] for m in head["template"]["spec"]["containers"][0]["volumeMounts"]} >= {"/tmp", "/dev/shm"}
