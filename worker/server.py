"""Expose one engine over gRPC: the KVCascade service, grpc.health.v1 and server reflection.

The server is a thin translation layer: proto request -> engine call -> proto responses, and
engine errors -> gRPC status codes. It holds no request state of its own; the engine does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from contracts.chat import template_inputs
from contracts.models import resolve_model
from contracts.grpc_server import INTERNAL_MESSAGE_BYTES, SERVICE_NAME, GrpcServer
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from worker.engine.async_engine import AsyncEngine
from worker.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from worker.engine.generation_config import sampling_defaults
from worker.engine.outputs import RequestOutput
from worker.engine.sampling_params import SamplingParams, StructuredOutput

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)
__all__ = ["SERVICE_NAME", "InProcessStub", "WorkerServer", "WorkerServicer", "serve"]


# --- proto <-> engine translation -------------------------------------------------------------


def _field_path(engine_field: str) -> str:
    """The proto path of a field the engine complained about, so clients can find it."""
    return f"sampling.{engine_field}" if engine_field.split(".")[0] in _SAMPLING_FIELDS else engine_field


def _prompt_kwargs(request: pb.GenerateRequest) -> dict[str, Any]:
    """The engine's prompt argument for whichever member of the ``prompt`` oneof is set."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", "set one of text, token_ids or messages")
    if kind == "text":
        return {"prompt": request.text}
    if kind == "token_ids":
        return {"prompt_token_ids": list(request.token_ids.ids)}
    try:
        messages, tools = template_inputs(request.messages)
    except ValueError as exc:
        raise InvalidRequestError("tools", f"not a JSON array of tools: {exc}") from None
    return {"messages": messages, **({"tools": tools} if tools else {})}


def _sampling_params(sampling: pb.SamplingParams, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """Only the fields the client set are passed on, over ``defaults`` (the model's generation
    config), so SamplingParams keeps the one set of defaults for the rest.

    ListFields() yields optional fields that are present and plain fields that are non-zero; the
    zero of every plain field (no stops, ignore_eos false) equals the engine default.
    """
    kwargs: dict[str, Any] = {}
    for descriptor, value in sampling.ListFields():
        if descriptor.name == "structured_output":
            kwargs[descriptor.name] = _structured_output(value)
        elif descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
            kwargs[descriptor.name] = dict(value)
        else:
            kwargs[descriptor.name] = list(value) if descriptor.is_repeated else value
    if kwargs.get("max_tokens") == 0:  # until the context ends
        kwargs["max_tokens"] = None
    return SamplingParams(**{**(defaults or {}), **kwargs})


def _structured_output(msg: pb.StructuredOutput) -> StructuredOutput | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput(kind, choices=tuple(msg.choice.choices))
    if kind == "json_object":
        return StructuredOutput(kind) if msg.json_object else None
    return StructuredOutput(kind, getattr(msg, kind))


def _response(out: RequestOutput) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids, text=out.text_delta)
    for lp in out.logprobs or ():
        top = [pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top]
        response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, top=top)
    for lp in out.prompt_logprobs or ():
        top = [pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top]
        response.prompt_logprobs.add(token_id=lp.token_id, logprob=lp.logprob, top=top)
    if out.finished:
        response.finish_reason = out.finish_reason or ""
        if out.usage is not None:
            response.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=out.usage.prompt_tokens,
                    cached_tokens=out.usage.cached_tokens,
                    completion_tokens=out.usage.completion_tokens,
                )
            )
        if out.ttft_s is not None:
            response.ttft_s = out.ttft_s
        if out.error:
            response.error = out.error
    return response


