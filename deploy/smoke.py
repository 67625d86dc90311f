"""Send one completion through a release's router: ``python -m deploy.smoke --release R --namespace N``.

Without ``--url`` it port-forwards to a ready router pod through the Kubernetes API (no
kubectl needed); inside the cluster give ``--url http://<router service>:<http port>``. The
API key, when the release requires one, comes from ``--api-key``, ``$KVCASCADE_API_KEY`` or
the Secret named by ``--api-key-secret NAME[:KEY]``. Exit status 0 when a completion came back.

Building the request and reading the answer are pure functions (tested without a cluster and
against a real router on loopback); the port-forward is the only cluster call.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import select
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]


@dataclass(frozen=True)
class Completion:
    status: int
    body: Obj

    @property
    def ok(self) -> bool:
        return self.status == 200 and bool(self.body.get("choices"))

    @property
    def text(self) -> str:
        return self.body["choices"][0].get("text", "") if self.ok else ""

    def summary(self) -> str:
        if not self.ok:
            error = self.body.get("error", {}) if isinstance(self.body, dict) else {}
            return f"HTTP {self.status}: {error.get('message') or json.dumps(self.body)[:300]}"
        usage = self.body.get("usage") or {}
        return (f"HTTP 200 from model {self.body.get('model')}: {self.text!r} "
                f"(prompt {usage.get('prompt_tokens')}, completion {usage.get('completion_tokens')} tokens)")


def completion_body(prompt: str, max_tokens: int, model: str | None = None) -> bytes:
    body: Obj = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if model:
        body["model"] = model
    return json.dumps(body).encode()


def headers(api_key: str | None) -> dict[str, str]:
    h = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def raw_request(body: bytes, api_key: str | None, host: str = "localhost") -> bytes:
    """POST /v1/completions as bytes for a bare socket (the port-forward stream)."""
    lines = ["POST /v1/completions HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers(api_key).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Bytes:
    """Just enough of a socket for http.client to parse a response already read."""

    def __init__(self, data: bytes):
        self._data = data

    def makefile(self, *_args: Any, **_kw: Any) -> io.BytesIO:
        return io.BytesIO(self._data)


def parse_response(data: bytes) -> Completion:
    """A whole HTTP/1.1 response (Content-Length or chunked) as a Completion."""
    if not data:
        raise ValueError("the router closed the connection without answering")
    response = http.client.HTTPResponse(_Bytes(data))  # type: ignore[arg-type]
    response.begin()
    payload = response.read()
    try:
        body = json.loads(payload) if payload else {}
    except json.JSONDecodeError:
        body = {"error": {"message": payload[:300].decode(errors="replace")}}
    return Completion(response.status, body)


def send_url(url: str, body: bytes, api_key: str | None, timeout_s: float) -> Completion:
    """POST to ``url``/v1/completions (in-cluster, or anything reachable)."""
    request = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=body, headers=headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return Completion(response.status, json.loads(response.read()))
    except urllib.error.HTTPError as err:
        payload = err.read()
        try:
            return Completion(err.code, json.loads(payload))
        except json.JSONDecodeError:
            return Completion(err.code, {"error": {"message": payload[:300].decode(errors="replace")}})


def exchange(sock: Any, request: bytes, timeout_s: float) -> bytes:
    """Write ``request`` to a connected socket and read until the server closes it."""
    sock.setblocking(True)
    sock.sendall(request)
    chunks = []
    while True:
        readable, _, _ = select.select([sock], [], [], timeout_s)
        if not readable:
            raise TimeoutError(f"no answer from the router in {timeout_s:.0f}s")
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def is_ready(pod: Obj) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pick_router_pod(pods: list[Obj]) -> Obj:
    ready = sorted((p for p in pods if is_ready(p)), key=lambda p: p["metadata"]["name"])
    if not ready:
        names = ", ".join(p["metadata"]["name"] for p in pods) or "none"
        raise LookupError(f"no ready router pod (router pods: {names}); try `python -m deploy.rollout wait`")
    return ready[0]


def container_port(pod: Obj, name: str) -> int:
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            if port.get("name") == name:
                return int(port["containerPort"])
    raise LookupError(f"pod {pod['metadata']['name']} has no container port named {name!r}")


def send_port_forward(namespace: str, release: str, body: bytes, api_key: str | None, timeout_s: float,
                      context: str | None = None) -> Completion:
    from kubernetes.stream import portforward

    from deploy.rollout import ClusterReader, release_selector

    cluster = ClusterReader(namespace, context)
    pods = cluster.pods(release_selector(release) + ",app.kubernetes.io/component=router")
    pod = pick_router_pod(pods)
    port = container_port(pod, "http")
    print(f"port-forward to pod/{pod['metadata']['name']}:{port}", file=sys.stderr)
    forward = portforward(cluster.core.connect_get_namespaced_pod_portforward, pod["metadata"]["name"],
                          namespace, ports=str(port))
    sock = forward.socket(port)
    try:
        data = exchange(sock, raw_request(body, api_key), timeout_s)
    finally:
        sock.close()
    if (error := forward.error(port)) is not None:
        raise ConnectionError(f"port-forward to {pod['metadata']['name']}:{port} failed: {error}")
    return parse_response(data)


def resolve_api_key(args: argparse.Namespace) -> str | None:
    if args.api_key:
        return args.api_key
    if os.environ.get("KVCASCADE_API_KEY"):
        return os.environ["KVCASCADE_API_KEY"]
    if args.api_key_secret:
        from deploy.rollout import ClusterReader

        name, _, key = args.api_key_secret.partition(":")
        value = ClusterReader(args.namespace, args.context).secret_value(name, key or "api-keys")
        return value.split(",")[0].strip()  # the Secret holds KVCASCADE_API_KEYS: comma-separated
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", help="release name (needed without --url)")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument("--url", help="router base URL, e.g. http://kvc-kvcascade-router.serving.svc:8000")
    parser.add_argument("--api-key", help="API key (default: $KVCASCADE_API_KEY)")
    parser.add_argument("--api-key-secret", metavar="NAME[:KEY]", help="read the API key from this Secret")
    parser.add_argument("--model", help="model id (default: any live worker's)")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.url and not args.release:
        parser.error("give --release (port-forward through the Kubernetes API) or --url")
    from deploy.rollout import NoCluster

    body = completion_body(args.prompt, args.max_tokens, args.model)
    try:
        key = resolve_api_key(args)
        if args.url:
            result = send_url(args.url, body, key, args.timeout)
        else:
            result = send_port_forward(args.namespace, args.release, body, key, args.timeout, args.context)
    except (NoCluster, LookupError, OSError, ValueError) as err:  # OSError: refused, reset, timed out
        print(f"smoke request failed: {err}", file=sys.stderr)
        return 2 if isinstance(err, NoCluster) else 1
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
