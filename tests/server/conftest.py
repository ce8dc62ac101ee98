"""Fixtures of the server suite: one real ``jaxserve serve`` (uvicorn, demo model, small engine)
for the whole session, and clients for it. The helpers live in ``server_testing.py``."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest

from tests.server.server_testing import MAX_BODY_BYTES, MAX_WAITING, start_server, stop_server


@pytest.fixture(scope="session")
def server():
    log_path = Path(tempfile.mkdtemp(prefix="jaxserve-srv-")) / "server.log"
    handle = start_server(["--max-waiting", str(MAX_WAITING), "--max-request-body-bytes", str(MAX_BODY_BYTES),
                           "--enable-tokenizer-info-endpoint"], log_path)
    yield handle
    stop_server(handle)
    assert "Traceback" not in handle.log_tail(200_000), handle.log_tail()


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base, timeout=60) as client:
        yield client
