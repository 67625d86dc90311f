"""The two ways to talk to a kvcascade deployment (or any OpenAI-style server): the KVCascade
gRPC service through grpc.aio, and OpenAI-style HTTP with streaming server-sent events.

Each client sends one workload request, streams the answer and fills in the request's record:
TTFT at the first message carrying a token, usage (prompt, cached and completion tokens) from
the last message, and, when the server says, which worker answered and which cascade tier.

Cascade fields: gRPC ``GenerateResponse.tier`` / ``.escalated`` / ``.tier_usage`` once the proto
has them; over HTTP, top-level ``tier`` / ``escalated`` / ``tier_usage`` (and ``worker_id``) keys on
any chunk. A server that sends none leaves them unset, and the report says n/a.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import httpx

from loadtest.metrics import RequestRecord
from loadtest.scenario import Scenario
from loadtest.workload import Request
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc

PROTOCOLS = ("grpc", "http")


@dataclass(frozen=True)
class Target:
    name: str
    protocol: str  # grpc | http
    address: str  # host:port for gRPC, the base URL (no /v1) for HTTP

    def __str__(self) -> str:
        return f"grpc://{self.address}" if self.protocol == "grpc" else self.address


def parse_target(spec: str, default_protocol: str | None = None) -> Target:
    """``[NAME=]grpc://host:port``, ``[NAME=]http://host:port[/v1]`` or ``[NAME=]host:port`` (then
    the scenario's protocol, else gRPC). The scheme, when given, decides the protocol."""
    name, sep, rest = spec.partition("=")
    if not sep or ":" in name or "/" in name:
        name, rest = "", spec
    scheme, sep, address = rest.partition("://")
    if not sep:
        scheme, address = default_protocol or "grpc", rest
    if scheme not in ("grpc", "http", "https"):
        raise ValueError(f"target {spec!r}: unknown scheme {scheme!r} (use grpc://, http:// or https://)")
    address = address.rstrip("/")
    if not address:
        raise ValueError(f"target {spec!r}: no address")
    if scheme == "grpc":
        return Target(name or address, "grpc", address)
    base = f"{scheme}://{address.removesuffix('/v1')}"
    return Target(name or address, "http", base)


class Client(Protocol):
    async def send(self, req: Request, rec: RequestRecord) -> str:
        """Send ``req``, fill in ``rec`` (status, timings, usage); return the answer's text."""

    async def aclose(self) -> None: ...


def make_client(target: Target, scenario: Scenario, api_key: str | None = None) -> Client:
    if target.protocol == "grpc":
        return GrpcClient(target.address, scenario, api_key)
    return HttpClient(target.address, scenario, api_key)


def tier_tokens(usages: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]] | None:
    """A cascade's ``tier_usage`` entries as the tokens each tier computed, by role: prompt tokens
    not served from its cache plus completion tokens, so a judge's prefill counts and a cache hit
    does not. None for no entries (no cascade answered)."""
    by_tier: dict[str, Counter[str]] = {}
    for u in usages:
        computed = (u.get("prompt_tokens") or 0) - (u.get("cached_tokens") or 0) + (u.get("completion_tokens") or 0)
        by_tier.setdefault(str(u.get("tier", "")), Counter())[str(u.get("role", ""))] += computed
    return {tier: dict(roles) for tier, roles in by_tier.items()} or None


def _seed(scenario: Scenario, req: Request) -> int | None:
    """A per-request sampling seed, so a sampled (temperature > 0) run repeats too."""
    if scenario.sampling.temperature == 0:
        return None
    return (scenario.seed * 1_000_003 + req.session * 1_009 + req.turn) % 2**63


