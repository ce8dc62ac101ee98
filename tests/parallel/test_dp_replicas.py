"""Two engine replicas on fake CPU devices, served (``jaxserve serve --data-parallel-size 2``, one
device each) and offline (``LLM(data_parallel_size=2, tensor_parallel_size=2)``, two devices
each), each in a subprocess.

Requests spread over both replicas (read from the per-replica metrics), greedy answers equal one
engine's, streams dropped mid-way leave no block held on either, and follow-ups whose prompt
extends an earlier one go to the replica that caches it even when the other one is idler.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.parallel.dp_testing import XLA_FLAGS, engine_samples, fake_devices_env, per_engine, wait_replicas_idle
from tests.server.server_testing import start_server, stop_server
from tests.shapes import DEMO_MODEL, SERVER_SHAPE

SUCCESS = "jaxserve:request_success_total"


@pytest.fixture(scope="module")
def dp_server():
    log_path = Path(tempfile.mkdtemp(prefix="jaxserve-dp-")) / "server.log"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", XLA_FLAGS)
        handle = start_server(["--data-parallel-size", "2", "--enable-debug-endpoints"], log_path)
    yield handle
    stop_server(handle)
    assert "Traceback" not in handle.log_tail(200_000), handle.log_tail()


@pytest.fixture(scope="module")
def reference():
    """One engine on the main process's one device: the answers two replicas must give."""
    return LLM(DEMO_MODEL, show_progress=False, **SERVER_SHAPE)


def prompts(seed: int, lengths=(3, 9, 17, 24, 33, 40, 57, 70)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, n).tolist() for n in lengths]


