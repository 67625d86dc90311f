"""Security: non-root pods with read-only roots and no capabilities, Secrets only by reference,
and network policies that let only the router reach the workers and only router and workers
reach Redis."""

from __future__ import annotations

import re

import pytest

from tests.helm.chart import PREFIX, VARIANTS, Obj, Rendered, containers, matches, render


def test_pods_run_non_root_read_only_without_capabilities(rendered):
    for owner, template, c in containers(rendered):
        pod_sc = template["spec"].get("securityContext", {})
        sc = c.get("securityContext", {})
        assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, owner
        assert sc.get("runAsUser", pod_sc.get("runAsUser", 0)) != 0, owner
        assert sc["readOnlyRootFilesystem"] is True, owner
        assert sc["allowPrivilegeEscalation"] is False, owner
        assert sc["capabilities"] == {"drop": ["ALL"]}, owner
        assert not sc.get("privileged"), owner
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, owner
        assert template["spec"]["automountServiceAccountToken"] is False, owner
        assert not template["spec"].get("hostNetwork") and not template["spec"].get("hostPID"), owner


def test_secret_references_resolve(rendered):
    secrets = {s["metadata"]["name"]: s for s in rendered.all("Secret")}
    values = rendered.values
    external = {values["redis"]["external"]["existingSecret"], values["router"]["apiKeys"]["existingSecret"],
                values["router"]["tls"]["secretName"]}
    for owner, template, _ in containers(rendered):
        for v in template["spec"].get("volumes", []):
            if "secret" in v:  # mounted read-only, and the chart's or the user's
                name = v["secret"]["secretName"]
                assert name in secrets or name in external - {""}, f"{owner}: volume Secret {name} is not given"
                assert all(m.get("readOnly") for c in template["spec"]["containers"]
                           for m in c.get("volumeMounts", []) if m["name"] == v["name"]), owner
    for owner, _, c in containers(rendered):
        for e in c.get("env", []):
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref is None:
                continue
            if ref["name"] in secrets:
                assert ref["key"] in secrets[ref["name"]]["data"], f"{owner}: Secret {ref['name']} lacks {ref['key']}"
            else:
                assert ref["name"] in external - {""}, f"{owner}: Secret {ref['name']} is neither rendered nor given"


def test_no_secret_value_in_a_command_or_plain_env(rendered):
    values = {rendered.secret_value(s["metadata"]["name"], k) for s in rendered.all("Secret") for k in s["data"]}
    for owner, _, c in containers(rendered):
        plain = [e.get("value", "") for e in c.get("env", [])] + c.get("command", []) + c.get("args", [])
        for text in plain:
            for secret in values:
                for part in secret.split(","):
                    assert part not in text, f"{owner}/{c['name']} carries a secret in plain text"


def test_bundled_redis_password_is_random_and_url_safe():
    first, second = (render().secret_value(f"{PREFIX}-redis", "redis-password") for _ in range(2))
    assert first != second and re.fullmatch(r"[A-Za-z0-9]{32}", first)  # (a live install keeps its own: lookup)


def _allowed(rendered: Rendered, source: Obj | None, dest: Obj, port: str) -> bool:
    """Whether the policies let ``source`` (a pod template in the release; None: outside it) reach
    ``dest`` on its named port, as a CNI enforcing NetworkPolicy would decide."""
    labels = dest["metadata"]["labels"]
    policies = [p for p in rendered.all("NetworkPolicy")
                if "Ingress" in p["spec"]["policyTypes"] and matches(p["spec"]["podSelector"], labels)]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and not any(p["port"] == port for p in rule["ports"]):
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                if set(peer) == {"podSelector"} and source is not None:
                    if matches(peer["podSelector"], source["metadata"]["labels"]):
                        return True
                elif set(peer) != {"podSelector"} and source is None:
                    return True  # a namespace or IP peer: some pods outside the release
    return False


def test_network_policies(rendered):
    if not rendered.values["networkPolicy"]["enabled"]:
        pytest.skip("network policies disabled")
    pods = {component: rendered.pods(component) for component in ("router", "worker", "redis", "ray-head")}
    router, worker = pods["router"][0], pods["worker"][0]
    kuberay = rendered.values["workers"]["kuberay"]["enabled"]
    for port in ("grpc", "http"):
        assert _allowed(rendered, None, router, port)  # clients (networkPolicy.routerFrom, default anyone)
    # Only the router reaches workers (and, with KubeRay, the Ray cluster's own pods each other).
    assert _allowed(rendered, router, worker, "grpc")
    assert not _allowed(rendered, None, worker, "grpc")
    assert _allowed(rendered, worker, worker, "grpc") == kuberay
    for redis in pods["redis"]:
        assert _allowed(rendered, router, redis, "redis") and _allowed(rendered, worker, redis, "redis")
        assert not _allowed(rendered, None, redis, "redis")
        for head in pods["ray-head"]:
            assert not _allowed(rendered, head, redis, "redis")
    for head in pods["ray-head"]:
        assert _allowed(rendered, worker, head, "gcs") and not _allowed(rendered, None, head, "gcs")
        assert not _allowed(rendered, router, head, "gcs")


def test_router_clients_can_be_restricted():
    r = render(VARIANTS["everything"])
    router = r.pods("router")[0]
    policy = r.one("NetworkPolicy", f"{PREFIX}-router")
    assert policy["spec"]["ingress"][0]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    assert not _allowed(r, r.pods("worker")[0], router, "http")
    assert render({"networkPolicy": {"enabled": False}}).all("NetworkPolicy") == []
