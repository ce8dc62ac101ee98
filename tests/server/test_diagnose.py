"""``jaxserve diagnose`` against the shared live server: each failure row it claims is flagged on a
workload made to show it, and a healthy window stays quiet. ``--compare-eager`` finds no
difference on the demo model, and its comparison names the first differing token and the gap."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import numpy as np
import pytest

from jaxserve_server.cli import main as cli_main
from jaxserve_server.diagnose import first_difference, watch
from tests.server.server_testing import wait_idle
from tests.shapes import DEMO_MODEL, SERVER_SHAPE

WINDOW_S = 6.0


def during(server, load, window_s: float = WINDOW_S) -> dict:
    """Watch the server for a window while ``load(url)`` runs in a thread (started with the window)."""
    wait_idle(server.base)
    thread = threading.Thread(target=load, args=(server.url,), daemon=True)
    result: dict = {}

    def start_load_soon():
        thread.start()

    timer = threading.Timer(0.2, start_load_soon)
    timer.start()
    result = watch(server.url, window_s)
    timer.join()
    thread.join(60)
    assert not thread.is_alive(), "the load outlived the window"
    return result


def ids(result: dict) -> list[str]:
    return [f["id"] for f in result["findings"]]


def healthy(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(4):
            assert client.post("/completions", json={"prompt": [3 + i, 4, 5], "max_tokens": 16}).status_code == 200


def lockstep_to_max_len(url: str) -> None:
    """max_num_seqs requests admitted together, each to max_model_len: more blocks than the pool."""
    seqs, max_len = SERVER_SHAPE["max_num_seqs"], SERVER_SHAPE["max_model_len"]

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=seqs)) as c:
            await asyncio.gather(*(c.post("/completions", json={
                "prompt": [700 + i, 11, 12, 13], "max_tokens": max_len - 4, "ignore_eos": True}) for i in range(seqs)))

    asyncio.run(run())


def long_prompts_among_decodes(url: str) -> None:
    """Eight streams decoding while long prompts (two budget-sized prefill chunks each) keep arriving.
    The prompts are new each time: a prefix-cache hit would leave only a short chunk to compute."""
    rng = np.random.default_rng()

    async def decode(c, i):
        await c.post("/completions", json={"prompt": [50 + i, 2], "max_tokens": 220, "ignore_eos": True})

    async def long_prompts(c):
        await asyncio.sleep(0.1)
        for _ in range(10):
            prompt = rng.integers(3, 1000, SERVER_SHAPE["max_model_len"] - 8).tolist()
            await c.post("/completions", json={"prompt": prompt, "max_tokens": 1})

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            await asyncio.gather(*(decode(c, i) for i in range(8)), long_prompts(c))

    asyncio.run(run())


def huge_texts_to_truncate(url: str) -> None:
    """Text prompts near the body limit, truncated by the server: tokenizing them is the work."""
    words = " ".join(f"word{i % 97} token{i % 13}" for i in range(5000))[:60000]
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(4):
            resp = client.post("/completions", json={"prompt": words, "max_tokens": 2, "truncate_prompt_tokens": 32})
            assert resp.status_code == 200, resp.text


def test_healthy_window_is_quiet(server):
    result = during(server, healthy)
    assert result["requests"] >= 4 and result["steps"] > 0
    assert result["findings"] == [], result
    # measured all the same
    assert set(result["checks"]) == {"api_bound", "prefill_stall", "kv_pressure", "spec_not_paying"}
    assert result["checks"]["kv_pressure"]["preemptions"] == 0


def test_kv_pressure_is_flagged(server):
    result = during(server, lockstep_to_max_len, window_s=10.0)
    assert "kv_pressure" in ids(result), result
    finding = next(f for f in result["findings"] if f["id"] == "kv_pressure")
    assert finding["evidence"]["preemptions"] >= 1 and finding["evidence"]["max_kv_used_share"] >= 0.9
    assert "--max-num-seqs" in finding["try"] and finding["not_first"] and finding["module"]


def test_prefill_stall_is_flagged(server):
    result = during(server, long_prompts_among_decodes, window_s=10.0)
    assert "prefill_stall" in ids(result), result
    evidence = next(f for f in result["findings"] if f["id"] == "prefill_stall")["evidence"]
    assert evidence["ratio"] >= evidence["threshold_ratio"] and evidence["decodes_delayed"] > 0
    assert evidence["largest_prefill_chunk"] > SERVER_SHAPE["max_num_batched_tokens"] // 2


def test_api_bound_is_flagged(server):
    result = during(server, huge_texts_to_truncate)
    assert ids(result) == ["api_bound"], result
    evidence = result["findings"][0]["evidence"]
    assert evidence["median_pre_engine_share"] >= evidence["threshold_share"]


def test_compare_eager_on_the_demo_model(server, capsys):
    shape = ["--model", DEMO_MODEL] + [f"--{k.replace('_', '-')}={v}" for k, v in SERVER_SHAPE.items()]
    assert cli_main(["diagnose", "--compare-eager", "--max-tokens", "6", "--prompt", "Hello there", *shape]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["compare_eager"]["first_differences"] == [None] and result["findings"] == []


def test_first_difference_names_the_token_and_the_gap():
    compiled = [{5: -0.1, 6: -2.0}, {7: -0.5, 8: -0.9}]
    eager = [{5: -0.1, 6: -2.1}, {8: -0.6, 7: -0.7}]
    diff = first_difference(compiled, eager)
    assert diff == pytest.approx({"position": 1, "compiled_token": 7, "eager_token": 8, "compiled_margin": 0.4,
                                  "eager_margin": 0.1, "logprob_gap": 0.2})
    assert first_difference(compiled, compiled) is None
