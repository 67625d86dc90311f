"""Access to the router's fronts over real parts (an in-process worker on loopback, the router, its
HTTP and gRPC servers): per-client rate and concurrency limits answered 429 / RESOURCE_EXHAUSTED
with retry-after, many clients at once; the ``timeout`` field as a deadline that frees the worker's
blocks; /metrics open or behind the keys; both fronts over TLS."""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import pytest
import trustme

from contracts.memory_state import MemoryPrefixIndex
from contracts.tls import TlsFiles
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from router.access import Access
from router.grpc_api import RouterServer
from router.http_api import create_app, http_port, serve_http, stop_http
from router.limits import ClientLimiter, Limits
from router.router import Router

from .test_http_api import PROMPT, Stack, running_stack

KEYS = ("sk-alice", "sk-bob")


@pytest.fixture(scope="module")
def stack(smollm2) -> Iterator[Stack]:
    with running_stack(smollm2) as stack:
        yield stack


@dataclass
class Front:
    router: Router
    url: str  # the HTTP front's base
    grpc_address: str

    def post(self, body: dict, key: str | None = KEYS[0], *, verify=True, timeout: float = 60) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=timeout, verify=verify)

    def limited(self, reason: str) -> float:
        return self.router.metrics.registry.get_sample_value("kvcascade_requests_limited_total",
                                                             {"reason": reason}) or 0.0


@contextlib.contextmanager
def front(stack: Stack, access: Access, tls: TlsFiles | None = None) -> Iterator[Front]:
    """A router of its own over the stack's worker, with both fronts as ``access`` says."""

    async def start():
        router = Router(stack.registry, MemoryPrefixIndex())
        limiter = ClientLimiter(access.limits)
        grpc_server = RouterServer(router, "127.0.0.1", 0, access=access, limiter=limiter, tls=tls)
        await grpc_server.start()
        http, task = await serve_http(create_app(router, access=access, limiter=limiter), "127.0.0.1", 0, tls=tls)
        return router, grpc_server, http, task

    router, grpc_server, http, task = stack.loop.run(start())
    scheme = "https" if tls else "http"
    try:
        yield Front(router, f"{scheme}://127.0.0.1:{http_port(http)}", grpc_server.address)
    finally:
        stack.loop.run(stop_http(http, task))
        stack.loop.run(grpc_server.stop(0))
        stack.loop.run(router.close())


def completion(stack: Stack, max_tokens: int = 2, **extra) -> dict:
    return {"model": stack.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}


def test_a_clients_rate_limit_answers_429_with_retry_after_and_spares_other_clients(stack: Stack) -> None:
    """16 requests at once from one key against a burst of 3 (and a rate too slow to refill during
    the test): 3 answered, 13 refused 429 with retry-after and OpenAI's error shape, at once, while
    another key's requests go through; the refusals are counted."""
    with front(stack, Access(api_keys=KEYS, limits=Limits(rate=0.01, burst=3))) as f:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: f.post(completion(stack)), range(16)))
        codes = sorted(r.status_code for r in answers)
        assert codes == [200] * 3 + [429] * 13, codes
        refused = next(r for r in answers if r.status_code == 429)
        assert 90 <= int(refused.headers["retry-after"]) <= 100  # a token comes back every 100 s
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "--rate-limit" in error["message"] and KEYS[0] not in refused.text
        assert f.post(completion(stack), key=KEYS[1]).status_code == 200  # bob has a bucket of his own
        assert f.limited("rate") == 13
        assert f.post(completion(stack), key="sk-mallory").status_code == 401  # no valid key: still refused
        with grpc.insecure_channel(f.grpc_address) as channel:  # alice over gRPC is the same client
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.KVCascadeStub(channel).Generate(
                    pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=2)),
                    metadata=(("x-api-key", KEYS[0]),), timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert 90 <= int(dict(err.value.trailing_metadata())["retry-after"]) <= 100
    stack.wait_until_idle(5)


def test_a_clients_streams_under_way_are_capped_and_a_slot_comes_back_when_one_ends(stack: Stack) -> None:
    """Concurrency 2 per client, no keys (clients are addresses): two long streams hold both slots,
    a third request is refused at once over HTTP and gRPC; closing a stream frees its slot and the
    worker's blocks."""
    with front(stack, Access(limits=Limits(concurrency=2))) as f, httpx.Client(timeout=60) as client:
        body = completion(stack, max_tokens=400, ignore_eos=True, stream=True)
        with contextlib.ExitStack() as streams:
            readers = []  # kept: a line iterator dropped closes its stream
            for _ in range(2):
                response = streams.enter_context(client.stream("POST", f"{f.url}/v1/completions", json=body))
                assert response.status_code == 200
                readers.append(response.iter_lines())
                assert next(readers[-1]).startswith("data: ")  # the first event: the stream is under way
            refused = f.post(completion(stack), key=None)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert "at most 2" in refused.json()["error"]["message"]
            with grpc.insecure_channel(f.grpc_address) as channel:
                with pytest.raises(grpc.RpcError) as err:
                    list(pb_grpc.KVCascadeStub(channel).Generate(
                        pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=2)), timeout=30))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f.limited("concurrency") == 2
            assert stack.engine.stats().running == 2  # both streams still under way
        stack.wait_until_idle(10)  # the closed streams' requests were aborted, their blocks freed
        assert f.post(completion(stack), key=None).status_code == 200


