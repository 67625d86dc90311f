"""deploy.rollout's judgement of readiness, on objects shaped as the API serves them."""

from __future__ import annotations

import pytest

from deploy.rollout import (ClusterReader, Readiness, Snapshot, deployment_readiness, main, pod_problems,
                            raycluster_readiness, readiness, release_selector, snapshot, statefulset_readiness, wait)
from tests.helm.chart import RELEASE, VARIANTS, render


def deployment(replicas=2, generation=3, observed=3, updated=2, total=2, available=2, conditions=()):
    return {"kind": "Deployment", "metadata": {"name": "demo-kvcascade-router", "generation": generation},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "updatedReplicas": updated, "replicas": total,
                       "availableReplicas": available, "conditions": list(conditions)}}


def statefulset(replicas=2, ready=2, updated=2, current="r1", update="r1", partition=None):
    strategy = {"type": "RollingUpdate"}
    if partition is not None:
        strategy["rollingUpdate"] = {"partition": partition}
    return {"kind": "StatefulSet", "metadata": {"name": "demo-kvcascade-worker", "generation": 1},
            "spec": {"replicas": replicas, "updateStrategy": strategy},
            "status": {"observedGeneration": 1, "readyReplicas": ready, "updatedReplicas": updated,
                       "currentRevision": current, "updateRevision": update}}


def raycluster(workers=2, ready=2, state=None, provisioned=None):
    status = {"readyWorkerReplicas": ready}
    if state is not None:
        status["state"] = state
    if provisioned is not None:
        status["conditions"] = [{"type": "RayClusterProvisioned", "status": provisioned,
                                 "message": "" if provisioned == "True" else "head pod not ready"}]
    return {"kind": "RayCluster", "metadata": {"name": "demo-kvcascade-ray"},
            "spec": {"workerGroupSpecs": [{"groupName": "gpu", "replicas": workers}]}, "status": status}


@pytest.mark.parametrize("obj, ready, detail", [
    (deployment(), True, "2/2 replicas available"),
    (deployment(observed=2), False, "waiting for the controller to see generation 3 (at 2)"),
    (deployment(updated=1), False, "1/2 replicas updated"),
    (deployment(total=3), False, "1 old replicas still terminating"),
    (deployment(available=1), False, "1/2 replicas available"),
    ({"kind": "Deployment", "metadata": {"name": "d", "generation": 1}, "spec": {}, "status": {}}, False,
     "waiting for the controller to see generation 1 (at 0)"),
])  # fmt: skip
def test_deployment(obj, ready, detail):
    assert deployment_readiness(obj) == Readiness("Deployment", obj["metadata"]["name"], ready, detail)


