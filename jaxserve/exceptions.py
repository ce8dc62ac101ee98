"""The errors jaxserve raises to its callers; a leaf module every layer may import.

``InvalidRequestError`` is the one type for a request the engine refuses: it names the field
(OpenAI's ``param``) and, where OpenAI has one, the error ``code``. The server maps it to a 400
in one place; offline callers can catch it as the ``ValueError`` it also is.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that cannot be served as given. ``str(err)`` is ``"<param>: <reason>"``."""

    def __init__(self, param: str, reason: str, *, code: str | None = None):
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason
        self.code = code


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's code for a prompt plus output that does not fit the model's context."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served (HTTP 503)."""


class NodeLostError(RuntimeError):
    """A host of a multi-node engine died or hangs; the engine cannot step without it."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (HTTP 503); retry later."""


class ConfigError(ValueError):
    """A setting or model source that cannot work: a missing folder or hub id, a checkpoint jaxserve
    cannot read, a flag out of range. Raised before any request is served; the command line
    reports it in one line and exits with code 2."""