class GrpcClient:
    def __init__(self, address: str, scenario: Scenario, api_key: str | None = None):
        self.scenario = scenario
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.KVCascadeStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        fields = pb.GenerateResponse.DESCRIPTOR.fields_by_name
        self.has_tier, self.has_escalated = "tier" in fields, "escalated" in fields
        self.has_tier_usage = "tier_usage" in fields

    def _message(self, req: Request) -> pb.GenerateRequest:
        s = self.scenario.sampling
        sampling = pb.SamplingParams(max_tokens=req.max_tokens, temperature=s.temperature, ignore_eos=s.ignore_eos)
        if (seed := _seed(self.scenario, req)) is not None:
            sampling.seed = seed
        msg = pb.GenerateRequest(model=self.scenario.model, sampling=sampling)
        if self.scenario.api == "chat":
            for m in req.messages:
                msg.messages.messages.add(role=m["role"], content=m["content"])
        else:
            msg.text = req.as_text()
        return msg

    async def send(self, req: Request, rec: RequestRecord) -> str:
        parts: list[str] = []
        t0 = time.perf_counter()
        # No gRPC deadline: the runner's per-request bound cancels the call, so both protocols
        # report a slow request the same way ("timeout").
        call = self.stub.Generate(self._message(req), metadata=self.metadata)
        try:
            async for msg in call:
                if msg.token_ids and rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - t0
                parts.append(msg.text)
                rec.output_tokens += len(msg.token_ids)
                if msg.finish_reason:
                    self._last(msg, rec)
        except grpc.aio.AioRpcError as err:
            rec.status, rec.error = err.code().name, err.details() or ""
            return ""
        finally:
            call.cancel()  # a no-op once done; frees the server's request when we were cancelled
        rec.e2e_s = time.perf_counter() - t0
        if not rec.finish_reason:
            rec.status, rec.error = "incomplete", "the stream ended without a finish reason"
        return "".join(parts)

    def _last(self, msg: pb.GenerateResponse, rec: RequestRecord) -> None:
        rec.finish_reason = msg.finish_reason
        if msg.finish_reason in ("error", "abort"):
            rec.status, rec.error = f"finish_{msg.finish_reason}", msg.error
        u = msg.usage
        rec.prompt_tokens, rec.cached_tokens = u.prompt_tokens, u.cached_tokens
        rec.output_tokens = u.completion_tokens or rec.output_tokens
        rec.worker_id = msg.worker_id or None
        rec.server_ttft_s = msg.ttft_s or None
        tier = getattr(msg, "tier", "") if self.has_tier else ""
        if tier:  # no tier: no cascade answered, so "not escalated" would say nothing
            rec.tier = tier
            rec.escalated = bool(msg.escalated) if self.has_escalated else None
        if self.has_tier_usage:
            rec.tier_tokens = tier_tokens({f.name: getattr(u, f.name) for f in u.DESCRIPTOR.fields}
                                          for u in msg.tier_usage)

    async def aclose(self) -> None:
        await self.channel.close()


class HttpClient:
    def __init__(self, base_url: str, scenario: Scenario, api_key: str | None = None):
        self.scenario = scenario
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # The per-request bound is the runner's; httpx's timeouts only catch a silent server.
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers,
                                      timeout=httpx.Timeout(scenario.timeout_s, connect=min(10.0, scenario.timeout_s)),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self.chat = scenario.api == "chat"

    def _body(self, req: Request) -> dict[str, Any]:
        s = self.scenario.sampling
        body: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": s.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if s.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension; kvcascade accepts it too
        if self.scenario.model:
            body["model"] = self.scenario.model
        if (seed := _seed(self.scenario, req)) is not None:
            body["seed"] = seed
        if self.chat:
            body["messages"] = req.messages
        else:
            body["prompt"] = req.as_text()
        return body

    async def send(self, req: Request, rec: RequestRecord) -> str:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        parts: list[str] = []
        chunks = 0
        t0 = time.perf_counter()
        try:
            async with self.http.stream("POST", path, json=self._body(req)) as resp:
                if resp.status_code != 200:
                    rec.status, rec.error = f"HTTP {resp.status_code}", _error_message(await resp.aread())
                    return ""
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        err = chunk["error"] or {}
                        rec.status, rec.error = f"stream {err.get('code') or 'error'}", str(err.get("message", ""))
                        return ""
                    self._extensions(chunk, rec)
                    if choices := chunk.get("choices"):
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - t0
                        c = choices[0]
                        piece = c.get("text") if not self.chat else (c.get("delta") or {}).get("content")
                        if piece:
                            parts.append(piece)
                            chunks += 1
                        rec.finish_reason = c.get("finish_reason") or rec.finish_reason
                    if usage := chunk.get("usage"):
                        rec.prompt_tokens = usage.get("prompt_tokens")
                        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                        rec.output_tokens = usage.get("completion_tokens") or 0
        except httpx.ConnectError as err:
            rec.status, rec.error = "connection_error", str(err)
            return ""
        except httpx.TimeoutException as err:
            rec.status, rec.error = "timeout", f"{type(err).__name__}: {err}"
            return ""
        except (httpx.HTTPError, json.JSONDecodeError) as err:
            rec.status, rec.error = type(err).__name__, str(err)
            return ""
        rec.e2e_s = time.perf_counter() - t0
        rec.output_tokens = rec.output_tokens or chunks  # a server without usage: count chunks
        if not rec.finish_reason:
            rec.status, rec.error = "incomplete", "the stream ended without a finish reason"
        return "".join(parts)

    @staticmethod
    def _extensions(chunk: dict[str, Any], rec: RequestRecord) -> None:
        if chunk.get("worker_id"):
            rec.worker_id = str(chunk["worker_id"])
        if chunk.get("worker_ttft_s"):
            rec.server_ttft_s = float(chunk["worker_ttft_s"])
        if chunk.get("tier"):
            rec.tier = str(chunk["tier"])
        if chunk.get("escalated") is not None:
            rec.escalated = bool(chunk["escalated"])
        if chunk.get("tier_usage"):
            rec.tier_tokens = tier_tokens(chunk["tier_usage"])

    async def aclose(self) -> None:
        await self.http.aclose()


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:200]
