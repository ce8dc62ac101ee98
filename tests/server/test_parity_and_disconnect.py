"""Greedy over HTTP equals ``LLM.generate``; clients that leave (streaming or not) free their blocks."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np

from jaxserve import LLM, SamplingParams
from tests.server.server_testing import metric, start_server, stop_server, wait_idle
from tests.shapes import DEMO_MODEL, SERVER_SHAPE


def parity_prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 1000, n).tolist() for n in (1, 4, 9, 17, 33, 70, 120)]


def test_greedy_matches_offline_llm(server, openai_client):
    prompts = parity_prompts()
    llm = LLM(DEMO_MODEL, show_progress=False, **SERVER_SHAPE)
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    text_prompts = ["Hello, my name is", "The capital of France is", "日本語 and 😀 mixed"]
    expected_text = llm.generate(text_prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    del llm

    # One batched request (every prompt in one body) and one request per prompt, concurrently.
    batch = openai_client.completions.create(model="jaxserve-demo", prompt=prompts, max_tokens=20, temperature=0,
                                             logprobs=0, extra_body={"ignore_eos": True})
    assert [c.text for c in batch.choices] == [e.outputs[0].text for e in expected]
    for choice, exp in zip(batch.choices, expected):
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(exp.outputs[0].token_ids)

    async def one_by_one():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            rs = await asyncio.gather(*(client.post("/completions", json={
                "prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True}) for p in prompts))
            return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(one_by_one()) == [e.outputs[0].text for e in expected]

    for prompt, exp in zip(text_prompts, expected_text):
        resp = openai_client.completions.create(model="jaxserve-demo", prompt=prompt, max_tokens=12, temperature=0)
        assert resp.choices[0].text == exp.outputs[0].text
        assert resp.choices[0].finish_reason == exp.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert resp.usage.completion_tokens == len(exp.outputs[0].token_ids)


def test_streaming_clients_that_disconnect_free_their_blocks(server):
    """50 streams, each dropped after its first token; nothing stays running or allocated."""
    before = metric(server.base, "jaxserve:generation_tokens_total")
    max_tokens = 200

    async def one(client, i):
        body = {"prompt": [20 + i, 30, 40, 50 + i], "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0.5, "seed": i}
        async with client.stream("POST", "/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(50))), timeout=120)

    assert all(asyncio.run(run()))
    running, usage = wait_idle(server.base)
    assert running == 0 and usage == 0
    generated = metric(server.base, "jaxserve:generation_tokens_total") - before
    assert generated < 50 * max_tokens / 2, generated  # aborted early, not run to the end


def test_non_streaming_client_that_disconnects_is_aborted(server):
    before = metric(server.base, "jaxserve:generation_tokens_total")
    max_tokens = 240

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            task = asyncio.create_task(client.post("/completions", json={
                "prompt": [7, 8, 9, 10], "max_tokens": max_tokens, "ignore_eos": True, "n": 4, "temperature": 1.0}))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not task.done():
                if await asyncio.to_thread(metric, server.base, "jaxserve:num_requests_running") > 0:
                    break
                await asyncio.sleep(0.01)
            assert not task.done(), "the request finished before the client could leave"
            task.cancel()  # closes the connection
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    running, usage = wait_idle(server.base)
    assert running == 0 and usage == 0
    generated = metric(server.base, "jaxserve:generation_tokens_total") - before
    assert generated < 4 * max_tokens, generated
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_sync_scheduling_server_matches_and_frees_its_blocks(tmp_path):
    """A server with --no-async-scheduling streams the offline greedy text (the shared server
    schedules asynchronously, the default), and clients that leave mid-stream still free every
    block."""
    prompts = parity_prompts()
    llm = LLM(DEMO_MODEL, show_progress=False, **SERVER_SHAPE)
    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)]
    del llm
    handle = start_server(["--no-async-scheduling"], tmp_path / "server.log")
    try:
        async def stream_text(client, prompt):
            body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True}
            text = ""
            async with client.stream("POST", "/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[len("data: "):])["choices"][0]["text"]
            return text

        async def leave_early(client, i):
            body = {"prompt": [20 + i, 30, 40], "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        return True

        async def run():
            async with httpx.AsyncClient(base_url=handle.url, timeout=120) as client:
                texts = await asyncio.gather(*(stream_text(client, p) for p in prompts))
                left = await asyncio.gather(*(leave_early(client, i) for i in range(20)))
                return texts, left

        texts, left = asyncio.run(run())
        assert texts == expected and all(left)
        running, usage = wait_idle(handle.base)
        assert running == 0 and usage == 0
    finally:
        stop_server(handle)
    assert "Traceback" not in handle.log_tail(200_000), handle.log_tail()
