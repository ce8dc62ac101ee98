"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

``APIError`` is raised by the handlers; ``engine_error`` maps what the engine raises to it (a
refused request is 400, an overloaded or dead engine 503). The exception handlers installed by
``install_handlers`` also turn FastAPI's request validation errors (422 there) into 400s and
Starlette's 404/405 into the same body shape.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve import EngineDeadError, EngineOverloadedError, InvalidRequestError


class InvalidTextError(ValueError):
    """A string of the body that is not Unicode text (a lone surrogate, which JSON can spell as
    ``"\\ud800"`` but UTF-8 cannot encode); ``param`` is where it is, as ``messages.0.content``."""

    def __init__(self, param: str):
        super().__init__(f"{param}: not valid Unicode text (it contains a lone surrogate)")
        self.param = param



logger = logging.getLogger("jaxserve.server")

# Code of every 503 caused by a failed engine loop (requests, /health alike).
ENGINE_DEAD = "engine_dead"
# Retry-After of a 503, in seconds.
OVERLOADED_RETRY_AFTER_S = 1
DEAD_RETRY_AFTER_S = 30
# Validation errors listed one by one in a 400's message; the rest are counted.
MAX_LISTED_ERRORS = 5

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    408: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")


def safe_text(text: str | None) -> str | None:
    """``text`` with anything UTF-8 cannot encode (a lone surrogate echoed from the request)
    replaced, so that an error body can always be rendered."""
    if text is None:
        return None
    return str(text).encode("utf-8", "replace").decode("utf-8")


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict:
    return {"error": {"message": safe_text(message), "type": type or _TYPES.get(status, "server_error"),
                      "param": safe_text(param), "code": code}}


def error_response(status: int, message: str, **kw) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kw), status_code=status)


def retry_after_headers(status: int, code: str | None) -> dict[str, str] | None:
    """A 503 says when to try again: soon when the queue is full, later when the engine is dead
    (a supervisor restarts it)."""
    if status != 503:
        return None
    return {"Retry-After": str(DEAD_RETRY_AFTER_S if code == ENGINE_DEAD else OVERLOADED_RETRY_AFTER_S)}


def api_error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, param=exc.param, code=exc.code, type=exc.type),
                        status_code=exc.status, headers=retry_after_headers(exc.status, exc.code))


def sse_error(exc: APIError) -> str:
    body = error_body(exc.status, exc.message, param=exc.param, code=exc.code, type=exc.type)
    return f"data: {json.dumps(body)}\n\n"


def invalid_request(exc: InvalidRequestError) -> APIError:
    """The 400 for a request the engine refused: ``param`` and ``code`` come from the exception."""
    return APIError(400, str(exc), param=exc.param, code=exc.code)


def bad_request(exc: ValueError) -> APIError:
    """The 400 for a ``ValueError`` raised on the request's input (``SamplingParams``, the engine).

    The engine's refusals are ``InvalidRequestError``s and carry their field; any other
    ``ValueError`` (a tokenizer refusing its input, say) still belongs to the request, but names
    no field."""
    if isinstance(exc, InvalidRequestError):
        return invalid_request(exc)
    return APIError(400, str(exc))


def engine_error(exc: BaseException) -> APIError:
    """Map an exception from ``generate`` to the HTTP error the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return bad_request(exc)
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code=ENGINE_DEAD)
    logger.error("generation failed: %r", exc)
    return APIError(500, f"internal error during generation: {type(exc).__name__}: {exc}")


# Fields typed as unions: pydantic reports one error per alternative; say what is accepted instead.
_UNION_HINTS = {
    "prompt": "must be a non-empty string, list of strings, list of token ids or list of token-id lists",
    "stop": "must be a non-empty string or a list of them",
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts = []
    first_param = None
    union_fields = {str(e["loc"][1]) for e in errors
                    if len(e.get("loc", ())) >= 3 and e["loc"][0] == "body" and str(e["loc"][1]) in _UNION_HINTS
                    and e.get("type") != "missing"}
    for name in sorted(union_fields):
        parts.append(f"{name}: {_UNION_HINTS[name]}")
        first_param = first_param or name
    errors = [e for e in errors if not (len(e.get("loc", ())) >= 2 and str(e["loc"][1]) in union_fields)]
    for err in errors[:MAX_LISTED_ERRORS]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        kind = err.get("type", "")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidTextError):
            return str(cause), cause.param
        if kind == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"the request body is not valid JSON ({ctx.get('error', 'parse error')})", None
        if kind == "extra_forbidden":
            msg = f"{where}: unknown field, not supported by jaxserve"
        elif kind == "missing":
            msg = f"{where}: field required"
        else:
            msg = f"{where}: {err.get('msg', 'invalid value')}" if where else err.get("msg", "invalid value")
        if first_param is None and loc:
            first_param = loc[0]
        parts.append(msg)
    if len(errors) > MAX_LISTED_ERRORS:
        parts.append(f"... and {len(errors) - MAX_LISTED_ERRORS} more")
    return "; ".join(parts) or "invalid request", first_param


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed for {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}")
