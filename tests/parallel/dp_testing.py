"""Helpers of the data-parallel tests: per-replica samples of ``/metrics`` and of the offline
``LLM.get_metrics()``, and the fake-device environment of their subprocesses."""

from __future__ import annotations

import os
import re
import time

import httpx

# The main pytest process has initialised jax with one CPU device; a subprocess with this flag
# gets several (the replicas' device groups).
XLA_FLAGS = "--xla_force_host_platform_device_count=2"
_SAMPLE = re.compile(r'^([^{\s]+)\{([^}]*)\}\s+(\S+)$')


def fake_devices_env(count: int = 2) -> dict[str, str]:
    """The environment of a subprocess whose jax sees ``count`` CPU devices."""
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={count}")


def engine_samples(base: str, name: str) -> dict[str, float]:
    """``name``'s value per ``engine`` label (``"0"``, ``"1"``, ``"total"``), summed over its other labels."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != name:
            continue
        labels = dict(kv.split("=", 1) for kv in re.findall(r'\w+="[^"]*"', m.group(2)))
        engine = labels.get("engine", '""').strip('"')
        out[engine] = out.get(engine, 0.0) + float(m.group(3))
    return out


def per_engine(base: str, name: str, engines: int = 2) -> list[float]:
    """``name`` for replicas ``0 .. engines-1`` (0 for one without a sample yet)."""
    samples = engine_samples(base, name)
    return [samples.get(str(i), 0.0) for i in range(engines)]


def wait_replicas_idle(base: str, engines: int = 2, timeout_s: float = 20.0) -> list[tuple[float, float, float]]:
    """Poll until no replica runs, queues or holds a KV block; returns (running, waiting, usage) per replica."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = list(zip(per_engine(base, "jaxserve:num_requests_running", engines),
                         per_engine(base, "jaxserve:num_requests_waiting", engines),
                         per_engine(base, "jaxserve:kv_cache_usage_perc", engines)))
        if all(v == 0 for s in state for v in s) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)
