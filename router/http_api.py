"""The router's OpenAI-compatible HTTP front (FastAPI), so existing OpenAI clients work unchanged.

    POST /v1/completions, /v1/chat/completions   (stream: server-sent events, or one JSON answer)
    GET  /v1/models                              (the models live workers serve, their max_model_len)
    POST /tokenize, /detokenize                  (vLLM's: a prompt or messages <-> token ids)
    GET  /healthz  /readyz                       (never behind the API key)
    GET  /metrics                                (behind it only with Access.protect_metrics)

Bodies become a pb.GenerateRequest (router/openai_protocol.py) for ``Router.generate``. Errors
are OpenAI's ``{"error": {"message", "type", "param", "code"}}``; a RouterError maps by code:

    INVALID_ARGUMENT 400   UNAUTHENTICATED 401   RESOURCE_EXHAUSTED 429   CANCELLED 499
    INTERNAL 500           UNAVAILABLE 503       DEADLINE_EXCEEDED 504

POSTs count against their client's limits (router/limits.py) while their answer is sent; one
over them gets 429 with ``retry-after``, as does a request no worker has room for. A request's
``timeout`` field (seconds) is its deadline at the workers: past it the worker frees its blocks
and the client gets 504 (or, mid-stream, an error event).

A stream is only opened once the first worker message is in, so everything that fails before
any output (a bad field, no worker, a full queue) still gets its HTTP status; a failure after
that ends the stream with an ``{"error": ...}`` event. A worker that ends a request with
"error" or "abort" counts as a failure (INTERNAL, UNAVAILABLE): OpenAI has no such finish reason.

Streams cost little per token: a client that reads slower than the worker writes gets one event
per batch of the messages it has not yet been sent (router/coalesce.py), never a token held back,
and bodies and events are serialized with orjson.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import grpc
import orjson
import pydantic
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from contracts.tls import TlsFiles
from protos import kvcascade_pb2 as pb
from router.access import Access, ApiKeys
from router.coalesce import coalesced
from router.errors import RouterError
from router.limits import ClientLimiter, Limited
from router.metrics import RouterMetrics
from router.openai_protocol import (Answer, BadRequest, Call, ChatRequest, CompletionRequest, DetokenizeRequest,
                                    Echo, TokenizeRequest, chat_call, completion_call)
from router.router import Router, tokenize

T = TypeVar("T")

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled",
         503: "service_unavailable", 504: "timeout"}
_TOOL_CALL = Call("completion", [pb.GenerateRequest()], stream=False, include_usage=False)  # names fields as sent
_FIELD = re.compile(r"[A-Za-z_][\w.\[\]]*")  # what a RouterError's "field: message" names


class _JSONResponse(JSONResponse):
    """JSON bodies through orjson (several times faster than json.dumps; the same JSON, as UTF-8)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        kind = _TYPE.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["retry-after"] = self.retry_after
        return _JSONResponse(self.body(), status_code=self.status, headers=headers)


def _from_router(err: RouterError, call: Call) -> ApiError:
    status = _STATUS.get(err.code, 500)
    if status != 400:  # no worker with room (429): worth a retry in a second
        return ApiError(status, err.message, code=err.code.name.lower(), retry_after="1" if status == 429 else None)
    name, sep, rest = err.message.partition(":")
    if not sep or not _FIELD.fullmatch(name):
        return ApiError(400, err.message, code="invalid_value")
    param = call.param(name)
    return ApiError(400, f"{param}:{rest}", param=param, code="invalid_value")


def _from_validation(errors: list[dict[str, Any]], skip: int = 0) -> ApiError:
    """The first pydantic error, naming its field the way OpenAI does (messages[0].role)."""
    e = errors[0]
    if e["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}",
                        code="invalid_json")
    param = ""
    for part in e["loc"][skip:]:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    msg = e["msg"].removeprefix("Value error, ")
    if not param:
        return ApiError(400, f"the body must be a JSON object: {msg}", code="invalid_value")
    code = "missing_required_parameter" if e["type"] == "missing" else "invalid_value"
    return ApiError(400, f"{param}: {msg}", param=param, code=code)


DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # 16 MiB: a 128k-token prompt as text or ids is well under 2


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes: by its Content-Length before any of it
    is read, else (a chunked body) as soon as what arrived passes the limit."""
    too_large = ApiError(413, f"the request body is over {limit:,} bytes, the most this server takes "
                              "(the router's --max-body-mb)", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


def _parse(model: type[T], body: bytes) -> T:
    try:
        return model.model_validate_json(body, strict=True)
    except pydantic.ValidationError as exc:
        raise _from_validation(exc.errors(include_url=False)) from None


# --- answering ----------------------------------------------------------------------------------


async def _checked(messages: AsyncIterator[pb.GenerateResponse]) -> AsyncIterator[pb.GenerateResponse]:
    """The router's stream, with a worker-side "error" or "abort" finish turned into a RouterError.

    Closing this closes the router's generator, which cancels the worker call, so the worker
    aborts the request and frees its KV blocks."""
    async with contextlib.aclosing(messages):
        async for msg in messages:
            if msg.finish_reason == "error":
                raise RouterError(grpc.StatusCode.INTERNAL, msg.error or "the worker failed the request")
            if msg.finish_reason == "abort":
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "the worker aborted the request")
            yield msg


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so the worker's request) if the client disconnects."""
    task = asyncio.ensure_future(work)

    async def left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(left())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (the server is stopping)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
        raise ApiError(499, "the client closed the request", code="cancelled")
    return task.result()


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


async def _events(answer: Answer, first: tuple[int, pb.GenerateResponse],
                  rest: AsyncIterator[tuple[int, pb.GenerateResponse]]) -> AsyncIterator[bytes]:
    """The SSE body: an event per (coalesced) message of each choice; events ready together go
    out in one write (the role chunks with the first text, the last text with the usage chunk and
    [DONE]). ``rest`` ends when every choice has finished."""
    async with contextlib.aclosing(rest):
        ready = [_event(opening) for opening in answer.first_chunks(first)]
        lasts: dict[int, pb.GenerateResponse] = {}
        item: tuple[int, pb.GenerateResponse] | None = first
        try:
            while item is not None:
                index, msg = item
                if (chunk := answer.chunk(index, msg)) is not None:
                    ready.append(_event(chunk))
                if msg.finish_reason:
                    lasts[index] = msg
                if ready:
                    yield b"".join(ready)
                    ready.clear()
                item = await anext(rest, None)
            if len(lasts) < len(answer.call.requests):
                ready.append(_event(ApiError(502, "the worker's stream ended without a finish reason").body()))
            elif answer.call.include_usage:
                ready.append(_event(answer.usage_chunk([lasts[i] for i in sorted(lasts)])))
        except RouterError as err:
            ready.append(_event(_from_router(err, answer.call).body()))
        ready.append(_DONE)
        yield b"".join(ready)


