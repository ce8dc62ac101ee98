"""What real clients send, as they send it: guidellm's streaming bodies (continuous usage stats),
lm-eval's local-completions (the tokenizer through /tokenizer_info and /tokenize, echo + logprobs),
vLLM's extension fields, and fields nobody declared (ignored and named in a header, not refused).

The bodies are copied from the clients' request builders (guidellm 0.8.1's OpenAI HTTP backend,
lm-eval 0.4.13's LocalCompletionsAPI); ``scripts/client_compat.sh`` runs the clients themselves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import pytest

from jaxserve import EngineConfig, RequestOutputKind
from jaxserve.core.sched_output import EngineCoreOutput
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve_server.app import build_app
from tests.server.server_testing import IGNORED_FIELDS_HEADER, wait_idle
from tests.server.test_errors import ScriptedEngine, call

MODEL = "jaxserve-demo"
CHAT = [{"role": "user", "content": "Say something."}]


def sse_chunks(resp: httpx.Response) -> list[dict]:
    """The JSON chunks of a stream, checking it ends with [DONE]."""
    events = [b.removeprefix("data: ") for b in resp.text.split("\n\n") if b.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def assert_idle(server) -> None:
    running, usage = wait_idle(server.base)
    assert running == 0 and usage == 0


# ---- guidellm ------------------------------------------------------------------------------------


def test_guidellm_completions_stream_has_usage_in_every_chunk(http, server):
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 12, "stop": None, "ignore_eos": True, "prompt": "The weather today is"}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert IGNORED_FIELDS_HEADER not in resp.headers  # every field guidellm sends is known
    chunks = sse_chunks(resp)
    prompt_tokens = len(http.post("/tokenize", json={"prompt": body["prompt"]}).json()["tokens"])
    token_chunks, final = chunks[:-1], chunks[-1]
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": 12, "total_tokens": prompt_tokens + 12}
    counts = [c["usage"]["completion_tokens"] for c in token_chunks]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in token_chunks)
    assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 1
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert_idle(server)


def test_guidellm_chat_stream_has_usage_in_every_chunk(http, server):
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 9, "stop": None, "ignore_eos": True, "messages": CHAT}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    chunks = sse_chunks(resp)
    assert all(c["usage"] is not None for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["usage"]["completion_tokens"] == 0
    assert chunks[-2]["usage"]["completion_tokens"] == chunks[-1]["usage"]["completion_tokens"] == 9
    assert chunks[-1]["choices"] == []
    assert_idle(server)


def test_without_continuous_usage_only_the_last_chunk_has_usage(http):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(http.post("/v1/completions", json=body))
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] >= 1


# ---- lm-eval local-completions --------------------------------------------------------------------


def test_lm_eval_finds_the_tokenizer_through_the_server(http):
    """lm-eval's check_remote_tokenizer_support, then RemoteTokenizer's calls."""
    info = http.get("/tokenizer_info")
    assert info.status_code == 200
    info = info.json()
    assert info["eos_token"] == "<|im_end|>" and info["tokenizer_class"]
    assert "<|im_start|>" in info["chat_template"]
    assert "vocab_file" not in info
    tokens = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]
    assert isinstance(tokens, list) and tokens
    eos_id = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert len(eos_id) == 1
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "test"}


def test_lm_eval_loglikelihood_request(http, server):
    """Token-id prompts, echo + logprobs=1 + max_tokens=1: a logprob for every prompt token after the
    first, which lm-eval sums over the continuation."""
    context = http.post("/tokenize", json={"prompt": "The capital of France is", "add_special_tokens": False})
    continuation = http.post("/tokenize", json={"prompt": " Paris", "add_special_tokens": False})
    ids = context.json()["tokens"] + continuation.json()["tokens"]
    body = {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200 and IGNORED_FIELDS_HEADER not in resp.headers
    lp = resp.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(top is not None and len(top) >= 1 for top in lp["top_logprobs"][1:])
    assert_idle(server)


def test_lm_eval_generate_until_request(http):
    body = {"prompt": ["Question: what is 2 + 2?\nAnswer:"], "model": MODEL, "max_tokens": 16, "temperature": 0,
            "stop": ["\n\n", "Question:"], "seed": 1234}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200 and IGNORED_FIELDS_HEADER not in resp.headers
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and "Question:" not in choice["text"]


@pytest.fixture(scope="module")
def demo_tok():
    from transformers import AutoTokenizer

    from jaxserve.models.demo import demo_model_path

    return AutoTokenizer.from_pretrained(str(demo_model_path()))


def test_tokenizer_info_is_off_unless_asked(demo_tok):
    tok = demo_tok
    assert call(build_app(ScriptedEngine(tok)), "GET", "/tokenizer_info").status_code == 404
    on = call(build_app(ScriptedEngine(tok), enable_tokenizer_info_endpoint=True), "GET", "/tokenizer_info")
    assert on.status_code == 200 and on.json()["eos_token"] == tok.eos_token


# ---- vLLM extensions ------------------------------------------------------------------------------


def test_echo_with_logprobs_and_no_new_tokens_returns_the_prompt(http, server):
    ids = http.post("/tokenize", json={"prompt": "Hello there, my friend"}).json()["tokens"]
    body = {"model": MODEL, "prompt": "Hello there, my friend", "echo": True, "logprobs": 2, "max_tokens": 0}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    choice = out["choices"][0]
    assert choice["text"] == "Hello there, my friend" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    streamed = sse_chunks(http.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed) == "Hello there, my friend"
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in streamed if c["choices"][0]["logprobs"]) == len(ids)
    assert_idle(server)


def test_prompt_logprobs_on_completions(http):
    text = "One two three four"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    body = {"model": MODEL, "prompt": text, "max_tokens": 2, "prompt_logprobs": 1, "echo": True, "logprobs": 0}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    echoed = choice["logprobs"]["token_logprobs"][: len(ids)]
    for i, (token_id, entry) in enumerate(zip(ids[1:], plp[1:]), start=1):
        assert str(token_id) in entry and entry[str(token_id)]["logprob"] == pytest.approx(echoed[i])
        assert len(entry) <= 2  # the prompt token and at most one alternative
    # logprobs=0 limits the echoed alternatives, though the engine computed one more for prompt_logprobs
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1 : len(ids)])


def test_return_tokens_as_token_ids(http):
    body = {"model": MODEL, "prompt": "Numbers:", "max_tokens": 4, "logprobs": 1, "temperature": 0,
            "return_tokens_as_token_ids": True, "ignore_eos": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert len(tokens) == 4 and all(t.startswith("token_id:") for t in tokens)
    ids = [int(t.split(":")[1]) for t in tokens]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == choice["text"]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3, "logprobs": True,
                                                   "return_tokens_as_token_ids": True}).json()
    assert all(c["token"].startswith("token_id:") for c in chat["choices"][0]["logprobs"]["content"])


def test_truncate_prompt_tokens_keeps_the_last_tokens(http):
    text = "a b c d e f g h i j k l m n o p"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    body = {"model": MODEL, "prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 5, "echo": True}
    out = http.post("/v1/completions", json=body).json()
    assert out["usage"]["prompt_tokens"] == 5
    tail = http.post("/detokenize", json={"tokens": ids[-5:]}).json()["prompt"]
    assert out["choices"][0]["text"].startswith(tail)
    tokens = http.post("/v1/completions", json={**body, "prompt": ids}).json()
    assert tokens["usage"]["prompt_tokens"] == 5
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                   "truncate_prompt_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens"] == 3


def test_tokenize_reports_null_token_strs_when_not_asked(http):
    assert http.post("/tokenize", json={"prompt": "hi"}).json()["token_strs"] is None
    assert http.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()["token_strs"]


# ---- fields nobody declared -----------------------------------------------------------------------


def test_unknown_fields_are_ignored_and_named(http, server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "totally_unknown_field": 1, "vllm_xargs": {"a": 1},
            "stream": True, "stream_options": {"include_usage": True, "bogus": 1}}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers[IGNORED_FIELDS_HEADER].split(",") == ["totally_unknown_field", "vllm_xargs",
                                                              "stream_options.bogus"]
    assert sse_chunks(resp)[-1]["usage"]["completion_tokens"] == 2
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "unknown_thing": 1})
    assert chat.status_code == 200 and chat.headers[IGNORED_FIELDS_HEADER] == "unknown_thing"
    tok = http.post("/tokenize", json={"prompt": "x", "whatever": True})
    assert tok.status_code == 200 and tok.headers[IGNORED_FIELDS_HEADER] == "whatever"
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert IGNORED_FIELDS_HEADER not in plain.headers
    assert "ignored request fields" in server.log_tail(200_000)
    assert_idle(server)


def test_known_fields_with_bad_values_are_still_400(http):
    resp = http.post("/v1/completions", json={"prompt": "x", "temperature": "hot", "unknown": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"


# ---- streamed text and logprobs at split characters (in-process, the real OutputProcessor) ---------


class ReplayEngine:
    """The slice of AsyncLLM the server uses: each request replays ``token_ids`` one per step
    through a real OutputProcessor, each with a logprobs row (the token, then one alternative)."""

    served_model_name = "replay"
    input_pool = concurrent.futures.ThreadPoolExecutor(2)  # the engine client's tokenizing pool
    max_model_len = 64
    config = EngineConfig()

    def __init__(self, tokenizer, token_ids: list[int]):
        self.tokenizer = tokenizer
        self.model_config = type("MC", (), {"vocab_size": len(tokenizer)})()
        self.token_ids = token_ids
        self.is_dead = False

    def render_metrics(self) -> bytes:
        return b""

    async def generate(self, prompt, params, request_id, *, priority=0, cache_salt=None,
                       output_kind=RequestOutputKind.DELTA, entry_times=None):
        proc = OutputProcessor(self.tokenizer)
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt["prompt_token_ids"])
        proc.add_request(request_id, prompt, prompt_ids, [request_id], [params], output_kind, time.monotonic())
        alt = self.tokenizer.encode(" dog", add_special_tokens=False)[0]
        for i, t in enumerate(self.token_ids):
            finish = "length" if i == len(self.token_ids) - 1 else None
            delivered, _ = proc.process_outputs([EngineCoreOutput(request_id, [t], finish,
                                                                  new_logprobs=([t, alt], [-0.5, -1.5], 1))])
            for _, ro in delivered:
                yield ro
            await asyncio.sleep(0)


def test_streamed_chunks_logprob_tokens_agree_with_their_text(demo_tok):
    tok = demo_tok
    text = "ok 日本 😀!"
    app = build_app(ReplayEngine(tok, tok.encode(text, add_special_tokens=False)))
    body = {"prompt": "x", "max_tokens": 20, "logprobs": 1, "stream": True}
    chunks = [c["choices"][0] for c in sse_chunks(call(app, "POST", "/v1/completions", json=body))]
    assert "".join(c["text"] for c in chunks) == text
    sent = 0
    for c in chunks:
        lp = c["logprobs"]
        assert "".join(lp["tokens"]) == c["text"]  # an unfinished character is "" in both
        assert lp["text_offset"][0] == sent  # offsets count the text already sent
        sent += len(c["text"])
    assert any(c["text"] == "" for c in chunks)
    chat = sse_chunks(call(app, "POST", "/v1/chat/completions",
                           json={"messages": CHAT, "logprobs": True, "stream": True}))
    for c in chat[1:]:
        content = c["choices"][0]["logprobs"]["content"]
        assert "".join(t["token"] for t in content) == c["choices"][0]["delta"].get("content", "")
