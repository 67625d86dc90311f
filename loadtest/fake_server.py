"""A server that only streams, to measure the harness rather than a server: the KVCascade
Generate service (grpc.aio) and OpenAI-style HTTP with server-sent events, each answering every
request with ``max_tokens`` made-up tokens as fast as it can, with no model behind them; or,
with ``--interval-ms X``, one message every X ms, as an engine streams one step at a time. With
``--cascade`` the last message says what a router's two-tier cascade would (see ``cascade_usage``).

    python -m loadtest.fake_server --port 50051 --http-port 8000 [--tokens-per-message 1] [--interval-ms 20] \
        [--cascade]

Several of them may share the ports (SO_REUSEPORT): the kernel spreads the connections, so a
fake server of N processes keeps up with a harness of N. benchmarks/loadtest_capacity.py and the
tests run the harness against it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import grpc

from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc

DEFAULT_MAX_TOKENS = 16  # a request that sets none


class Steps:
    """One stream's engine-step pace: ``await steps.next()`` before each message returns at once
    the first time, then ``interval_s`` after the previous step was due (0: never waits). A step
    the event loop made late moves the later ones, as a busy engine's would: no burst to catch up."""

    def __init__(self, interval_s: float = 0.0):
        self.interval_s = interval_s
        self.due: float | None = None

    async def next(self) -> None:
        if not self.interval_s:
            return
        loop = asyncio.get_running_loop()
        if self.due is None:
            self.due = loop.time()
            return
        self.due += self.interval_s
        delay = self.due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            self.due -= delay  # late: the next step counts from now


def _prompt_tokens(words: str) -> int:
    return len(words.split())  # about one token a word: loadtest/text.py's words


def cascade_usage(prompt_tokens: int, completion_tokens: int) -> list[dict[str, Any]]:
    """The ``tier_usage`` of a two-tier cascade whose small tier answered and whose large tier
    judged the draft in one prefill (the prompt and the draft, nothing generated) and let it stand."""
    return [{"tier": "small", "model": "fake-small", "role": "answer", "prompt_tokens": prompt_tokens,
             "cached_tokens": 0, "completion_tokens": completion_tokens},
            {"tier": "large", "model": "fake-large", "role": "judge",
             "prompt_tokens": prompt_tokens + completion_tokens, "cached_tokens": 0, "completion_tokens": 0}]


class FakeServicer(pb_grpc.KVCascadeServicer):
    def __init__(self, tokens_per_message: int = 1, interval_s: float = 0.0, cascade: bool = False):
        self.k = tokens_per_message
        self.interval_s = interval_s
        self.cascade = cascade
        self.chunk = pb.GenerateResponse(token_ids=[7] * self.k, text=" tok" * self.k)  # sent as is, every time

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # context.write, not a generator handler: a cancelled call stops here at once.
        n = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        steps = Steps(self.interval_s)
        for _ in range((n - 1) // self.k):
            await steps.next()
            await context.write(self.chunk)
        rest = n - (n - 1) // self.k * self.k
        prompt = _prompt_tokens(request.text or " ".join(m.content for m in request.messages.messages))
        last = pb.GenerateResponse(token_ids=[7] * rest, text=" tok" * rest, finish_reason="length", worker_id="fake",
                                   usage=pb.Usage(prompt_tokens=prompt, completion_tokens=n))
        if self.cascade:
            last.tier, last.escalated = "small", False
            last.tier_usage.extend(pb.TierUsage(**u) for u in cascade_usage(prompt, n))
        await steps.next()
        await context.write(last)


def _sse(data: dict | str) -> bytes:
    """One server-sent event as one HTTP/1.1 chunk."""
    event = b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


class FakeHttp:
    """/v1/completions and /v1/chat/completions, streamed over keep-alive connections."""

    def __init__(self, tokens_per_message: int = 1, interval_s: float = 0.0, cascade: bool = False):
        self.k = tokens_per_message
        self.interval_s = interval_s
        self.cascade = cascade
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
        steps = Steps(self.interval_s)
        for _ in range(n // self.k):
            await steps.next()
            writer.write(self.chunk[chat])
            await writer.drain()
        rest = n % self.k
        if rest:  # else the finish goes with the last token's step, as a worker's does
            await steps.next()
        piece = {"delta": {"content": " tok" * rest}} if chat else {"text": " tok" * rest}
        prompt = _prompt_tokens(" ".join(m["content"] for m in req["messages"]) if chat else req.get("prompt", ""))
        # A cascade's fields go on the finish chunk, as the router's do.
        cascade = {"tier": "small", "escalated": False, "tier_usage": cascade_usage(prompt, n)} if self.cascade else {}
        writer.write(_sse({"choices": [{"index": 0, **piece, "finish_reason": "length"}], **cascade}))
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}
        writer.write(_sse({"choices": [], "usage": usage}) + _sse("[DONE]") + b"0\r\n\r\n")
        await writer.drain()


async def start(host: str = "127.0.0.1", port: int = 0, http_port: int | None = 0, tokens_per_message: int = 1,
                *, interval_ms: float = 0.0, cascade: bool = False
                ) -> tuple[grpc.aio.Server, asyncio.Server | None, int, int | None]:
    """Both servers listening (port 0: a free one); returns them and their ports. ``http_port``
    None: no HTTP server. ``interval_ms``: the pause between one stream's messages (0: none).
    ``cascade``: answer as a router's cascade (``cascade_usage``)."""
    if interval_ms < 0:
        raise ValueError(f"interval_ms must be >= 0, got {interval_ms}")
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
    pb_grpc.add_KVCascadeServicer_to_server(FakeServicer(tokens_per_message, interval_ms / 1000, cascade), server)
    port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    if http_port is None:
        return server, None, port, None
    http = await asyncio.start_server(FakeHttp(tokens_per_message, interval_ms / 1000, cascade).connection, host,
                                      http_port, reuse_port=True)
    return server, http, port, http.sockets[0].getsockname()[1]


async def _serve(args: argparse.Namespace) -> None:
    server, http, port, http_port = await start(args.host, args.port, args.http_port, args.tokens_per_message,
                                                interval_ms=args.interval_ms, cascade=args.cascade)
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
    parser.add_argument("--interval-ms", type=float, default=0.0,
                        help="milliseconds between the messages of one stream, like an engine step (default: "
                             "%(default)s, as fast as it can)")
    parser.add_argument("--cascade", action="store_true",
                        help="answer as a two-tier cascade: tier, escalated and tier_usage on the last message")
    try:
        asyncio.run(_serve(parser.parse_args(argv)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
