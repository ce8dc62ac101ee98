"""``jaxserve bench startup``: time from ``jaxserve serve`` to a server that answers, cold and warm.

Each start is a fresh ``jaxserve serve --port 0`` subprocess with ``JAXSERVE_CACHE_DIR`` pointing at
the run's own folder: the first start finds it empty (the demo model is built, the cpu attention
kernel compiled, every step variant compiled by XLA: a new machine's first start), the next ones
find everything there (a restart). A start is timed from the spawn to the server's URL line, which
it prints once it accepts connections; where the time went is read from the server's own
``/metrics`` (``jaxserve:startup_seconds`` by phase, ``jaxserve:startup_step_variant_seconds`` by
variant). The hub cache is not touched: a hub model not downloaded yet is downloaded by the cold start.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from jaxserve import envs
from jaxserve.bench import prom
from jaxserve.bench.processes import drain_lines, stop_process, wait_for_url


def add_startup_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=None,
                   help="JAXSERVE_CACHE_DIR of the starts (compilation cache, demo model, built kernels); it "
                        "must not exist yet, so that the first start is cold (default: a temporary folder, "
                        "removed afterwards)")
    p.add_argument("--warm-runs", type=int, default=3,
                   help="starts after the cold one, each reading what the previous ones cached; the median "
                        "is reported (default: 3)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds one start may take before the benchmark gives up (default: 900)")


def run_startup_bench_cli(args: argparse.Namespace, config: Any) -> dict:
    """``config`` is the EngineConfig the flags describe; its non-default fields are passed on."""
    flags = ([args.model] if args.model else []) + config.cli_flags(skip=("model",))
    own_dir = args.cache_dir is None
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="jaxserve-startup-")) / "cache"
    if cache.exists():
        raise SystemExit(f"jaxserve bench startup: --cache-dir {cache} exists; the cold start needs a new folder")
    try:
        cold = start_once(flags, cache, args.timeout)
        warm = [start_once(flags, cache, args.timeout) for _ in range(args.warm_runs)]
    finally:
        if own_dir:
            shutil.rmtree(cache.parent, ignore_errors=True)
    result: dict[str, Any] = {"serve_flags": flags, "cpu_count": os.cpu_count(), "cold": cold}
    if warm:
        result["warm"] = sorted(warm, key=lambda r: r["ready_s"])[len(warm) // 2]
        result["warm_ready_s"] = [r["ready_s"] for r in warm]
        result["warm_ready_s_median"] = statistics.median(result["warm_ready_s"])
    return result


def start_once(flags: list[str], cache_dir: Path, timeout: float) -> dict:
    """Start one server, wait for its URL line, read its start-up metrics, stop it."""
    cmd = [sys.executable, "-m", "jaxserve_server.cli", "serve", *flags, "--host", "127.0.0.1", "--port", "0",
           "--uvicorn-log-level", "warning"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{envs.JAXSERVE_CACHE_DIR: str(cache_dir)})
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=drain_lines, args=(proc, lines), daemon=True)
    reader.start()
    log: list[str] = []
    try:
        url = wait_for_url(lines, log, start + timeout)
        ready_s = time.monotonic() - start
        if url is None:
            raise SystemExit("jaxserve bench startup: the server did not start:\n" + "".join(log[-40:]))
        metrics = prom.fetch(url)
    finally:
        stop_process(proc)
    return {"ready_s": ready_s, **startup_breakdown(metrics, ready_s)}


def startup_breakdown(metrics_text: str, ready_s: float) -> dict:
    """Phases and step variants from ``/metrics``; ``outside_engine_s`` is the rest of the time to
    ready (interpreter and imports, server set-up)."""
    phases: dict[str, float] = {}
    variants: dict[str, dict] = {}
    for sample in prom.read_samples(metrics_text):
        if sample.name == "jaxserve:startup_seconds":
            phases[sample.labels["phase"]] = sample.value
        elif sample.name == "jaxserve:startup_step_variant_seconds":
            variants[sample.labels["variant"]] = {"seconds": sample.value,
                                                  "cached": sample.labels["cached"] == "true"}
    engine_s = sum(phases.values())
    return {"engine_s": engine_s, "outside_engine_s": ready_s - engine_s, "phases_s": phases,
            "num_variants": len(variants), "persistent_cache_hits": sum(v["cached"] for v in variants.values()),
            "variants": dict(sorted(variants.items(), key=lambda kv: _variant_order(kv[0])))}


def _variant_order(name: str) -> tuple[int, str]:
    bucket, _, rest = name.partition("-")
    return (int(bucket), rest) if bucket.isdigit() else (0, name)
