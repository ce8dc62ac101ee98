"""``jaxserve bench startup``: a cold start (empty caches) and a warm one, each a real server in its
own process, with the time to ready split by phase and by step variant."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.shapes import BACKEND_COMPARISON_SHAPE

PHASES = ["model", "weights", "runner", "compile", "first_runs", "tokenizer"]


def test_bench_startup_cold_then_warm(tmp_path):
    flags = [arg for k, v in BACKEND_COMPARISON_SHAPE.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    cmd = [sys.executable, "-m", "jaxserve_server.cli", "bench", "startup", *flags, "--warm-runs", "1",
           "--cache-dir", str(tmp_path / "cache"), "--timeout", "600"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    cold, warm = result["cold"], result["warm"]
    assert result["serve_flags"] == flags and result["warm_ready_s"] == [warm["ready_s"]]
    for run in (cold, warm):
        assert list(run["phases_s"]) == PHASES
        assert 0 < run["engine_s"] < run["ready_s"] and run["outside_engine_s"] > 0
        assert run["num_variants"] == len(run["variants"]) == 2  # token buckets 16 and 32
    assert cold["persistent_cache_hits"] == 0 and not any(v["cached"] for v in cold["variants"].values())
    assert warm["persistent_cache_hits"] == 2 and all(v["cached"] for v in warm["variants"].values())
    assert (tmp_path / "cache" / "models").is_dir()  # the cold start built the demo model there
