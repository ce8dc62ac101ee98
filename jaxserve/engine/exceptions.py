"""Errors the serving layer maps to HTTP status codes."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served (HTTP 503)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (HTTP 503); retry later."""
