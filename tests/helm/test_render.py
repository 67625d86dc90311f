"""The chart as Helm renders it for each value set in VARIANTS: lint, the Kubernetes schemas
(strict, for 1.30 and the newest kubernetes-validate knows), the objects and how they select
each other: workloads and their pods, Services and ports, budgets, the autoscaler, monitoring."""

from __future__ import annotations

import helm_python as helm
import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from tests.helm.chart import CHART, NAMESPACE, PREFIX, RELEASE, VARIANTS, Obj, container_ports, matches, render

KUBE_VERSIONS = ["1.30.0", latest_version()]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint_is_clean(variant, kube_version):
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace=NAMESPACE, kube_version=f"v{kube_version}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error; 1 info
    assert not report["errors"] and not problems, report


# Custom resources have no schema in kubernetes-validate: their pod templates are checked as
# core PodTemplates, and the fields we set against this much of the CRDs (ray.io/v1 RayCluster,
# monitoring.coreos.com/v1 ServiceMonitor).
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_SECRET_KEY = {"type": "object", "additionalProperties": False, "required": ["key"],
               "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}}}
_CRD_SCHEMAS = {
    "RayCluster": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "ray.io/v1"},
            "spec": {
                "type": "object", "additionalProperties": False, "required": ["headGroupSpec"],
                "properties": {
                    "rayVersion": {"type": "string"},
                    "enableInTreeAutoscaling": {"type": "boolean"},
                    "headGroupSpec": {"type": "object", "additionalProperties": False, "required": ["template"],
                                      "properties": {"rayStartParams": _STR_MAP, "template": {"type": "object"},
                                                     "serviceType": {"type": "string"}}},
                    "workerGroupSpecs": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["groupName", "template"],
                        "properties": {"groupName": {"type": "string"}, "replicas": {"type": "integer"},
                                       "minReplicas": {"type": "integer"}, "maxReplicas": {"type": "integer"},
                                       "rayStartParams": _STR_MAP, "template": {"type": "object"}}}},
                },
            },
        },
    },
    "ServiceMonitor": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "spec": {
                "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {"type": "object"},
                    "namespaceSelector": {"type": "object", "additionalProperties": False,
                                          "properties": {"any": {"type": "boolean"},
                                                         "matchNames": {"type": "array", "items": {"type": "string"}}}},
                    "endpoints": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"}, "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scheme": {"enum": ["http", "https"]},
                            "tlsConfig": {"type": "object", "additionalProperties": False, "properties": {
                                "serverName": {"type": "string"}, "insecureSkipVerify": {"type": "boolean"},
                                "ca": {"type": "object", "additionalProperties": False,
                                       "properties": {"secret": _SECRET_KEY, "configMap": _SECRET_KEY}}}},
                            "authorization": {"type": "object", "additionalProperties": False,
                                              "properties": {"type": {"type": "string"}, "credentials": _SECRET_KEY}},
                        }}},
                },
            },
        },
    },
}


def _validate(obj: Obj, version: str) -> None:
    if obj["kind"] not in _CRD_SCHEMAS:
        kubernetes_validate.validate(obj, version, strict=True)
        return
    import jsonschema

    jsonschema.validate(obj, _CRD_SCHEMAS[obj["kind"]])
    # The object's metadata, and each pod template, against the core schemas.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, version,
                                 strict=True)
    templates = ([obj["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in obj["spec"]["workerGroupSpecs"]]
                 if obj["kind"] == "RayCluster" else [])
    for template in templates:
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, version, strict=True)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_object_is_valid_kubernetes(rendered, kube_version):
    assert rendered.objects
    for obj in rendered.objects:
        try:
            _validate(obj, kube_version)
        except Exception as err:  # name the object: the validator does not
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} invalid for {kube_version}: {err}") from err


