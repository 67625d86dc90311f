"""A worker without a model, for tests of how the router relays streams: the KVCascade Generate
service answering every request with ``max_tokens`` made-up tokens (ids 0, 1, 2 ..., each with
its own text), one message per token, as fast as it can or every ``interval_s``, or held after the
first token while its ``gate`` is cleared. It runs on a loop thread of its own, as a worker process
would, and counts the calls it saw cancelled."""

from __future__ import annotations

import asyncio
import threading

import grpc

from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc

from .loop_thread import LoopThread


def token_text(i: int, pad: int = 0) -> str:
    """Token ``i``'s text: distinct for every token, so a lost or doubled one shows in the join."""
    return f" t{i}".ljust(pad, "_")


class FakeWorkerServicer(pb_grpc.KVCascadeServicer):
    def __init__(self, pad: int = 0, interval_s: float = 0.0):
        self.pad, self.interval_s = pad, interval_s
        self.calls = 0
        self.cancelled = 0
        self.any_cancelled = threading.Event()
        # Cleared, every stream waits after its first token until it is set: streams held open.
        self.gate = threading.Event()
        self.gate.set()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        self.calls += 1
        n = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        try:
            for i in range(n - 1):
                await context.write(pb.GenerateResponse(request_id=request.request_id, token_ids=[i],
                                                        text=token_text(i, self.pad)))
                while not self.gate.is_set():
                    await asyncio.sleep(0.01)
                if self.interval_s:
                    await asyncio.sleep(self.interval_s)
            await context.write(pb.GenerateResponse(
                request_id=request.request_id, token_ids=[n - 1], text=token_text(n - 1, self.pad),
                finish_reason="length", ttft_s=0.001,
                usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=n)))
        except (asyncio.CancelledError, Exception):
            # The caller cancelled: grpc.aio cancels this task, or, where a write was waiting on
            # flow control, fails that write (cygrpc's ExecuteBatchError); nothing else fails here.
            self.cancelled += 1
            self.any_cancelled.set()
            raise


class FakeWorker:
    """The servicer on 127.0.0.1 (a free port), on its own loop thread."""

    def __init__(self, pad: int = 0, interval_s: float = 0.0):
        self.servicer = FakeWorkerServicer(pad, interval_s)
        self.loop = LoopThread()

        async def start() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server()
            pb_grpc.add_KVCascadeServicer_to_server(self.servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        self.server, self.port = self.loop.run(start())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.loop.run(self.server.stop(0))
        self.loop.close()