def test_the_timeout_field_is_a_deadline_that_frees_the_workers_blocks(stack: Stack) -> None:
    """A long answer with ``timeout`` 1 s: 504 (non-streamed) or an error event after the first
    tokens (streamed), the worker's blocks freed; 8 at once as well; a bad timeout is 400 naming it."""
    with front(stack, Access(api_keys=KEYS)) as f:
        long = completion(stack, max_tokens=2000, ignore_eos=True, timeout=1.0)
        answer = f.post(long)
        assert answer.status_code == 504, answer.text
        assert answer.json()["error"]["type"] == "timeout"
        with httpx.stream("POST", f"{f.url}/v1/completions", json={**long, "stream": True},
                          headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["type"] == "timeout"
        assert any("choices" in json.loads(e[6:]) for e in events[:-2])  # tokens came before the deadline
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: f.post(long).status_code, range(8)))
        assert codes == [504] * 8
        stack.wait_until_idle(5)
        assert f.post(completion(stack, timeout=30)).status_code == 200  # a deadline not reached
        for bad in (0, -1, "soon", 10**9):
            response = f.post(completion(stack, timeout=bad))
            assert response.status_code == 400 and response.json()["error"]["param"] == "timeout", bad


@pytest.mark.parametrize("protect", [False, True])
def test_metrics_are_open_unless_protected_and_health_always_is(stack: Stack, protect: bool) -> None:
    with front(stack, Access(api_keys=KEYS, protect_metrics=protect)) as f:
        assert httpx.get(f"{f.url}/healthz").status_code == 200
        assert httpx.get(f"{f.url}/readyz").status_code == 200
        assert httpx.get(f"{f.url}/metrics").status_code == (401 if protect else 200)
        keyed = httpx.get(f"{f.url}/metrics", headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert keyed.status_code == 200 and "kvcascade_requests_total" in keyed.text


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[TlsFiles, trustme.CA]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    folder = tmp_path_factory.mktemp("tls")
    cert.private_key_pem.write_to_path(str(folder / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(folder / "tls.crt"))
    return TlsFiles(str(folder / "tls.crt"), str(folder / "tls.key")), ca


def test_both_fronts_serve_tls_with_the_certificate_given(stack: Stack, tls_files) -> None:
    tls, ca = tls_files
    with front(stack, Access(api_keys=KEYS), tls=tls) as f:
        assert f.url.startswith("https://")
        verify = ssl.create_default_context()
        ca.configure_trust(verify)
        with ThreadPoolExecutor(8) as pool:  # many TLS clients at once
            answers = list(pool.map(lambda _: f.post(completion(stack), verify=verify), range(8)))
        assert all(a.status_code == 200 and a.json()["usage"]["completion_tokens"] == 2 for a in answers)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            f.post(completion(stack))
        # plain HTTP to the TLS port: the server hangs up, with a close or, as often, a reset
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            httpx.post(f.url.replace("https", "http") + "/v1/completions", json=completion(stack), timeout=10)
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        with grpc.secure_channel(f.grpc_address, credentials) as channel:
            messages = list(pb_grpc.KVCascadeStub(channel).Generate(
                pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=3, temperature=0)),
                metadata=(("authorization", f"Bearer {KEYS[0]}"),), timeout=60))
        assert sum(len(m.token_ids) for m in messages) == 3
        with grpc.insecure_channel(f.grpc_address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.KVCascadeStub(channel).Generate(pb.GenerateRequest(text=PROMPT), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_files_that_are_not_there_or_not_pem_are_refused_naming_the_flag(tmp_path) -> None:
    (tmp_path / "x.crt").write_text("hello")
    with pytest.raises(ValueError, match=r"--tls-cert .*missing\.crt"):
        TlsFiles(str(tmp_path / "missing.crt"), str(tmp_path / "x.crt"))
    with pytest.raises(ValueError, match="--tls-cert .* not a PEM file"):
        TlsFiles(str(tmp_path / "x.crt"), str(tmp_path / "x.crt"))