def test_deployment_past_its_deadline_has_failed():
    r = deployment_readiness(deployment(updated=1, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "demo-kvcascade-router-6f7c" has timed out progressing.'}]))
    assert not r.ready and r.failed and "timed out progressing" in r.detail
    assert r.line().startswith("ERR Deployment/demo-kvcascade-router")


@pytest.mark.parametrize("obj, ready, detail", [
    (statefulset(), True, "2/2 pods ready"),
    (statefulset(ready=1), False, "1/2 pods ready"),
    (statefulset(updated=1, update="r2"), False, "1/2 pods updated"),
    (statefulset(updated=1, update="r2", partition=1), True, "2/2 pods ready"),  # a staged rollout's share is done
    (statefulset(replicas=0, ready=0, updated=0), True, "0/0 pods ready"),
])  # fmt: skip
def test_statefulset(obj, ready, detail):
    assert statefulset_readiness(obj) == Readiness("StatefulSet", "demo-kvcascade-worker", ready, detail)


@pytest.mark.parametrize("obj, ready, detail", [
    (raycluster(state="ready"), True, "2/2 workers ready"),
    (raycluster(provisioned="True"), True, "2/2 workers ready"),
    (raycluster(provisioned="True", ready=1), False, "1/2 workers ready"),
    (raycluster(provisioned="False"), False, "not provisioned: head pod not ready"),
    (raycluster(ready=0), False, "not provisioned: provisioning"),
])  # fmt: skip
def test_raycluster(obj, ready, detail):
    assert raycluster_readiness(obj) == Readiness("RayCluster", "demo-kvcascade-ray", ready, detail)


def test_pod_problems_name_what_will_not_fix_itself():
    pods = [
        {"metadata": {"name": "demo-kvcascade-worker-0"},
         "status": {"phase": "Pending", "conditions": [
             {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
              "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}},
        {"metadata": {"name": "demo-kvcascade-router-abc"},
         "status": {"phase": "Pending", "containerStatuses": [
             {"name": "router", "state": {"waiting": {"reason": "ImagePullBackOff",
                                                      "message": 'Back-off pulling image "kvc/router:1"'}}}]}},
        {"metadata": {"name": "demo-kvcascade-redis-0"},
         "status": {"phase": "Pending", "containerStatuses": [
             {"name": "redis", "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                     "message": 'secret "redis-creds" not found'}}}]}},
        {"metadata": {"name": "demo-kvcascade-worker-1"},  # merely starting: not a problem
         "status": {"phase": "Pending", "containerStatuses": [
             {"name": "worker", "state": {"waiting": {"reason": "ContainerCreating"}}}]}},
    ]
    assert pod_problems(pods) == [
        "pod/demo-kvcascade-worker-0: Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        'pod/demo-kvcascade-router-abc container router: ImagePullBackOff: Back-off pulling image "kvc/router:1"',
        'pod/demo-kvcascade-redis-0 container redis: CreateContainerConfigError: secret "redis-creds" not found',
    ]


def test_wait_polls_until_ready_and_prints_changes():
    snaps = iter([
        snapshot([], []),
        snapshot([deployment(available=0), statefulset(ready=0)], []),
        snapshot([deployment(available=0), statefulset(ready=0)], []),  # unchanged: not printed again
        snapshot([deployment(), statefulset(ready=1)], []),
        snapshot([deployment(), statefulset()], []),
    ])
    printed, now = [], [0.0]
    assert wait(lambda: next(snaps), timeout_s=60, interval_s=5, out=printed.append, clock=lambda: now[0],
                sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert printed[0].startswith("... no Deployment")
    assert printed[1].split("\n") == ["... Deployment/demo-kvcascade-router: 0/2 replicas available",
                                      "... StatefulSet/demo-kvcascade-worker: 0/2 pods ready"]
    assert printed[-1] == "release ready" and len(printed) == 5 and now[0] == 20


def test_wait_gives_up_on_timeout_and_on_failure():
    unschedulable = {"metadata": {"name": "w-0"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no GPU"}]}}
    stuck = snapshot([statefulset(ready=0)], [unschedulable])
    printed, now = [], [0.0]
    assert not wait(lambda: stuck, timeout_s=30, interval_s=10, out=printed.append, clock=lambda: now[0],
                    sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert "  ! pod/w-0: Unschedulable: no GPU" in printed[0] and printed[-1] == "not ready after 30s"
    failed = Snapshot([Readiness("Deployment", "d", False, "rollout failed", True)], [])
    assert not wait(lambda: failed, timeout_s=600, out=printed.append, sleep=pytest.fail)


def test_readiness_of_objects_from_the_kubernetes_client():
    """The judges read the dicts the client's serializer makes of its models (camelCase)."""
    from kubernetes import client

    dep = client.V1Deployment(
        metadata=client.V1ObjectMeta(name="demo-kvcascade-router", generation=2),
        spec=client.V1DeploymentSpec(replicas=2, selector=client.V1LabelSelector(match_labels={"a": "b"}),
                                     template=client.V1PodTemplateSpec()),
        status=client.V1DeploymentStatus(observed_generation=2, updated_replicas=2, replicas=2, available_replicas=1))
    reader = ClusterReader.__new__(ClusterReader)  # no cluster: only its serializer
    reader.api = client.ApiClient()
    (obj,) = reader._dicts(client.V1DeploymentList(items=[dep]), "Deployment")
    assert readiness(obj) == Readiness("Deployment", "demo-kvcascade-router", False, "1/2 replicas available")


@pytest.mark.parametrize("variant", ["default", "kuberay"])
def test_the_selector_finds_every_workload_of_the_chart(variant):
    r = render(VARIANTS[variant])
    selector = dict(part.split("=") for part in release_selector(RELEASE).split(","))
    workloads = [o for o in r.objects if o["kind"] in ("Deployment", "StatefulSet", "RayCluster")]
    assert {o["kind"] for o in workloads} >= {"Deployment", "StatefulSet"}
    for obj in workloads:
        assert selector.items() <= obj["metadata"]["labels"].items()
    for _, template in r.pod_templates():  # pod problems are found by the same selector
        assert selector.items() <= template["metadata"]["labels"].items()


def test_cli_needs_a_release():
    with pytest.raises(SystemExit):
        main(["wait", "--namespace", "serving"])


def test_without_a_cluster_it_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["wait", "--release", RELEASE]) == 2
    assert "no Kubernetes cluster to talk to" in capsys.readouterr().err
