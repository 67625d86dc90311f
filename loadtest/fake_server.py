"""A server that only streams, to measure the harness rather than a server: the KVCascade
Generate service (grpc.aio) and OpenAI-style HTTP with server-sent events, each answering every
request with ``max_tokens`` made-up tokens as fast as it can, with no model behind them.

    python -m loadtest.fake_server --port 50051 --http-port 8000 [--tokens-per-message 1]

Several of them may share the ports (SO_REUSEPORT): the kernel spreads the connections, so a
fake server of N processes keeps up with a harness of N. benchmarks/loadtest_capacity.py and the
tests run the harness against it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc

DEFAULT_MAX_TOKENS = 16  # a request that sets none


def _prompt_tokens(words: str) -> int:
    return len(words.split())  # about one token a word: loadtest/text.py's words


class FakeServicer(pb_grpc.KVCascadeServicer):
    def __init__(self, tokens_per_message: int = 1):
        self.k = tokens_per_message
        self.chunk = pb.GenerateResponse(token_ids=[7] * self.k, text=" tok" * self.k)  # sent as is, every time

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # context.write, not a generator handler: a cancelled call stops here at once.
        n = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        for _ in range((n - 1) // self.k):
            await context.write(self.chunk)
        rest = n - (n - 1) // self.k * self.k
        prompt = request.text or " ".join(m.content for m in request.messages.messages)
        await context.write(pb.GenerateResponse(
            token_ids=[7] * rest, text=" tok" * rest, finish_reason="length", worker_id="fake",
            usage=pb.Usage(prompt_tokens=_prompt_tokens(prompt), completion_tokens=n)))


def _sse(data: dict | str) -> bytes:
    """One server-sent event as one HTTP/1.1 chunk."""
    event = b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


class FakeHttp:
    """/v1/completions and /v1/chat/completions, streamed over keep-alive connections."""

    def __init__(self, tokens_per_message: int = 1):
        self.k = tokens_per_message
        text = " tok" * self.k
        self.chunk = {False: _sse({"choices": [{"index": 0, "text": text, "finish_reason": None}]}),
                      True: _sse({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})}

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                await self._stream(json.loads(body), path.endswith("/chat/completions"), writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection (at the end, or to cancel a request)
        finally:
            writer.close()

    async def _stream(self, req: dict, chat: bool, writer: asyncio.StreamWriter) -> None:
        n = req.get("max_tokens") or DEFAULT_MAX_TOKENS
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(n // self.k):
            writer.write(self.chunk[chat])
            await writer.drain()
        rest = n % self.k
        piece = {"delta": {"content": " tok" * rest}} if chat else {"text": " tok" * rest}
        writer.write(_sse({"choices": [{"index": 0, **piece, "finish_reason": "length"}]}))
        prompt = " ".join(m["content"] for m in req["messages"]) if chat else req.get("prompt", "")
        usage = {"prompt_tokens": _prompt_tokens(prompt), "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        writer.write(_sse({"choices": [], "usage": usage}) + _sse("[DONE]") + b"0\r\n\r\n")
        await writer.drain()


async def start(host: str = "127.0.0.1", port: int = 0, http_port: int | None = 0, tokens_per_message: int = 1,
                ) -> tuple[grpc.aio.Server, asyncio.Server | None, int, int | None]:
    """Both servers listening (port 0: a free one); returns them and their ports. ``http_port``
    None: no HTTP server."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
    pb_grpc.add_KVCascadeServicer_to_server(FakeServicer(tokens_per_message), server)
    port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    if http_port is None:
        return server, None, port, None
    http = await asyncio.start_server(FakeHttp(tokens_per_message).connection, host, http_port, reuse_port=True)
    return server, http, port, http.sockets[0].getsockname()[1]


async def _serve(args: argparse.Namespace) -> None:
    server, http, port, http_port = await start(args.host, args.port, args.http_port, args.tokens_per_message)
    print(f"fake server: grpc {args.host}:{port}, http {args.host}:{http_port}", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.fake_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (default: %(default)s)")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    parser.add_argument("--tokens-per-message", type=int, default=1,
                        help="tokens per streamed message (default: %(default)s, as a server streaming each "
                             "decode step)")
    try:
        asyncio.run(_serve(parser.parse_args(argv)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
