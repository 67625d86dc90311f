"""The chart rendered by real Helm (helm-python-sdk: Helm v4 as a library, no binary), as plain
objects, and the value sets the tests render it with."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvcascade"
RELEASE = "demo"
NAMESPACE = "serving"
PREFIX = f"{RELEASE}-kvcascade"  # what every object's name starts with

Obj = dict[str, Any]

_EXTERNAL_REDIS = {"bundled": {"enabled": False},
                   "external": {"url": "rediss://redis.example.internal:6380/2", "existingSecret": "redis-creds",
                                "passwordKey": "password"}}
_MODEL_VOLUME = {"model": "/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                 "modelVolume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}}

# The value sets every structural test runs over: the issue's list and a few more.
VARIANTS: dict[str, Obj] = {
    "default": {},
    "kuberay": {"workers": {"kuberay": {"enabled": True}}},
    "external-redis": {"redis": _EXTERNAL_REDIS},
    "external-redis-url-secret": {"redis": {"bundled": {"enabled": False},
                                            "external": {"existingSecret": "redis-creds", "urlKey": "url"}}},
    "external-redis-plain": {"redis": {"bundled": {"enabled": False},
                                       "external": {"url": "redis://redis.shared:6379/0"}, "keyPrefix": "demo:"}},
    "tp2": {"workers": {"tp": 2, "engine": {"kv-cache-memory": "20GiB", "max-num-seqs": 128, "speculative": "ngram:2-4",
                                            "num-speculative-tokens": 3}}},
    "autoscaling-off": {"router": {"autoscaling": {"enabled": False}, "replicas": 3, "pdb": {"enabled": False}}},
    "api-keys": {"router": {"apiKeys": {"enabled": True, "existingSecret": "demo-api-keys", "secretKey": "keys"}}},
    "api-keys-inline": {"router": {"apiKeys": {"enabled": True, "keys": ["key-one-123", "key-two-456"]}}},
    "service-monitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    "tls": {"router": {"tls": {"enabled": True, "secretName": "router-tls"}},
            "serviceMonitor": {"enabled": True, "tls": {"caSecret": {"name": "router-tls"}}}},
    "limits": {"router": {"limits": {"rateLimit": 2.5, "rateBurst": 10, "maxConcurrentPerClient": 4}}},
    "protected-metrics": {"router": {"apiKeys": {"enabled": True, "keys": ["key-one-123"]},
                                     "metrics": {"protect": True, "scrapeKeySecret": {"name": "prometheus-key"}}},
                          "serviceMonitor": {"enabled": True}},
    "cascade": {"cascade": {"enabled": True, "config": {"small": "qwen2.5-coder-0.5b", "large": "qwen2.5-coder-1.5b",
                                                         "threshold": 0.7}}},
    "model-volume": {"workers": _MODEL_VOLUME},
    "cache-volume": {"workers": {"cacheVolume": {"hostPath": {"path": "/var/cache/kvcascade",
                                                             "type": "DirectoryOrCreate"}}}},
    "cpu": {"workers": {"device": "cpu", "replicas": 1, "tolerations": []}},
    "everything": {
        "workers": {**_MODEL_VOLUME, "tp": 4, "kuberay": {"enabled": True}, "heartbeatTtl": 10,
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
        "router": {"autoscaling": {"enabled": False}, "policy": "least_load", "httpWorkers": 4,
                   "apiKeys": {"enabled": True, "existingSecret": "demo-api-keys"},
                   "tls": {"enabled": True, "secretName": "router-tls"}, "limits": {"rateLimit": 100},
                   "metrics": {"protect": True, "scrapeKeySecret": {"name": "prometheus-key", "key": "key"}}},
        "redis": _EXTERNAL_REDIS,
        "serviceMonitor": {"enabled": True, "tls": {"serverName": "router.example.internal",
                                                    "insecureSkipVerify": True}},
        "cascade": {"enabled": True, "config": {"threshold": 0.5}},
        "networkPolicy": {"routerFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]},
    },
}


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


@dataclass
class Rendered:
    values: Obj  # the merged values the release would use
    objects: list[Obj]
    notes: str

    def all(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj | None:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) <= 1, f"two {kind}/{name}"
        return found[0] if found else None

    def one(self, kind: str, name: str) -> Obj:
        obj = self.get(kind, name)
        assert obj is not None, f"no {kind}/{name}; rendered: {sorted(self.names())}"
        return obj

    def names(self) -> set[str]:
        return {f"{o['kind']}/{o['metadata']['name']}" for o in self.objects}

    def pod_templates(self) -> Iterator[tuple[str, Obj]]:
        """(owner, PodTemplateSpec) of every workload, RayCluster groups included (with the
        labels KubeRay adds to the pods it makes from them)."""
        for o in self.objects:
            if o["kind"] in ("Deployment", "StatefulSet"):
                yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]
            elif o["kind"] == "RayCluster":
                name = o["metadata"]["name"]
                groups = [("head", "head", o["spec"]["headGroupSpec"]["template"])]
                groups += [(g["groupName"], "worker", g["template"]) for g in o["spec"]["workerGroupSpecs"]]
                for group, node_type, template in groups:
                    labels = {**template["metadata"]["labels"], "ray.io/cluster": name, "ray.io/node-type": node_type,
                              "ray.io/group": "headgroup" if node_type == "head" else group}
                    metadata = {**template["metadata"], "labels": labels}
                    yield f"RayCluster/{name}/{group}", {**template, "metadata": metadata}

    def pods(self, component: str) -> list[Obj]:
        return [t for _, t in self.pod_templates()
                if t["metadata"]["labels"]["app.kubernetes.io/component"] == component]

    def container(self, component: str) -> Obj:
        """The first container of the pods of ``component`` (router, worker, redis, ray-head)."""
        pods = self.pods(component)
        assert pods, f"no {component} pods"
        return pods[0]["spec"]["containers"][0]

    def secret_value(self, name: str, key: str) -> str:
        import base64

        return base64.b64decode(self.one("Secret", name)["data"][key]).decode()


def render(values: Obj | None = None) -> Rendered:
    manifests = chart().render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = [o for path, text in sorted(manifests.items()) if path.endswith(".yaml")
               for o in yaml.safe_load_all(text) if o]
    notes = next((text for path, text in manifests.items() if path.endswith("NOTES.txt")), "")
    return Rendered(chart().merge_values(values or {}), objects, notes)


_VAR = re.compile(r"\$\((\w+)\)|\$\$")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args: $$ is a literal $, unknown names stay."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def args_after_script(container: Obj) -> list[str]:
    """A container's `kvcascade worker` flags: its args, or with KubeRay's bash wrapper the
    positional parameters after the script and its $0."""
    if container["command"][:2] == ["/bin/bash", "-c"]:
        return container["args"][2:]
    return container["args"]


def matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A LabelSelector (or a Service's plain selector map) against labels."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def container_ports(template: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}


def containers(rendered: Rendered) -> Iterator[tuple[str, Obj, Obj]]:
    """(owner, pod template, container) for every container, init containers included."""
    for owner, template in rendered.pod_templates():
        for c in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            yield owner, template, c


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def flag(args: list[str], name: str) -> str | None:
    """The value after ``name`` in an argument list."""
    return args[args.index(name) + 1] if name in args else None
