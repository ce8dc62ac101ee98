"""Long work for one client never stalls the others: a 10 MB prompt is tokenized off the event
loop (``/health`` and a short request are answered meanwhile, shown by the order in which the
answers arrive), headers or a body sent halfway are cut off, and an idle keep-alive connection is closed.

One server of its own: a body limit and prompt limit large enough for a 10 MB prompt, and short
header, body and keep-alive timeouts.
"""

from __future__ import annotations

import asyncio
import socket
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.server.server_testing import start_server, stop_server

BODY_TIMEOUT_S = 1
HEADER_TIMEOUT_S = 1
KEEP_ALIVE_S = 1
BIG_PROMPT = "hello world, this is a long prompt. " * 300_000  # ~10.8 MB


@pytest.fixture(scope="module")
def slow_server():
    log_path = Path(tempfile.mkdtemp(prefix="jaxserve-slow-")) / "server.log"
    handle = start_server(["--max-prompt-chars", "20000000", "--max-request-body-bytes", "16000000",
                           "--request-body-timeout", str(BODY_TIMEOUT_S), "--timeout-keep-alive", str(KEEP_ALIVE_S),
                           "--request-header-timeout", str(HEADER_TIMEOUT_S)],
                          log_path)
    yield handle
    stop_server(handle)
    assert "Traceback" not in handle.log_tail(200_000), handle.log_tail()


def test_health_and_a_short_request_are_answered_while_a_big_prompt_is_tokenized(slow_server):
    async def run() -> list[str]:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=slow_server.base, timeout=300) as client:
            async def request(name: str, method: str, path: str, **kw) -> httpx.Response:
                r = await client.request(method, path, **kw)
                order.append(name)
                return r

            big = asyncio.create_task(request("big", "POST", "/v1/completions",
                                              json={"prompt": BIG_PROMPT, "max_tokens": 1}))
            await asyncio.sleep(1.0)  # the body is in (localhost); tokenizing it takes many seconds
            health = await request("health", "GET", "/health")
            short = await request("short", "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert health.status_code == 200 and short.status_code == 200, short.text
            answer = await big
        # Refused once tokenized: far over max_model_len.
        assert answer.status_code == 400 and "max_model_len" in answer.json()["error"]["message"]
        return order

    order = asyncio.run(run())
    assert order == ["health", "short", "big"], order


def _connect(url: str) -> socket.socket:
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=30)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_half_sent_bodies_are_cut_off(slow_server):
    """20 clients that send half their body get a 408 and a closed connection."""
    socks = []
    for _ in range(20):
        sock = _connect(slow_server.base)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hal")
        socks.append(sock)
    started = time.monotonic()
    answers = [_read_until_closed(s) for s in socks]
    for sock in socks:
        sock.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[0][:200]
    assert time.monotonic() - started < 20 * BODY_TIMEOUT_S


def test_half_sent_headers_are_cut_off(slow_server):
    """Clients that send half their headers (also after a first request on the same connection),
    or connect and send nothing, get a 408 and a closed connection."""
    fresh = [_connect(slow_server.base) for _ in range(3)]
    fresh[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    fresh[1].sendall(b"GET /hea")
    kept = _connect(slow_server.base)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    while not first.endswith(b"\r\n\r\n"):  # /health answers with an empty body
        first += kept.recv(65536)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost")  # the next request, half of it
    answers = [_read_until_closed(s) for s in [*fresh, kept]]
    for sock in [*fresh, kept]:
        sock.close()
    assert first.startswith(b"HTTP/1.1 200"), first
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers
    assert b"headers did not arrive" in answers[0]


def test_an_idle_keep_alive_connection_is_closed(slow_server):
    sock = _connect(slow_server.base)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = _read_until_closed(sock)  # returns once the server closes the idle connection
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200")
