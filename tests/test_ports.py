"""Ports: what free_port hands out, and a gRPC server never sharing its port with another server."""

from __future__ import annotations

import asyncio
import socket

import pytest

from contracts.grpc_server import GrpcServer
from contracts.ports import ephemeral_range, free_port
from protos import kvcascade_pb2_grpc as pb_grpc
from router.http_api import create_app, serve_http, stop_http


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range(tmp_path) -> None:
    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
    # A range file that cannot be read means Linux's default.
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ephemeral_range(tmp_path / "range") == (40000, 50000)


def test_a_port_a_grpc_server_holds_is_refused_to_a_second_server_and_to_an_http_front() -> None:
    """The CI failure behind this: serve's HTTP processes (SO_REUSEPORT) and an embedded worker's gRPC
    server (SO_REUSEPORT by gRPC's default) bound one port, and the router's calls to the worker
    reached the HTTP server."""

    async def scenario() -> None:
        first = GrpcServer(pb_grpc.KVCascadeServicer(), lambda: True, "127.0.0.1", 0)
        await first.start()
        try:
            second = GrpcServer(pb_grpc.KVCascadeServicer(), lambda: True, "127.0.0.1", first.port)
            with pytest.raises(RuntimeError, match=str(first.port)):
                await second.start()
            with pytest.raises(OSError):
                server, task = await serve_http(create_app(None), "127.0.0.1", first.port, reuse_port=True)
                await stop_http(server, task)
        finally:
            await first.stop(0)

    asyncio.run(scenario())
