"""The router's gRPC front: the same KVCascade service a worker serves, so clients need not know
that workers exist. API keys (when configured) come in the ``authorization: Bearer KEY`` or
``x-api-key`` metadata."""

from __future__ import annotations

import hmac
from collections.abc import Collection

import grpc

from contracts.grpc_server import GrpcServer
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from router.coalesce import coalesced
from router.errors import RouterError
from router.router import Router


def key_allowed(given: str | None, api_keys: Collection[str]) -> bool:
    """Constant-time check of a presented key against the configured ones (none configured: open)."""
    if not api_keys:
        return True
    if not given:
        return False
    return any(hmac.compare_digest(given.encode(), k.encode()) for k in api_keys)


def _presented_key(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
        if key == "x-api-key":
            return value.strip()
    return None


class RouterServicer(pb_grpc.KVCascadeServicer):
    def __init__(self, router: Router, api_keys: Collection[str] = ()):
        self.router = router
        self.api_keys = tuple(api_keys)

    async def _check_key(self, context: grpc.aio.ServicerContext) -> None:
        if not key_allowed(_presented_key(context), self.api_keys):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # A coroutine writing with context.write: a cancelled call cancels this task, and closing
        # the stream below cancels the worker call, so the worker frees the request's blocks.
        # Coalesced: a client that reads slower than the worker writes gets fewer, larger messages.
        await self._check_key(context)
        stream = coalesced(self.router.generate(request, timeout=context.time_remaining()))
        try:
            async for msg in stream:
                await context.write(msg)
        except RouterError as err:
            await context.abort(err.code, err.message)
        finally:
            await stream.aclose()

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
        )


class RouterServer(GrpcServer):
    """Serving while at least one worker is live."""

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 50051, *,
                 api_keys: Collection[str] = (), health_poll_s: float = 1.0):
        super().__init__(RouterServicer(router, api_keys), router.ready, host, port, health_poll_s=health_poll_s)
        self.router = router
