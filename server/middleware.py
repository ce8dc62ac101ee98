"""Pure ASGI middleware (no BaseHTTPMiddleware, so disconnects still reach the handlers).

``AuthMiddleware``: with an API key set, every route except the open ones needs
``Authorization: Bearer <key>`` (401 otherwise).
``BodyLimitMiddleware``: 413 when ``Content-Length`` or the bytes actually received exceed the
limit, 408 when the body takes longer than its timeout; the body is read here (bounded in size
and time) and replayed to the app, after which ``receive`` is the
server's own again, so a handler can still wait for ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Iterable

from .errors import error_body

# /dashboard is a static page with no data of its own: a browser cannot send a bearer token when it
# opens a page, so the page takes the key from its URL fragment and sends it with its requests.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", "/dashboard"})


async def _send_error(send, status: int, message: str, *, code: str | None = None,
                      headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self.expected):
            msg = ("missing API key: send 'Authorization: Bearer <key>'" if not given
                   else "invalid API key")
            return await _send_error(send, 401, msg, code="invalid_api_key",
                                     headers=[(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def _too_large(self, send, size_text: str):
        return _send_error(send, 413, f"the request body ({size_text}) exceeds the limit of {self.max_bytes} "
                                      "bytes (--max-request-body-bytes)", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _send_error(send, 400, "invalid Content-Length header")
                if declared > self.max_bytes:
                    return await self._too_large(send, f"{declared} bytes")
                break
        # Read the whole body now, counting what actually arrives (chunked bodies have no length),
        # within timeout_s: a client that sends half a body does not hold a connection for long.
        chunks: list[bytes] = []
        size = 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                return await _send_error(send, 408, f"the request body did not arrive within {self.timeout_s:g} s "
                                                    "(--request-body-timeout)", code="request_timeout",
                                         headers=[(b"connection", b"close")])
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(send, f"more than {self.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
