"""deploy.smoke's request and answer handling, on loopback (its port-forward is the only cluster call)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from deploy.local import free_port
from deploy.smoke import (Completion, completion_body, container_port, exchange, main, parse_response,
                          pick_router_pod, raw_request, send_url)
from tests.helm.chart import render

ANSWER = {"id": "cmpl-1", "object": "text_completion", "model": "smollm2-135m",
          "choices": [{"index": 0, "text": " Paris.", "finish_reason": "length"}],
          "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}


def test_request_bytes():
    body = completion_body("The capital of France is", 4)
    assert json.loads(body) == {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    assert json.loads(completion_body("x", 1, "qwen"))["model"] == "qwen"
    raw = raw_request(body, "key-123")
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/completions HTTP/1.1" and rest == body
    assert f"Content-Length: {len(body)}" in lines and "Authorization: Bearer key-123" in lines
    assert "Connection: close" in lines  # the router closes, so reading to EOF ends the answer
    assert not any(line.startswith("Authorization") for line in raw_request(body, None).decode().split("\r\n"))


def test_parse_content_length_and_chunked():
    payload = json.dumps(ANSWER).encode()
    plain = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
             % (len(payload), payload))
    result = parse_response(plain)
    assert result.ok and result.text == " Paris." and result.status == 200
    assert result.summary() == "HTTP 200 from model smollm2-135m: ' Paris.' (prompt 5, completion 4 tokens)"
    half = len(payload) // 2
    chunked = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
               % (half, payload[:half], len(payload) - half, payload[half:]))
    assert parse_response(chunked) == result


def test_parse_errors():
    error = json.dumps({"error": {"message": "incorrect API key", "type": "invalid_request_error"}}).encode()
    result = parse_response(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error))
    assert not result.ok and result.summary() == "HTTP 401: incorrect API key"
    assert parse_response(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 3\r\n\r\nbad").summary() == "HTTP 502: bad"
    with pytest.raises(ValueError, match="closed the connection"):
        parse_response(b"")
    assert not Completion(200, {"choices": []}).ok


def test_exchange_reads_until_close():
    ours, theirs = socket.socketpair()

    def serve():
        request = theirs.recv(65536)
        theirs.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n" if request.startswith(b"POST") else b"")
        theirs.sendall(b"{}")
        theirs.close()

    thread = threading.Thread(target=serve)
    thread.start()
    data = exchange(ours, raw_request(b"{}", None), timeout_s=10)
    thread.join()
    ours.close()
    assert parse_response(data) == Completion(200, {})


def test_send_url_against_a_server():
    seen = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen["path"], seen["auth"] = self.path, self.headers.get("Authorization")
            seen["body"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ok = self.headers.get("Authorization") == "Bearer good-key"
            payload = json.dumps(ANSWER if ok else {"error": {"message": "incorrect API key"}}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/"
        assert send_url(url, completion_body("hi", 4), "good-key", 10).ok
        assert seen == {"path": "/v1/completions", "auth": "Bearer good-key",
                        "body": {"prompt": "hi", "max_tokens": 4, "temperature": 0}}
        assert send_url(url, completion_body("hi", 4), "bad", 10).summary() == "HTTP 401: incorrect API key"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def _pod(name, ready=True, deleting=False):
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return {"metadata": meta, "status": status}


def test_pick_a_ready_router_pod():
    assert pick_router_pod([_pod("r-b"), _pod("r-a", ready=False), _pod("r-c")])["metadata"]["name"] == "r-b"
    assert pick_router_pod([_pod("r-a", deleting=True), _pod("r-z")])["metadata"]["name"] == "r-z"
    with pytest.raises(LookupError, match=r"no ready router pod \(router pods: r-a\)"):
        pick_router_pod([_pod("r-a", ready=False)])


def test_the_http_port_of_the_charts_router_pod():
    template = render().pods("router")[0]
    assert container_port({"metadata": {"name": "r"}, **template}, "http") == 8000
    with pytest.raises(LookupError):
        container_port({"metadata": {"name": "r"}, **template}, "metrics")


def test_cli_reports_an_unreachable_router(capsys):
    assert main(["--url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "smoke request failed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])  # neither --release nor --url
