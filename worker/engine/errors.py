"""Errors the engine raises at its boundary; the server maps them onto status codes."""


class InvalidRequestError(ValueError):
    """A request field is wrong. ``field`` names it, so the caller can say which one."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class QueueFullError(RuntimeError):
    """The engine holds as many requests as it is configured to queue (overload, not a bug)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""
