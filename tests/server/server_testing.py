"""Helpers for the server suite: start and stop a real ``jaxserve serve``, read ``/metrics``,
check OpenAI-style error bodies.

The server binds ``--port 0`` and announces its URL on stdout once the socket accepts
connections; :func:`start_server` reads it from there (no free-port race), then checks ``/health``.
Compiles come from the persistent cache under ``JAXSERVE_CACHE_DIR`` after the first run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jaxserve.bench import prom
from jaxserve.bench.processes import stop_process
from tests.shapes import DEMO_MODEL, SERVER_SHAPE

# The shared server's admission limits, which the error tests probe.
MAX_WAITING = 64
MAX_BODY_BYTES = 65536
# A cold start compiles every bucket when the persistent cache is empty.
START_TIMEOUT_S = 300
# The response header naming request fields the server ignored (spelled out: the wire name is API).
IGNORED_FIELDS_HEADER = "X-Jaxserve-Ignored-Fields"


def engine_flags(model: str = DEMO_MODEL) -> list[str]:
    """The server suite's engine shape as ``jaxserve serve`` arguments, serving ``model``."""
    flags = [model]
    for key, value in SERVER_SHAPE.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


class ServerHandle:
    """A running server process, its OpenAI base ``url`` (``.../v1``) and its log file."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, log_file=None):
        self.proc = proc
        self.log_file = log_file
        self.url = url  # http://127.0.0.1:PORT/v1
        self.base = url[: -len("/v1")]
        self.log_path = log_path

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def start_server(extra: list[str], log_path: Path) -> ServerHandle:
    """Start ``jaxserve serve`` with the server shape plus ``extra`` flags; returns once /health
    answers 200, or raises with the log's tail."""
    # A leading positional in ``extra`` is the model to serve instead of the random demo.
    model, extra = (extra[0], extra[1:]) if extra and not extra[0].startswith("-") else (DEMO_MODEL, extra)
    cmd = [sys.executable, "-m", "jaxserve_server.cli", "serve", *engine_flags(model), "--host", "127.0.0.1",
           "--port", "0", "--uvicorn-log-level", "warning", *extra]
    log = open(log_path, "wb")
    env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + START_TIMEOUT_S
    url = None
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        m = re.search(r"jaxserve: serving \S+ at (http://127\.0\.0\.1:\d+/v1)", text)
        if m:
            url = m.group(1)
            break
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    if url is None:
        proc.kill()
        proc.wait(10)
        log.close()
        raise RuntimeError(f"the server did not start:\n{log_path.read_text(errors='replace')[-4000:]}")
    handle = ServerHandle(proc, url, log_path, log)
    for _ in range(50):
        try:
            if httpx.get(f"{handle.base}/health", timeout=5).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_server(handle)
    raise RuntimeError("the server never became healthy")


def stop_server(handle: ServerHandle) -> None:
    """Terminate (kill after 30 s) and close the log."""
    stop_process(handle.proc)
    if handle.log_file is not None:
        handle.log_file.close()


def metric(base: str, name: str) -> float:
    """One sample of /metrics (summed over labels); 0 for a labelled metric not yet touched."""
    text = prom.fetch(base, timeout=10)
    values = prom.summed(prom.read_samples(text))
    assert name in values or prom.declared(text, name), f"{name} not in /metrics"
    return values.get(name, 0.0)


def wait_idle(base: str, timeout_s: float = 15.0) -> tuple[float, float]:
    """Poll until no request runs or waits and the KV cache is empty; returns the last values."""
    deadline = time.monotonic() + timeout_s
    running = usage = waiting = -1.0
    while time.monotonic() < deadline:
        running = metric(base, "jaxserve:num_requests_running")
        waiting = metric(base, "jaxserve:num_requests_waiting")
        usage = metric(base, "jaxserve:kv_cache_usage_perc")
        if running == 0 and waiting == 0 and usage == 0:
            break
        time.sleep(0.05)
    return running + waiting, usage


def assert_error(resp: httpx.Response, status: int, *, param: str | None = None, contains: str | None = None) -> dict:
    """``resp`` is an OpenAI-style error body with ``status`` (and ``param``, ``contains`` if given);
    returns its ``error`` object."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains.lower() in err["message"].lower(), err
    return err