async def post_all(base_url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        responses = await asyncio.gather(*(client.post("/completions", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


def test_concurrent_greedy_requests_spread_over_both_and_match_one_engine(dp_server, reference):
    batch = prompts(11)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference.generate(batch, params, use_tqdm=False)]
    before = per_engine(dp_server.base, SUCCESS)
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True} for p in batch]
    answers = asyncio.run(post_all(dp_server.url, bodies))
    assert [a["choices"][0]["text"] for a in answers] == expected
    served = [after - b for after, b in zip(per_engine(dp_server.base, SUCCESS), before)]
    assert sum(served) == len(batch)
    assert min(served) >= 2, served  # both replicas took a share of the burst
    assert engine_samples(dp_server.base, SUCCESS)["total"] == sum(per_engine(dp_server.base, SUCCESS))


def test_streams_dropped_mid_way_free_every_block_on_both(dp_server):
    before = per_engine(dp_server.base, "jaxserve:generation_tokens_total")
    max_tokens = 200

    async def one(client, i):
        body = {"prompt": [30 + i, 31, 32, 33 + i], "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0.7, "seed": i}
        async with client.stream("POST", "/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    return True  # leaving closes the connection mid-stream
        return False

    async def run():
        async with httpx.AsyncClient(base_url=dp_server.url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(16))), timeout=120)

    assert all(asyncio.run(run()))
    assert wait_replicas_idle(dp_server.base) == [(0.0, 0.0, 0.0), (0.0, 0.0, 0.0)]
    generated = [a - b for a, b in zip(per_engine(dp_server.base, "jaxserve:generation_tokens_total"), before)]
    assert min(generated) > 0, generated  # both replicas ran some of the streams
    assert sum(generated) < 16 * max_tokens / 2, generated  # aborted early, not run to the end


def test_follow_ups_go_to_the_replica_holding_their_prefix(dp_server):
    """A first turn lands on replica 0; eight follow-ups extending it, sent at once, all go there
    too, although a load-only router would give replica 1 half of them."""
    assert wait_replicas_idle(dp_server.base) == [(0.0, 0.0, 0.0), (0.0, 0.0, 0.0)]
    block = SERVER_SHAPE.get("block_size", 16)
    first_turn = prompts(5, lengths=(5 * block,))[0]
    successes = per_engine(dp_server.base, SUCCESS)
    asyncio.run(post_all(dp_server.url, [{"prompt": first_turn, "max_tokens": 4, "temperature": 0}]))
    after_first = per_engine(dp_server.base, SUCCESS)
    assert [a - b for a, b in zip(after_first, successes)] == [1, 0]  # idle tie: the lowest index
    hits = per_engine(dp_server.base, "jaxserve:prefix_cache_hits_total")
    follow_ups = [{"prompt": first_turn + [100 + i] * 8, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
                  for i in range(8)]
    asyncio.run(post_all(dp_server.url, follow_ups))
    after = per_engine(dp_server.base, SUCCESS)
    assert [a - b for a, b in zip(after, after_first)] == [8, 0]
    new_hits = [a - b for a, b in zip(per_engine(dp_server.base, "jaxserve:prefix_cache_hits_total"), hits)]
    assert new_hits[0] >= 8 * 5 * block and new_hits[1] == 0, new_hits
    assert wait_replicas_idle(dp_server.base) == [(0.0, 0.0, 0.0), (0.0, 0.0, 0.0)]


def test_debug_routes_read_every_replica(dp_server):
    """Timelines, step records and the trace merge the replicas; the dashboard page is served."""
    asyncio.run(post_all(dp_server.url, [{"prompt": p, "max_tokens": 8, "temperature": 0} for p in prompts(3)]))
    recent = httpx.get(f"{dp_server.base}/debug/requests", params={"limit": 4}).json()["requests"]
    arrivals = [t["metrics"]["arrival_time"] for t in recent]
    assert len(recent) == 4 and arrivals == sorted(arrivals)
    steps = httpx.get(f"{dp_server.base}/debug/steps", params={"last": 50}).json()["steps"]
    starts = [s["start"] for s in steps]
    assert len(steps) == 50 and starts == sorted(starts)
    assert {s["engine_index"] for s in steps} == {0, 1}  # each record names its replica
    trace = httpx.get(f"{dp_server.base}/debug/trace").json()
    assert trace["traceEvents"]
    assert httpx.get(f"{dp_server.base}/dashboard").status_code == 200


OFFLINE_SCRIPT = """
import json, sys
from jaxserve import LLM, SamplingParams
from tests.shapes import DEMO_MODEL, SERVER_SHAPE
prompts, max_tokens, tp = json.loads(sys.argv[1])
llm = LLM(DEMO_MODEL, show_progress=False, data_parallel_size=2, tensor_parallel_size=tp, **SERVER_SHAPE)
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
served = {m.labels["engine"]: m.value for m in llm.get_metrics() if m.name == "jaxserve:request_success_total"}
engines = sorted({r.engine_index for r in llm.get_step_records()})
print(json.dumps({"token_ids": [o.outputs[0].token_ids for o in outs], "served": served, "engines": engines}))
"""


def run_offline(batch: list[list[int]], max_tokens: int, tensor_parallel_size: int) -> dict:
    """``LLM(data_parallel_size=2, tensor_parallel_size=...)`` in a subprocess with as many fake devices."""
    env = fake_devices_env(2 * tensor_parallel_size)
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT, json.dumps([batch, max_tokens, tensor_parallel_size])],
                          capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_offline_two_replicas_of_two_devices_each_match_one_engine(reference):
    """``LLM(data_parallel_size=2, tensor_parallel_size=2)`` on four devices (the served test
    covers one device per replica)."""
    batch = prompts(23)
    expected = reference.generate(batch, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    result = run_offline(batch, 16, tensor_parallel_size=2)
    assert result["token_ids"] == [list(o.outputs[0].token_ids) for o in expected]
    assert result["served"]["0"] > 0 and result["served"]["1"] > 0
    assert result["served"]["total"] == len(batch)
    assert result["engines"] == [0, 1]  # the step records name their replica


def test_too_few_devices_fail_before_any_weight_loads():
    with pytest.raises(ValueError, match="data_parallel_size=64 x tensor_parallel_size=1 needs 64 devices"):
        LLM(show_progress=False, data_parallel_size=64, model="/nonexistent/never-read")
