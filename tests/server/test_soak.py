"""The soak benchmark's load against the shared server: misbehaving clients (a share hanging up
at random moments) get no server error, and the server is idle again afterwards."""

from __future__ import annotations

import argparse
import asyncio

from jaxserve.bench.soak import run_load, wait_until_idle


def test_a_small_soak_leaves_no_error_and_an_idle_server(server):
    args = argparse.Namespace(concurrency=8, disconnect_ratio=0.3, max_output_len=8, max_prompt_len=32)
    outcomes = asyncio.run(run_load(server.base, 60, args, seed=3))
    errors = {k: v for k, v in outcomes.items() if k not in ("ok", "disconnected")}
    assert not errors, errors
    assert outcomes["ok"] > 0 and outcomes["disconnected"] > 0, outcomes
    idle = wait_until_idle(server.base)
    assert idle["num_requests_running"] == idle["num_requests_waiting"] == idle["kv_cache_usage_perc"] == 0