def _status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed request ends with."""
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"{_field_path(exc.field)}: {exc.message}"
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc) or "the request queue is full"
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(exc) or "the engine has stopped"
    logger.exception("request failed with an unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


# --- the service ------------------------------------------------------------------------------


class WorkerServicer(pb_grpc.KVCascadeServicer):
    """The KVCascade service backed by one engine: an EngineCoreClient (the engine in its own
    process) or an AsyncEngine (in this one); they share one interface."""

    def __init__(self, engine: AsyncEngine):
        self._engine = engine
        config = engine.config
        source = resolve_model(config.model)
        self._defaults = sampling_defaults(config.generation_config, source.path, source.kind, config.tokenizer)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # A coroutine handler writing with context.write (rather than an async generator handler)
        # so that a cancelled call raises CancelledError *here*, and closing the responses below
        # closes the engine stream at once instead of whenever it is garbage collected.
        try:
            async with contextlib.aclosing(self.responses(request)) as responses:
                async for msg in responses:
                    await context.write(msg)
        except Exception as exc:
            code, details = _status_for(exc)
            if not context.done():
                await context.abort(code, details)

    async def responses(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """A Generate call's messages; a bad request raises the engine's error (``_status_for``
        says its gRPC status). Closing it early aborts the request in the engine and frees its
        KV blocks."""
        if request.model and request.model != self._engine.model_id:
            raise InvalidRequestError("model", f"this server serves {self._engine.model_id!r}, not {request.model!r}")
        outputs = self._engine.generate(
            request.request_id or uuid.uuid4().hex,
            **_prompt_kwargs(request),
            params=_sampling_params(request.sampling, self._defaults),
        )
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield _response(out)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        stats = self._engine.stats()
        return pb.StatsResponse(
            running=stats.running,
            waiting=stats.waiting,
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_free=stats.kv_blocks_free,
            prefix_hit_rate=stats.prefix_hit_rate,
            prefix_queries=stats.prefix_queries,
            prefix_hits=stats.prefix_hits,
            block_size=stats.block_size,
            model=self._engine.model_id,
            spec_drafted_tokens=stats.spec_drafted,
            spec_accepted_tokens=stats.spec_accepted,
            spec_verifications=stats.spec_verifications,
        )


# --- the server -------------------------------------------------------------------------------


class WorkerServer(GrpcServer):
    """A grpc.aio server for one engine; healthy while the engine loop runs."""

    def __init__(self, engine: AsyncEngine, host: str = "127.0.0.1", port: int = 50051, *, health_poll_s: float = 1.0):
        super().__init__(WorkerServicer(engine), engine.is_healthy, host, port, health_poll_s=health_poll_s,
                         max_message_bytes=INTERNAL_MESSAGE_BYTES)
        self.engine = engine


async def serve(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 50051) -> WorkerServer:
    """Start serving ``engine`` on host:port (port 0: a free one, see ``.port``)."""
    server = WorkerServer(engine, host, port)
    await server.start()
    return server


# --- the same service without the network ----------------------------------------------------


class InProcessStub:
    """A KVCascade stub for a worker in the caller's process (`kvcascade serve`'s router and its
    embedded workers): Generate calls the servicer directly instead of over loopback gRPC, which
    costs a server write, HTTP/2 framing and a client read per message per request in the one
    process that also runs the router's fronts. The call behaves as grpc.aio's does where the
    router looks: messages by ``async for``, ``cancel()``, a deadline from ``timeout``, and a failed
    request as ``grpc.aio.AioRpcError`` with the status the gRPC server would have sent."""

    def __init__(self, servicer: WorkerServicer):
        self.servicer = servicer

    def Generate(self, request: pb.GenerateRequest, timeout: float | None = None, **_: Any) -> InProcessCall:
        return InProcessCall(self.servicer.responses(request), timeout)


class InProcessCall:
    def __init__(self, responses: AsyncIterator[pb.GenerateResponse], timeout: float | None):
        self._responses = responses
        self._deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        self._messages_iter: AsyncIterator[pb.GenerateResponse] | None = None
        self._closing: asyncio.Task | None = None

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        if self._messages_iter is None:
            self._messages_iter = self._messages()
        return self._messages_iter

    async def _messages(self) -> AsyncIterator[pb.GenerateResponse]:
        try:
            while True:
                try:
                    async with asyncio.timeout_at(self._deadline):
                        msg = await anext(self._responses)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
                except Exception as exc:
                    raise _rpc_error(*_status_for(exc)) from None
                yield msg
        finally:
            await self._responses.aclose()

    def cancel(self) -> bool:
        """Like a gRPC call's: ends the request (the engine frees its blocks) unless it is over.
        Closing runs as a task of its own, since a caller that stops reading holds no await."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close())
        return True

    async def _close(self) -> None:
        with contextlib.suppress(RuntimeError):  # still being read: the reader's own end closes it
            await (self._messages_iter or self._responses).aclose()


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
