"""The OpenAPI document says what the server does.

FastAPI documents a 422 with its own error shape on every route that takes a body; this server
answers 400 with the OpenAI error body instead (``errors.install_handlers``), so ``openapi()``
replaces those entries. Each route lists the errors it can answer with ``error_responses``; the
body-size and body-timeout middleware can answer 413 and 408 on any route that reads a body.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .middleware import OPEN_PATHS
from .protocol import ErrorResponse

_DESCRIPTIONS = {
    400: "The request is invalid (the error names the field in `param`)",
    401: "Missing or wrong API key",
    404: "No such model",
    408: "The request body did not arrive in time",
    413: "The request body is too large",
    500: "The request failed inside the server (other requests are unaffected)",
    503: "The engine is overloaded (retry after `Retry-After` seconds) or dead",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses, each with the OpenAI error body."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


def install_openapi(app: FastAPI, *, with_auth: bool) -> None:
    """Replace ``app.openapi`` by one without FastAPI's 422s (and, with an API key, a 401 on
    every route that needs the key)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, operations in schema.get("paths", {}).items():
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    responses.pop("422", None)
                    if with_auth and path not in OPEN_PATHS:
                        responses["401"] = _response_entry(401)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _response_entry(status: int) -> dict[str, Any]:
    return {"description": _DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