def test_strict_validation_catches_a_misspelt_field():
    obj = render().one("Deployment", f"{PREFIX}-router")
    obj["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, KUBE_VERSIONS[0], strict=True)


def test_names_are_unique_and_labelled(rendered):
    assert len(rendered.names()) == len(rendered.objects)
    for obj in rendered.objects:
        labels = obj["metadata"]["labels"]
        assert obj["metadata"]["name"].startswith(RELEASE), obj["metadata"]["name"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/part-of"] == "kvcascade"  # what deploy.rollout selects on
        assert len(obj["metadata"]["name"]) <= 63


def test_default_objects():
    r = render()
    assert r.names() == {
        f"ServiceAccount/{PREFIX}",
        f"Deployment/{PREFIX}-router", f"Service/{PREFIX}-router", f"HorizontalPodAutoscaler/{PREFIX}-router",
        f"PodDisruptionBudget/{PREFIX}-router", f"NetworkPolicy/{PREFIX}-router",
        f"StatefulSet/{PREFIX}-worker", f"Service/{PREFIX}-worker", f"PodDisruptionBudget/{PREFIX}-worker",
        f"NetworkPolicy/{PREFIX}-worker",
        f"StatefulSet/{PREFIX}-redis", f"Service/{PREFIX}-redis", f"Secret/{PREFIX}-redis",
        f"NetworkPolicy/{PREFIX}-redis",
    }
    assert "deploy.rollout wait --release demo --namespace serving" in r.notes
    assert f"port-forward svc/{PREFIX}-router 8000:8000" in r.notes


def test_workload_selectors_match_their_pods(rendered):
    for obj in rendered.all("Deployment") + rendered.all("StatefulSet"):
        assert matches(obj["spec"]["selector"], obj["spec"]["template"]["metadata"]["labels"])
    for sts in rendered.all("StatefulSet"):
        assert rendered.get("Service", sts["spec"]["serviceName"]), f"{sts['metadata']['name']}: no governing Service"


def test_services_select_pods_with_their_ports(rendered):
    templates = [t for _, t in rendered.pod_templates()]
    for svc in rendered.all("Service"):
        pods = [t for t in templates if matches(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        for pod in pods:
            named = container_ports(pod)
            for port in svc["spec"]["ports"]:
                assert port["targetPort"] in named, f"{svc['metadata']['name']}: no container port {port['targetPort']}"
                assert named[port["targetPort"]] == port["port"]  # the same number inside and out


def test_disruption_budgets_and_autoscaler_point_at_workloads(rendered):
    for pdb in rendered.all("PodDisruptionBudget"):
        assert any(matches(pdb["spec"]["selector"], t["metadata"]["labels"]) for _, t in rendered.pod_templates())
    router = rendered.one("Deployment", f"{PREFIX}-router")
    hpa = rendered.get("HorizontalPodAutoscaler", f"{PREFIX}-router")
    autoscaling = rendered.values["router"]["autoscaling"]
    if autoscaling["enabled"]:
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": router["metadata"]["name"]}
        assert "replicas" not in router["spec"]  # the HPA owns it; a fixed count would fight it on upgrade
        assert router["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    else:
        assert hpa is None
        assert router["spec"]["replicas"] == rendered.values["router"]["replicas"]


def test_service_monitor_scrapes_the_router_metrics():
    r = render(VARIANTS["service-monitor"])
    sm = r.one("ServiceMonitor", f"{PREFIX}-router")
    svc = r.one("Service", f"{PREFIX}-router")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert matches(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [("http", "/metrics")]
    assert "http" in {p["name"] for p in svc["spec"]["ports"]}
    # Plain http and no key: the router's /metrics is open unless router.metrics.protect.
    assert not {"scheme", "tlsConfig", "authorization"} & set(sm["spec"]["endpoints"][0])
    assert render().all("ServiceMonitor") == []


def _scrape(values: Obj) -> Obj:
    return render(values).one("ServiceMonitor", f"{PREFIX}-router")["spec"]["endpoints"][0]


def test_service_monitor_scrapes_https_and_verifies_the_certificate():
    endpoint = _scrape(VARIANTS["tls"])
    assert endpoint["scheme"] == "https"
    # Scrapes reach pod IPs: the certificate is checked for the Service's name, against the CA given.
    assert endpoint["tlsConfig"] == {"serverName": f"{PREFIX}-router.{NAMESPACE}.svc",
                                     "ca": {"secret": {"name": "router-tls", "key": "ca.crt"}}}
    # No CA: the system roots; skipping verification only when asked for.
    assert _scrape({"router": {"tls": {"enabled": True, "secretName": "t"}}, "serviceMonitor": {"enabled": True}})[
        "tlsConfig"] == {"serverName": f"{PREFIX}-router.{NAMESPACE}.svc"}
    assert _scrape(VARIANTS["everything"])["tlsConfig"] == {"serverName": "router.example.internal",
                                                            "insecureSkipVerify": True}


def test_service_monitor_sends_a_key_to_protected_metrics():
    endpoint = _scrape(VARIANTS["protected-metrics"])
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "prometheus-key", "key": "api-key"}}
    assert "scheme" not in endpoint
    assert _scrape(VARIANTS["everything"])["authorization"]["credentials"] == {"name": "prometheus-key", "key": "key"}


def test_the_cascade_configmap_holds_a_file_the_router_loads_with_its_route(tmp_path):
    """cascade.files puts a tier's prompt router beside cascade.yaml, where `route` finds it."""
    import json
    from pathlib import Path

    import yaml

    from router.cascade_config import load_cascade
    from router.prompt_router import PromptRouter

    config = yaml.safe_load((Path(CHART).parents[1] / "deploy" / "cascade.example.yaml").read_text())
    config["tiers"][0]["route"] = {"file": "small.router.json", "threshold": 0.5}
    router = PromptRouter.train(["What is the capital of Peru?", "What is 347 times 29?"], [True, False])
    r = render({"cascade": {"enabled": True, "config": config,
                            "files": {"small.router.json": json.dumps(router.to_json())}}})
    data = r.one("ConfigMap", f"{PREFIX}-router-cascade")["data"]
    assert sorted(data) == ["cascade.yaml", "small.router.json"]
    for name, content in data.items():  # as the kubelet mounts the ConfigMap
        (tmp_path / name).write_text(content)
    tier = load_cascade(tmp_path / "cascade.yaml").tiers[0]
    assert tier.route.skips("What is 812 times 77?") and not tier.route.skips("What is the capital of Chad?")
    with pytest.raises(Exception, match="cascade.yaml"):  # it would shadow the cascade file
        render({"cascade": {"enabled": True, "config": config, "files": {"cascade.yaml": "x"}}})
