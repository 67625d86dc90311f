"""Wait until a kvcascade release is ready: ``python -m deploy.rollout wait --release R --namespace N``.

Ready means every Deployment, StatefulSet and RayCluster of the release has its desired
replicas updated and ready, judged as ``kubectl rollout status`` does. While waiting it prints
what is missing, and the pod problems that will not fix themselves (an image that cannot be
pulled, a crash loop, a missing Secret, no node with a free GPU), so an operator sees why.

The judging is pure functions over objects as the API serves them (dicts, camelCase), tested
without a cluster; the cluster calls are in ``ClusterReader``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]

# Waiting reasons that mean a container will not start without someone changing something.
STUCK_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})  # fmt: skip


@dataclass(frozen=True)
class Readiness:
    kind: str
    name: str
    ready: bool
    detail: str  # what is missing, or "ready"
    failed: bool = False  # will not become ready by waiting (a rollout past its deadline)

    def line(self) -> str:
        mark = "ok " if self.ready else "ERR" if self.failed else "..."
        return f"{mark} {self.kind}/{self.name}: {self.detail}"


def _get(obj: Obj, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(obj, dict) or obj.get(key) is None:
            return default
        obj = obj[key]
    return obj


def _not_observed(obj: Obj) -> str | None:
    generation = _get(obj, "metadata", "generation", default=0)
    observed = _get(obj, "status", "observedGeneration", default=0)
    if observed < generation:
        return f"waiting for the controller to see generation {generation} (at {observed})"
    return None


def deployment_readiness(obj: Obj) -> Readiness:
    name = _get(obj, "metadata", "name", default="?")

    def result(ready: bool, detail: str, failed: bool = False) -> Readiness:
        return Readiness("Deployment", name, ready, detail, failed)

    if (waiting := _not_observed(obj)) is not None:
        return result(False, waiting)
    for cond in _get(obj, "status", "conditions", default=[]):
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return result(False, f"rollout failed: {cond.get('message', 'progress deadline exceeded')}", True)
    desired = _get(obj, "spec", "replicas", default=1)
    status = _get(obj, "status", default={})
    updated, total = status.get("updatedReplicas", 0), status.get("replicas", 0)
    available = status.get("availableReplicas", 0)
    if updated < desired:
        return result(False, f"{updated}/{desired} replicas updated")
    if total > updated:
        return result(False, f"{total - updated} old replicas still terminating")
    if available < updated:
        return result(False, f"{available}/{desired} replicas available")
    return result(True, f"{available}/{desired} replicas available")


def statefulset_readiness(obj: Obj) -> Readiness:
    name = _get(obj, "metadata", "name", default="?")

    def result(ready: bool, detail: str) -> Readiness:
        return Readiness("StatefulSet", name, ready, detail)

    if (waiting := _not_observed(obj)) is not None:
        return result(False, waiting)
    desired = _get(obj, "spec", "replicas", default=1)
    status = _get(obj, "status", default={})
    ready = status.get("readyReplicas", 0)
    if ready < desired:
        return result(False, f"{ready}/{desired} pods ready")
    strategy = _get(obj, "spec", "updateStrategy", default={})
    if strategy.get("type", "RollingUpdate") == "RollingUpdate":
        partition = _get(strategy, "rollingUpdate", "partition", default=0)
        updated = status.get("updatedReplicas", 0)
        if status.get("updateRevision") != status.get("currentRevision") and updated < desired - partition:
            return result(False, f"{updated}/{desired - partition} pods updated")
    return result(True, f"{ready}/{desired} pods ready")


def raycluster_readiness(obj: Obj) -> Readiness:
    """KubeRay: the RayClusterProvisioned condition (KubeRay >= 1.2) or the older status.state,
    and every worker of the groups ready."""
    name = _get(obj, "metadata", "name", default="?")
    status = _get(obj, "status", default={})
    conditions = {c.get("type"): c for c in status.get("conditions", [])}
    provisioned = conditions.get("RayClusterProvisioned")
    if provisioned is not None:
        up = provisioned.get("status") == "True"
    else:
        up = status.get("state") == "ready"
    desired = sum(g.get("replicas", 0) for g in _get(obj, "spec", "workerGroupSpecs", default=[]))
    ready = status.get("readyWorkerReplicas", 0)
    if not up:
        reason = (provisioned or {}).get("message") or status.get("reason") or status.get("state") or "provisioning"
        return Readiness("RayCluster", name, False, f"not provisioned: {reason}")
    if ready < desired:
        return Readiness("RayCluster", name, False, f"{ready}/{desired} workers ready")
    return Readiness("RayCluster", name, True, f"{ready}/{desired} workers ready")


_JUDGES: dict[str, Callable[[Obj], Readiness]] = {
    "Deployment": deployment_readiness,
    "StatefulSet": statefulset_readiness,
    "RayCluster": raycluster_readiness,
}


def readiness(obj: Obj) -> Readiness:
    return _JUDGES[obj["kind"]](obj)


def pod_problems(pods: Iterable[Obj]) -> list[str]:
    """What keeps pods from ever becoming ready, one line each."""
    problems = []
    for pod in pods:
        name = _get(pod, "metadata", "name", default="?")
        for cond in _get(pod, "status", "conditions", default=[]):
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason"):
                problems.append(f"pod/{name}: {cond['reason']}: {cond.get('message', '')}".rstrip(": "))
        statuses = [*_get(pod, "status", "initContainerStatuses", default=[]),
                    *_get(pod, "status", "containerStatuses", default=[])]
        for cs in statuses:
            waiting = _get(cs, "state", "waiting", default={})
            if waiting.get("reason") in STUCK_REASONS:
                message = waiting.get("message", "")
                problems.append(f"pod/{name} container {cs.get('name')}: {waiting['reason']}"
                                + (f": {message}" if message else ""))
    return problems


@dataclass(frozen=True)
class Snapshot:
    workloads: list[Readiness]
    problems: list[str]

    @property
    def ready(self) -> bool:
        return bool(self.workloads) and all(w.ready for w in self.workloads)

    @property
    def failed(self) -> bool:
        return any(w.failed for w in self.workloads)


def snapshot(workloads: Iterable[Obj], pods: Iterable[Obj]) -> Snapshot:
    return Snapshot(sorted((readiness(w) for w in workloads), key=lambda r: (r.kind, r.name)), pod_problems(pods))


def wait(fetch: Callable[[], Snapshot], timeout_s: float, interval_s: float = 5.0, *,
         out: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep) -> bool:
    """Poll ``fetch`` until the release is ready (True), has failed or the time is up (False);
    prints the state whenever it changes."""
    deadline = clock() + timeout_s
    shown: list[str] = []
    while True:
        snap = fetch()
        lines = [w.line() for w in snap.workloads] + [f"  ! {p}" for p in snap.problems]
        if not snap.workloads:
            lines = ["... no Deployment, StatefulSet or RayCluster of this release yet"]
        if lines != shown:
            out("\n".join(lines))
            shown = lines
        if snap.ready:
            out("release ready")
            return True
        if snap.failed:
            out("release failed")
            return False
        if clock() >= deadline:
            out(f"not ready after {timeout_s:.0f}s")
            return False
        sleep(interval_s)


# --- the cluster --------------------------------------------------------------------------------


class NoCluster(RuntimeError):
    """No kubeconfig (or in-cluster service account) to reach a cluster with."""


def release_selector(release: str) -> str:
    return f"app.kubernetes.io/instance={release},app.kubernetes.io/part-of=kvcascade"


class ClusterReader:
    """The few reads rollout and smoke make, as plain dicts."""

    def __init__(self, namespace: str, context: str | None = None):
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:
                config.load_kube_config(context=context)
            except config.ConfigException as err:
                raise NoCluster(f"no Kubernetes cluster to talk to: {err} (set KUBECONFIG, pass --context, "
                                "or run inside the cluster)") from None
        self.namespace = namespace
        self.api = client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def _dicts(self, result: Any, kind: str) -> list[Obj]:
        items = [self.api.sanitize_for_serialization(item) for item in result.items]
        return [{**item, "kind": kind} for item in items]  # list items come without their kind

    def workloads(self, selector: str) -> list[Obj]:
        from kubernetes.client.exceptions import ApiException

        ns = self.namespace
        found = [*self._dicts(self.apps.list_namespaced_deployment(ns, label_selector=selector), "Deployment"),
                 *self._dicts(self.apps.list_namespaced_stateful_set(ns, label_selector=selector), "StatefulSet")]
        try:
            rays = self.custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayclusters", label_selector=selector)
            found += [{**item, "kind": "RayCluster"} for item in rays.get("items", [])]
        except ApiException as err:
            if err.status != 404:  # 404: no KubeRay CRD in this cluster
                raise
        return found

    def pods(self, selector: str) -> list[Obj]:
        return self._dicts(self.core.list_namespaced_pod(self.namespace, label_selector=selector), "Pod")

    def secret_value(self, name: str, key: str) -> str:
        import base64

        data = self.core.read_namespaced_secret(name, self.namespace).data or {}
        if key not in data:
            raise KeyError(f"Secret {name} has no key {key!r} (keys: {sorted(data)})")
        return base64.b64decode(data[key]).decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.rollout", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    w = commands.add_parser("wait", help="wait until the release's workloads are ready")
    w.add_argument("--release", required=True)
    w.add_argument("--namespace", default="default")
    w.add_argument("--context", help="kubeconfig context (default: the current one)")
    w.add_argument("--timeout", type=float, default=900.0, help="seconds (default: %(default)s)")
    w.add_argument("--interval", type=float, default=5.0, help="seconds between polls (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        cluster = ClusterReader(args.namespace, args.context)
    except NoCluster as err:
        print(err, file=sys.stderr)
        return 2
    selector = release_selector(args.release)
    ok = wait(lambda: snapshot(cluster.workloads(selector), cluster.pods(selector)), args.timeout, args.interval)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
