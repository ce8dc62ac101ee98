"""A deadline for a request's headers. uvicorn times out only an idle keep-alive connection and
(through ``BodyLimitMiddleware``) a slow body: a client that connects and sends half its headers
(slowloris) would hold its connection forever. This h11 protocol arms a timer whenever the
connection waits for the headers of a request (a new connection, or the first bytes of the next
request on a kept-alive one) and answers 408 and closes when they are not all in by then."""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _timeout_response(timeout_s: float) -> bytes:
    body = json.dumps({"error": {"message": f"the request headers did not arrive within {timeout_s:g} s",
                                 "type": "invalid_request_error", "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header-read deadline of ``timeout_s`` seconds (``--request-header-timeout``)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # some bytes of a request line or headers, not all
                self._arm_header_timer()
            else:
                self._cancel_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._headers_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(_timeout_response(timeout_s))
                self.transport.close()

    return HeaderTimeoutProtocol
