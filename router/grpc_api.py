"""The router's gRPC front: the same KVCascade service a worker serves, so clients need not know
that workers exist. API keys (when configured) come in the ``authorization: Bearer KEY`` or
``x-api-key`` metadata; a client over its limits (router/limits.py) gets RESOURCE_EXHAUSTED with
``retry-after`` (seconds) in the trailing metadata."""

from __future__ import annotations

import grpc

from contracts.grpc_server import GrpcServer
from contracts.tls import TlsFiles
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from router.access import Access, ApiKeys
from router.coalesce import coalesced
from router.errors import RouterError
from router.limits import ClientLimiter, Limited
from router.router import Router


def _presented_key(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
        if key == "x-api-key":
            return value.strip()
    return None


def _address(context: grpc.aio.ServicerContext) -> str:
    """The client's host, without its port ("ipv4:127.0.0.1:5555" -> "127.0.0.1")."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    return rest.rpartition(":")[0].strip("[]") if kind in ("ipv4", "ipv6") else peer


async def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str,
                  retry_after: str | None = None) -> None:
    if retry_after is not None:
        context.set_trailing_metadata((("retry-after", retry_after),))
    await context.abort(code, message)


class RouterServicer(pb_grpc.KVCascadeServicer):
    def __init__(self, router: Router, access: Access = Access(), limiter: ClientLimiter | None = None):
        self.router = router
        self.keys = ApiKeys(access.api_keys)
        self.limiter = limiter if limiter is not None else ClientLimiter(access.limits)

    async def _check_key(self, context: grpc.aio.ServicerContext) -> str | None:
        """The key presented (None: none), refused here unless valid when the API has keys."""
        given = _presented_key(context)
        if self.keys and self.keys.match(given) is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required")
        return given

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # A coroutine writing with context.write: a cancelled call cancels this task, and closing
        # the stream below cancels the worker call, so the worker frees the request's blocks.
        # Coalesced: a client that reads slower than the worker writes gets fewer, larger messages.
        given = await self._check_key(context)
        try:
            release = self.limiter.admit(self.keys.client(given, _address(context)))
        except Limited as over:
            self.router.metrics.limited.labels(over.reason).inc()
            await _refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, over.message, over.retry_after)
        stream = coalesced(self.router.generate(request, timeout=context.time_remaining()))
        try:
            async for msg in stream:
                await context.write(msg)
        except RouterError as err:
            retry = "1" if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
            await _refuse(context, err.code, err.message, retry)
        finally:
            await stream.aclose()
            release()

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        """The sum over live workers (their last heartbeats) and this router's prefix-hit counters."""
        await self._check_key(context)
        workers = await self.router.live_workers(fresh=True)
        queries, hits = self.router.prompt_tokens_total, self.router.cached_tokens_total
        return pb.StatsResponse(
            running=sum(w.load.running for w in workers),
            waiting=sum(w.load.waiting for w in workers),
            kv_blocks_total=sum(w.load.kv_blocks_total for w in workers),
            kv_blocks_free=sum(w.load.kv_blocks_free for w in workers),
            kv_blocks_used=sum(w.load.kv_blocks_total - w.load.kv_blocks_free for w in workers),
            prefix_queries=queries, prefix_hits=hits,
            prefix_hit_rate=hits / queries if queries else 0.0,
            block_size=workers[0].block_size if workers else 0,
            model=",".join(sorted({w.model for w in workers})),
            spec_drafted_tokens=sum(w.load.spec_drafted_tokens for w in workers),
            spec_accepted_tokens=sum(w.load.spec_accepted_tokens for w in workers),
            spec_verifications=sum(w.load.spec_verifications for w in workers),
        )


class RouterServer(GrpcServer):
    """Serving while at least one worker is live."""

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 50051, *,
                 access: Access = Access(), limiter: ClientLimiter | None = None, health_poll_s: float = 1.0,
                 tls: TlsFiles | None = None, max_message_bytes: int | None = None):
        """``limiter``: the one the process's HTTP front uses too, so a client is one client on both;
        ``max_message_bytes``: the largest request (the HTTP front's body limit; None: gRPC's 4 MiB)."""
        super().__init__(RouterServicer(router, access, limiter), router.ready, host, port, health_poll_s=health_poll_s,
                         tls=tls, max_message_bytes=max_message_bytes)
        self.router = router