class _EventStream(StreamingResponse):
    """Closes its generator however the response ends. Starlette only cancels the sending task
    when the client disconnects, which can leave the generator suspended at a ``yield``, and the
    worker would go on generating for nobody until garbage collection."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _model_and_tokenizer(router: Router, call: Call) -> tuple[str, Any]:
    """The model name the answer carries and, when logprobs or an echo need one, its tokenizer."""
    model = call.request.model
    needs_tokenizer = call.wants_logprobs or call.echo
    if model and not needs_tokenizer:
        return model, None
    try:
        model, pool = await router.serving(model or None)
    except RouterError:
        return model, None  # Router.generate refuses the request, saying why
    return model, await router.tokenizers.of(pool[0]) if needs_tokenizer else None


async def _echoes(call: Call, tokenizer: Any) -> list[Echo] | None:
    """Per prompt, what echo puts first: its text and (for logprobs) its first token."""
    if not call.echo:
        return None
    if tokenizer is None:
        raise ApiError(503, "echo: no live worker of this model to read its prompt with", "echo")
    out = []
    for request in call.requests[:: call.best_of]:
        ids = list(request.token_ids.ids) if request.HasField("token_ids") else None
        if ids is None and call.wants_logprobs:
            ids = await asyncio.to_thread(tokenize, tokenizer, request)
        text = request.text if request.HasField("text") else tokenizer.decode(ids)
        out.append(Echo(text, ids[0] if ids else None))
    return out


async def _merged(streams: list[AsyncIterator[pb.GenerateResponse]]
                  ) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """(choice, message) from every stream as they come; the first failure ends them all."""
    if len(streams) == 1:  # the usual case: no tasks, no queue
        async with contextlib.aclosing(streams[0]) as only:
            async for msg in only:
                yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[pb.GenerateResponse]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for msg in stream:
                    queue.put_nowait((i, msg))
        except BaseException as exc:  # handed to the consumer, which ends the others
            queue.put_nowait(exc)
            return
        queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _answer(router: Router, request: Request, call: Call) -> Response:
    model, tokenizer = await _model_and_tokenizer(router, call)
    try:
        answer = Answer(call, model, tokenizer, await _echoes(call, tokenizer))
    except RouterError as err:
        raise _from_router(err, call) from None
    streams = [_checked(router.generate(r, timeout=call.timeout)) for r in call.requests]
    if call.stream:  # errors checked before merging, so the tokens before a failure still go out
        streams = [coalesced(s) for s in streams]
    messages = _merged(streams)
    try:
        if not call.stream:
            samples = await _unless_client_leaves(request, _collect(messages, len(streams)))
            return _JSONResponse(answer.response(samples))
        first = await anext(messages)
    except RouterError as err:
        await messages.aclose()
        raise _from_router(err, call) from None
    except StopAsyncIteration:
        raise ApiError(502, "the worker's stream ended without output") from None
    return _EventStream(_events(answer, first, messages), media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _collect(messages: AsyncIterator[tuple[int, pb.GenerateResponse]],
                   count: int) -> list[list[pb.GenerateResponse]]:
    samples: list[list[pb.GenerateResponse]] = [[] for _ in range(count)]
    async with contextlib.aclosing(messages):
        async for i, msg in messages:
            samples[i].append(msg)
    if not all(s and s[-1].finish_reason for s in samples):
        raise ApiError(502, "the worker's stream ended without a finish reason")
    return samples


# --- the app ------------------------------------------------------------------------------------


def _bearer(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


class _ClientLimits:
    """ASGI middleware: a POST counts against its client's limits for as long as its answer is being
    sent (a stream until its last event), or is answered 429 with ``retry-after`` at once."""

    def __init__(self, app, keys: ApiKeys, limiter: ClientLimiter, metrics: RouterMetrics):
        self.app, self.keys, self.limiter, self.metrics = app, keys, limiter, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
        address = scope["client"][0] if scope.get("client") else "unknown"
        try:
            release = self.limiter.admit(self.keys.client(_bearer(authorization), address))
        except Limited as over:
            self.metrics.limited.labels(over.reason).inc()
            refusal = ApiError(429, over.message, code="rate_limit_exceeded", retry_after=over.retry_after)
            await refusal.response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            release()


def create_app(router: Router, *, access: Access = Access(), limiter: ClientLimiter | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An OpenAI-compatible app over ``router``; with API keys, /v1/* and the tools need one as a
    bearer token (/metrics too with ``access.protect_metrics``); request bodies over
    ``max_body_bytes`` are answered 413; POSTs over their client's ``access.limits``, 429 (counted
    in ``limiter``, shared with the gRPC front of the process, else one of the app's own)."""
    keys = ApiKeys(access.api_keys)
    app = FastAPI(title="kvcascade router", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=_JSONResponse)
    if access.limits.active:
        app.add_middleware(_ClientLimits, keys=keys, metrics=router.metrics,
                           limiter=limiter if limiter is not None else ClientLimiter(access.limits))

    async def authorize(request: Request) -> None:
        given = _bearer(request.headers.get("authorization", ""))
        if given is None:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if keys.match(given) is None:
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)] if keys else [])

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        call = completion_call(_parse(CompletionRequest, await _body(request, max_body_bytes)))
        return await _answer(router, request, call)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        call = chat_call(_parse(ChatRequest, await _body(request, max_body_bytes)))
        return await _answer(router, request, call)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        lengths = await router.context_lengths()
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvcascade",
                 **({"max_model_len": lengths[m]} if m in lengths else {})} for m in await router.models()]
        return {"object": "list", "data": data}

    app.include_router(v1)
    tools = APIRouter(dependencies=[Depends(authorize)] if keys else [])

    @tools.post("/tokenize")
    async def tokenize_(request: Request) -> dict[str, Any]:
        body = _parse(TokenizeRequest, await _body(request, max_body_bytes))
        try:
            model, tokenizer = await router.tokenizer_for(body.model)
            ids = await asyncio.to_thread(tokenize, tokenizer, body.generate_request())
        except RouterError as err:
            raise _from_router(err, _TOOL_CALL) from None
        return {"count": len(ids), "max_model_len": (await router.context_lengths()).get(model), "tokens": ids}

    @tools.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = _parse(DetokenizeRequest, await _body(request, max_body_bytes))
        try:
            _, tokenizer = await router.tokenizer_for(body.model)
        except RouterError as err:
            raise _from_router(err, _TOOL_CALL) from None
        if any(t >= len(tokenizer) for t in body.tokens):
            raise ApiError(400, f"tokens: ids must be below the vocabulary size {len(tokenizer)}", "tokens",
                           "invalid_value")
        return {"prompt": tokenizer.decode(body.tokens)}

    @tools.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> dict[str, Any]:
        """What a client needs to tokenize as the server does (vLLM's endpoint, which lm-eval's
        remote tokenizer reads): special tokens, the chat template, the context length."""
        try:
            name, tokenizer = await router.tokenizer_for(model)
        except RouterError as err:
            raise _from_router(err, _TOOL_CALL) from None
        return {"model": name, "tokenizer_class": type(tokenizer).__name__, "vocab_size": len(tokenizer),
                "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                "chat_template": tokenizer.chat_template,
                "model_max_length": (await router.context_lengths()).get(name)}

    app.include_router(tools)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    @app.get("/health")  # vLLM's and SGLang's name for it, which clients (guidellm) check first
    async def readyz() -> JSONResponse:
        if await router.ready():
            return _JSONResponse({"status": "ready"})
        return _JSONResponse({"status": "no live worker"}, status_code=503)

    @app.get("/metrics", dependencies=[Depends(authorize)] if keys and access.protect_metrics else [])
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return ApiError(400, exc.message, exc.param, "invalid_value").response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _from_validation(list(exc.errors()), skip=1).response()  # loc starts with "body"/"query"

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets OpenAI's shape instead of plain text.
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal").response()

    return app


# --- serving ------------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn without signal handlers of its own: whoever embeds it decides when it stops."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve_http(app: FastAPI, host: str, port: int, *, reuse_port: bool = False, tls: TlsFiles | None = None
                     ) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """Serve ``app`` on host:port (0: a free port, see ``http_port``) in a task of this loop, over
    HTTPS with ``tls``. Returns once it accepts connections; ``stop_http`` stops it. ``reuse_port``:
    SO_REUSEPORT, so other processes (router/http_workers.py) can listen on the same port and the
    kernel spreads connections over them; off, a port in use is an error."""
    # Bound here, so a taken port raises OSError to the caller instead of uvicorn's sys.exit.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, reuse_port=reuse_port)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", log_config=None, access_log=False,
                            lifespan="off", timeout_graceful_shutdown=5,
                            ssl_certfile=tls.cert if tls else None, ssl_keyfile=tls.key if tls else None)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="kvcascade-http")
    while not server.started:
        if task.done():
            sock.close()
            task.result()
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.01)
    return server, task


def http_port(server: uvicorn.Server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


async def stop_http(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    """Stop accepting, give open requests a few seconds, then close them."""
    server.should_exit = True
    await task
