"""The OpenAI surface through the official ``openai`` client (and raw SSE through httpx)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.shapes import SERVER_SHAPE

MODEL = "jaxserve-demo"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the river."}]


def sse_events(text: str) -> list:
    """Parse an SSE body into JSON payloads, with the literal '[DONE]' kept as a string."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_list(openai_client, http):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list"
    card = raw["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == SERVER_SHAPE["max_model_len"]
    assert openai_client.models.retrieve(MODEL).id == MODEL


def test_completion_basic_shape(openai_client):
    resp = openai_client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == MODEL
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.index == 0 and isinstance(choice.text, str) and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 5
    # Greedy is deterministic.
    again = openai_client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert again.choices[0].text == choice.text


def test_completion_default_max_tokens_is_16(openai_client):
    resp = openai_client.completions.create(model=MODEL, prompt="hello", temperature=0,
                                            extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16


def test_completion_prompt_forms(openai_client):
    tok_ids = [[5, 6, 7, 8], [100, 200, 300]]
    resp = openai_client.completions.create(model=MODEL, prompt=tok_ids, max_tokens=3, temperature=0, n=2,
                                            extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == 7 and resp.usage.completion_tokens == 12
    # Greedy samples of one prompt agree; a single token-id prompt equals its entry in the batch.
    assert resp.choices[0].text == resp.choices[1].text
    single = openai_client.completions.create(model=MODEL, prompt=tok_ids[1], max_tokens=3, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert single.choices[0].text == resp.choices[2].text
    texts = openai_client.completions.create(model=MODEL, prompt=["hello world", "fast kernel"], max_tokens=2,
                                             temperature=0)
    assert [c.index for c in texts.choices] == [0, 1]


def test_completion_echo(openai_client):
    resp = openai_client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    plain = openai_client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    assert resp.choices[0].text == "Hello there" + plain.choices[0].text


def test_completion_echo_with_logprobs_scores_the_prompt(openai_client):
    """The loglikelihood pattern (lm-eval style): echo + logprobs returns the prompt tokens' logprobs."""
    prompt = [15, 220, 37, 400, 9]
    resp = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                            logprobs=2, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
    streamed = [c.choices[0].logprobs for c in openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert streamed[0].token_logprobs[:len(prompt)] == lp.token_logprobs[:len(prompt)]


def test_completion_logprobs(openai_client):
    resp = openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=3,
                                            extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0
    for i in range(1, 4):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0
        assert 1 <= len(top) <= 4  # ids that decode alike (partial UTF-8 -> U+FFFD) share a key
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(value, abs=1e-5)
        assert top[chosen] == pytest.approx(value, abs=1e-5)


def test_completion_stream_matches_non_stream(openai_client):
    """Several prompts x n, with logprobs and echo: the stream reassembles into the plain response."""
    params = dict(model=MODEL, prompt=[[40, 41, 42], [300, 301]], max_tokens=5, temperature=0, n=2, logprobs=2,
                  extra_body={"ignore_eos": True})
    full = openai_client.completions.create(**params)
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    offsets: dict[int, list] = {}
    finish: dict[int, str] = {}
    for chunk in openai_client.completions.create(stream=True, **params):
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.logprobs:
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
            offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset)
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2, 3]
    for c in full.choices:
        assert texts[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens and offsets[c.index] == c.logprobs.text_offset
        assert finish[c.index] == c.finish_reason == "length"
    echo = dict(model=MODEL, prompt="Echo this", max_tokens=4, temperature=0, echo=True)
    plain = openai_client.completions.create(**echo).choices[0].text
    assert "".join(c.choices[0].text for c in openai_client.completions.create(stream=True, **echo)) == plain


def test_completion_stop_string(openai_client):
    base = openai_client.completions.create(model=MODEL, prompt="The river story", max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
    stop = base[6:9]
    assert len(stop) == 3 and stop.strip(), base
    cut = base.find(stop)
    resp = openai_client.completions.create(model=MODEL, prompt="The river story", max_tokens=24, temperature=0,
                                            stop=[stop, "never-appears-zz"], extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.text == base[:cut]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    # The stream never shows any part of the stop string either.
    stream = openai_client.completions.create(model=MODEL, prompt="The river story", max_tokens=24, temperature=0,
                                              stop=stop, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == base[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeds(openai_client):
    def sample(seed):
        return openai_client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                                temperature=1.0, seed=seed,
                                                extra_body={"ignore_eos": True}).choices[0].text

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c
    chat_a = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, seed=7)
    chat_b = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, seed=7)
    assert chat_a.choices[0].message.content == chat_b.choices[0].message.content


def test_sampling_extensions_accepted(openai_client):
    resp = openai_client.completions.create(
        model=MODEL, prompt="abc", max_tokens=6, temperature=0.8, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.3, seed=3, logit_bias={"50": 5.0},
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 6, "ignore_eos": False,
                    "stop_token_ids": [7]})
    assert resp.usage.completion_tokens == 6  # min_tokens=6 holds off EOS and the stop token
    # Forcing one token through logit_bias is visible in the output.
    forced = openai_client.completions.create(model=MODEL, prompt=[11, 12, 13], max_tokens=3, temperature=0,
                                              logit_bias={"321": 100}, logprobs=0,
                                              extra_body={"ignore_eos": True})
    assert len(set(forced.choices[0].logprobs.tokens)) == 1


def test_chat_basic(openai_client):
    resp = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    msg = resp.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert resp.usage.completion_tokens <= 8
    # max_tokens (deprecated name) behaves the same.
    old = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert old.choices[0].message.content == msg.content


def test_chat_uses_the_template(openai_client, http):
    tok = http.post("/tokenize", json={"messages": CHAT}).json()
    resp = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert resp.usage.prompt_tokens == tok["count"]
    text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    # Text content parts are joined; the result is the same prompt.
    parts = [CHAT[0], {"role": "user", "content": [{"type": "text", "text": CHAT[1]["content"]}]}]
    assert http.post("/tokenize", json={"messages": parts}).json()["tokens"] == tok["tokens"]


def test_chat_default_max_tokens_fills_the_context(openai_client, http):
    n_prompt = http.post("/tokenize", json={"messages": CHAT}).json()["count"]
    resp = openai_client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == SERVER_SHAPE["max_model_len"] - n_prompt
    assert resp.choices[0].finish_reason == "length"


def test_chat_n_and_logprobs(openai_client):
    resp = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=1.0, n=2,
                                                 seed=5, logprobs=True, top_logprobs=2,
                                                 extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 10
    for choice in resp.choices:
        content = choice.logprobs.content
        assert len(content) == 5
        assert "".join(t.token for t in content) == choice.message.content
        for t in content:
            assert len(t.top_logprobs) == 2
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
            assert t.logprob <= t.top_logprobs[0].logprob + 1e-5
            if all(b < 128 for b in t.bytes):
                # after bytes that never formed a character, a token carries their U+FFFD, as the text does
                assert t.token.lstrip("\ufffd") == bytes(t.bytes).decode()


def test_completion_stream_with_and_without_usage(openai_client, server):
    params = dict(model=MODEL, prompt="Stream me", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    full = openai_client.completions.create(**params).choices[0].text
    chunks = list(openai_client.completions.create(stream=True, **params))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    with_usage = list(openai_client.completions.create(stream=True, stream_options={"include_usage": True}, **params))
    assert [c for c in with_usage if c.usage is not None] == [with_usage[-1]]
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in with_usage[:-1]) == full

    # The raw SSE: chunks, exactly one usage chunk with choices [], then [DONE] last.
    body = {"model": MODEL, "prompt": "Stream me", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    resp = httpx.post(f"{server.url}/completions", json=body, timeout=60)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage_events = [e for e in events[:-1] if e.get("usage")]
    assert usage_events == [events[-2]]
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert all(e["choices"] and e["usage"] is None for e in events[:-2])
    resp = httpx.post(f"{server.url}/completions", json=dict(body, stream_options=None), timeout=60)
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])


def test_chat_stream(openai_client, server):
    params = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    full = openai_client.chat.completions.create(**params).choices[0].message.content
    chunks = list(openai_client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                        **params))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    # Raw: one usage chunk, [DONE] last.
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(httpx.post(f"{server.url}/chat/completions", json=body, timeout=60).text)
    assert events[-1] == "[DONE]"
    assert [e for e in events[:-1] if e["usage"]] == [events[-2]] and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 8
    by_index = {0: [], 1: []}
    for e in events[:-2]:
        (choice,) = e["choices"]
        by_index[choice["index"]].append(choice)
    for choices in by_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert choices[-1]["finish_reason"] == "length"
    # Greedy: both samples say the same.
    texts = ["".join(c["delta"].get("content", "") for c in cs) for cs in by_index.values()]
    assert texts[0] == texts[1] and texts[0]


def test_concurrent_streams_complete(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=120) as client:
            async def one(i):
                stream = await client.completions.create(model=MODEL, prompt=[10 + i, 20 + i, 30 + i], max_tokens=12,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                         stream_options={"include_usage": True})
                text, usage, finish = "", None, None
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].text
                        finish = chunk.choices[0].finish_reason or finish
                    if chunk.usage:
                        usage = chunk.usage
                return text, usage, finish

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=180)

    results = asyncio.run(run())
    assert len(results) == 32
    for _text, usage, finish in results:
        assert usage.completion_tokens == 12 and finish == "length"


def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] == SERVER_SHAPE["max_model_len"]
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.json() == {"prompt": "hello world"}


def test_health_metrics_version(http):
    assert http.get("/health").status_code == 200
    m = http.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    assert "jaxserve:num_requests_running" in m.text and "jaxserve:kv_cache_usage_perc" in m.text
    import jaxserve

    assert http.get("/version").json() == {"version": jaxserve.__version__}
