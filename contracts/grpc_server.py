"""A grpc.aio server for the KVCascade service with health checking and reflection.

Workers and routers serve the same API; they differ only in the servicer and in what "healthy"
means (a live engine loop; at least one live worker), so both use this class.

A request that does not decode as its message is the client's fault: INVALID_ARGUMENT, not the
UNKNOWN grpc.aio answers when a deserializer raises (``_tolerant``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha import reflection

from contracts.tls import TlsFiles
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCascade"].full_name
# Router -> worker messages carry the prompt as the client sent it, up to the HTTP front's body limit
# (--max-body-mb), past gRPC's default 4 MiB: workers take (and routers send) up to this.
INTERNAL_MESSAGE_BYTES = 64 * 2**20
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Undecodable:
    """What a request that did not decode becomes, so the method can refuse it by name."""

    def __init__(self, message_name: str, error: Exception):
        self.details = f"the request is not a valid {message_name}: {error or type(error).__name__}"


def _tolerant(message_class: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as err:
            return _Undecodable(message_class.DESCRIPTOR.name, err)

    return deserialize


def _refusing_undecodable(method: Callable) -> Callable:
    if inspect.isasyncgenfunction(method):
        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
            async for item in method(request, context):
                yield item

        return stream

    async def call(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return await method(request, context)

    return call


def _add_servicer(servicer: pb_grpc.KVCascadeServicer, server: grpc.aio.Server) -> None:
    """As the generated add_KVCascadeServicer_to_server, with ``_tolerant`` deserializers."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["KVCascade"].methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(_refusing_undecodable(getattr(servicer, method.name)),
                                     request_deserializer=_tolerant(GetMessageClass(method.input_type)),
                                     response_serializer=GetMessageClass(method.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


class GrpcServer:
    def __init__(self, servicer: pb_grpc.KVCascadeServicer, is_healthy: Callable[[], bool | Awaitable[bool]],
                 host: str = "127.0.0.1", port: int = 50051, *, health_poll_s: float = 1.0,
                 tls: TlsFiles | None = None, max_message_bytes: int | None = None):
        """``max_message_bytes``: the largest request taken (None: gRPC's 4 MiB); a larger one is
        answered RESOURCE_EXHAUSTED by gRPC itself."""
        self.servicer = servicer
        self.max_message_bytes = max_message_bytes
        self.tls = tls  # None: plaintext (workers, behind the router; a router inside the cluster)
        self.is_healthy = is_healthy
        self.host = host
        self.port = port  # 0 picks a free port; start() stores the bound one
        self._health_poll_s = health_poll_s
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._health_task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        # No SO_REUSEPORT (gRPC's default sets it): a port another server holds is an error here,
        # not one the kernel quietly splits connections over (a second worker on 50051, or the HTTP
        # processes of --http-workers, which share theirs with SO_REUSEPORT).
        options = [("grpc.so_reuseport", 0)]
        if self.max_message_bytes is not None:
            options.append(("grpc.max_receive_message_length", self.max_message_bytes))
        server = grpc.aio.server(options=options)
        _add_servicer(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.port = (server.add_secure_port(self.address, self.tls.grpc_credentials()) if self.tls is not None
                     else server.add_insecure_port(self.address))
        await server.start()
        self._server = server
        # Set before returning, so a health check right after start() never sees NOT_FOUND.
        status = await self._status()
        await self._set_health(status)
        self._health_task = asyncio.create_task(self._follow_health(status), name="kvcascade-health")

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Refuse new calls, give running ones ``grace_s`` to finish, then cancel (and so abort) them."""
        # NOT_SERVING first, so load balancers stop sending before the port closes.
        await self._health.enter_graceful_shutdown()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._server is not None:
            await self._server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def _status(self) -> int:
        healthy = self.is_healthy()
        if asyncio.iscoroutine(healthy):
            healthy = await healthy
        return _SERVING if healthy else _NOT_SERVING

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def _follow_health(self, status: int) -> None:
        while True:
            await asyncio.sleep(self._health_poll_s)
            current = await self._status()
            if current != status:
                await self._set_health(current)
                status = current
