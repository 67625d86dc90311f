"""gRPC channels to workers, one per address, reused across requests; and the workers of this very
process (`kvcascade serve`'s embedded ones), reached through an in-process stub instead."""

from __future__ import annotations

from typing import Any

import grpc

from contracts.grpc_server import INTERNAL_MESSAGE_BYTES
from protos import kvcascade_pb2_grpc as pb_grpc

# Fail fast on a dead worker: a request should move on to another worker, not wait for a reconnect.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_send_message_length", INTERNAL_MESSAGE_BYTES),  # a prompt as large as the fronts take
    ("grpc.max_receive_message_length", INTERNAL_MESSAGE_BYTES),
]


class WorkerClients:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.KVCascadeStub] = {}
        self._local: dict[str, Any] = {}

    def add_local(self, address: str, stub: Any) -> None:
        """Reach the worker registered at ``address`` through ``stub`` (its Generate as grpc.aio's:
        worker.server.InProcessStub), not over the network: it lives in this process."""
        self._local[address] = stub

    def stub(self, address: str) -> pb_grpc.KVCascadeStub:
        if (local := self._local.get(address)) is not None:
            return local
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = pb_grpc.KVCascadeStub(channel)
        return stub

    async def forget(self, address: str) -> None:
        """Drop a channel (its worker is gone); the next request reconnects from scratch."""
        self._stubs.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close(grace=None)

    async def close(self) -> None:
        for address in list(self._channels):
            await self.forget(address)
