"""Timelines, step records and the trace over HTTP (``--enable-debug-endpoints``), from the shared
live server: the API-entry stages of a chat, a prefix hit, a stop string, a client that leaves,
a preemption, and ``jaxserve trace``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from types import SimpleNamespace

import httpx
import numpy as np

from jaxserve_server.cli import main as cli_main
from tests.server.server_testing import assert_error, wait_idle
from tests.shapes import SERVER_SHAPE
from tests.trace_checks import check_chrome_trace

BLOCK = 16  # the default block size


def timeline(http, request_id: str) -> dict:
    resp = http.get(f"/debug/requests/{request_id}")
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_chat_timeline_has_every_stage_and_the_effective_params(http):
    resp = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Tell me about prefix caching."}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200
    body = resp.json()
    t = timeline(http, body["id"])
    m = t["metrics"]
    order = ["received_time", "templated_time", "tokenized_time", "queued_time", "first_scheduled_time",
             "first_token_time", "last_token_time", "finished_time"]
    values = [m[k] for k in order]
    assert None not in values and values == sorted(values), m
    assert m["received_time"] <= m["arrival_time"] <= m["queued_time"]
    assert m["num_generation_tokens"] == body["usage"]["completion_tokens"] == 6
    assert t["num_prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert t["finished"] and t["samples"][0]["finish_reason"] == "length" == t["samples"][0]["finish_cause"]
    params = t["sampling_params"]
    assert params["max_tokens"] == 6 and params["temperature"] == 0 and params["ignore_eos"] is True
    assert t["prompt_token_ids"] is None  # not without --record-token-ids
    assert_error(http.get("/debug/requests/no-such-request"), 404, param="request_id")


def test_text_the_server_tokenizes_is_stamped_before_the_engine(http):
    resp = http.post("/v1/completions", json={"prompt": "one two three four five six", "max_tokens": 2,
                                               "truncate_prompt_tokens": 3})
    assert resp.status_code == 200
    m = timeline(http, resp.json()["id"])["metrics"]
    assert m["templated_time"] is None  # no chat template
    assert m["received_time"] <= m["tokenized_time"] <= m["arrival_time"] <= m["queued_time"]


def test_prefix_hit_and_stop_string(http):
    prompt = np.random.default_rng(11).integers(3, 1000, 70).tolist()
    first = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True}).json()
    text = first["choices"][0]["text"]
    stop = next(c for c in text[1:] if c.strip())
    second = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                "stop": [stop]}).json()
    assert second["choices"][0]["finish_reason"] == "stop"
    t1, t2 = timeline(http, first["id"]), timeline(http, second["id"])
    assert t1["num_cached_tokens"] == 0
    assert t2["num_cached_tokens"] == (len(prompt) - 1) // BLOCK * BLOCK
    assert t2["samples"][0]["finish_cause"] == "stop_string" and t2["samples"][0]["stop_reason"] == stop
    assert t2["sampling_params"]["stop"] == [stop]
    steps = http.get("/debug/steps", params={"last": 50}).json()["steps"]
    admitted = [s for s in steps if second["id"] in s["new_request_ids"]]
    assert admitted and admitted[-1]["scheduled"][second["id"]] == len(prompt) - t2["num_cached_tokens"]


def test_client_that_leaves_mid_stream_is_a_disconnect(server, http):
    async def leave_after_first_chunk() -> str:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        return json.loads(line[len("data: "):])["id"]
        raise AssertionError("no chunk")

    request_id = asyncio.run(leave_after_first_chunk())
    running, usage = wait_idle(server.base)
    assert running == 0 and usage == 0
    t = timeline(http, request_id)
    assert t["finished"]
    assert t["samples"][0]["finish_reason"] == "abort" and t["samples"][0]["finish_cause"] == "client_disconnect"
    assert t["samples"][0]["num_output_tokens"] < 200


def test_preemption_shows_in_steps_and_timelines(server, http):
    """max_num_seqs requests in lockstep, each to max_model_len: one block more than the pool."""
    seqs, max_len = SERVER_SHAPE["max_num_seqs"], SERVER_SHAPE["max_model_len"]
    assert seqs * max_len // BLOCK > SERVER_SHAPE["num_gpu_blocks_override"] - 1
    before = http.get("/debug/steps", params={"last": 1}).json()["steps"]
    last_step = before[-1]["step"] if before else 0

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=seqs)) as client:
            rs = await asyncio.gather(*(client.post("/completions", json={
                "prompt": [900 + i, 11, 12, 13], "max_tokens": max_len - 4, "ignore_eos": True, "temperature": 0})
                for i in range(seqs)))
            return [r.json()["id"] for r in rs]

    ids = asyncio.run(run())
    steps = [s for s in http.get("/debug/steps", params={"last": 4000}).json()["steps"] if s["step"] > last_step]
    preempted = {rid for s in steps for rid in s["preempted_ids"]}
    assert preempted and preempted <= set(ids)
    for rid in preempted:
        t = timeline(http, rid)
        assert t["metrics"]["num_preemptions"] >= 1 and t["samples"][0]["finish_cause"] == "length"
    assert any(s["waiting_reason"] == "preemption" for s in steps if s["preempted_ids"] and s["waiting_ids"])
    for s in steps:
        b = s["blocks"]
        assert b["used"] + b["free"] == b["total"] and 0 <= b["cached_free"] <= b["free"]


def test_trace_endpoint_and_command(server, http, tmp_path, capsys):
    http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
    num_requests = len(http.get("/debug/requests", params={"limit": 5}).json()["requests"])
    num_steps = len(http.get("/debug/steps", params={"last": 50}).json()["steps"])
    trace = http.get("/debug/trace", params={"steps": 50, "requests": 5}).json()
    tracks = check_chrome_trace(trace)
    assert sum(1 for (pid, _) in tracks if pid == 2) == num_requests >= 1
    assert sum(1 for e in tracks[(1, 1)] if e["name"].endswith("schedule+prepare")) == num_steps >= 1
    out = tmp_path / "trace.json"
    assert cli_main(["trace", server.url, "-o", str(out), "--steps", "50", "--requests", "5"]) == 0
    summary = json.loads(capsys.readouterr().out)
    check_chrome_trace(json.loads(out.read_text()))
    assert (summary["requests"], summary["steps"], summary["output"]) == (num_requests, num_steps, str(out))


def test_with_an_api_key_the_page_opens_and_its_data_needs_the_key(demo_model):
    """A browser cannot send a bearer token when it opens a page: the page is open (it holds no
    data) and passes the key from its URL fragment to the debug routes, which still require it."""
    from transformers import AutoTokenizer

    from jaxserve import EngineConfig
    from jaxserve_server.app import build_app

    engine = SimpleNamespace(config=EngineConfig(), tokenizer=AutoTokenizer.from_pretrained(demo_model),
                             served_model_name="m", max_model_len=64,
                             input_pool=concurrent.futures.ThreadPoolExecutor(1),
                             model_config=SimpleNamespace(vocab_size=8),
                             is_dead=False, get_step_records=lambda n: [])
    app = build_app(engine, api_key="sekrit", enable_debug_endpoints=True)

    async def get_all():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://inproc") as c:
            return (await c.get("/dashboard"), await c.get("/debug/steps"),
                    await c.get("/debug/steps", headers={"Authorization": "Bearer sekrit"}))

    page, without_key, with_key = asyncio.run(get_all())
    assert page.status_code == 200 and "location.hash" in page.text and "Authorization" in page.text
    assert without_key.status_code == 401 and with_key.status_code == 200 and with_key.json() == {"steps": []}
