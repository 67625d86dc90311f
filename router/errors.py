"""The one error type the router's core raises, each front end mapping its code onto its protocol;
and the HTTP front's own refusal of a body it reads (``BadRequest``)."""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """``code`` is a gRPC status code: INVALID_ARGUMENT (details name the field), UNAUTHENTICATED,
    RESOURCE_EXHAUSTED, UNAVAILABLE (no worker, or a worker died mid-stream), DEADLINE_EXCEEDED,
    CANCELLED or INTERNAL. The HTTP front maps them to 400, 401, 429, 503, 504, 499 and 500."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class BadRequest(Exception):
    """A request the HTTP front refuses itself: HTTP 400 naming the OpenAI field in ``param``."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
        self.message = message
