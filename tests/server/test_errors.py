"""Every failure answers with its status and an OpenAI error body; the server survives them all.

Against the real server: 400 (bad parameters, unsupported fields, too-long prompts, bad JSON),
404, 405, 413, 503 (a full waiting queue). In-process, against the same app factory with a scripted
engine: 401 (API key), 503 for a dead engine, an error event inside a broken stream, and the 400 of
an ``InvalidRequestError`` with its own ``param`` and ``code``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import httpx
import pytest

from jaxserve import (
    CompletionOutput,
    EngineConfig,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestOutput,
    RequestOutputKind,
)
from jaxserve.exceptions import CONTEXT_LENGTH_EXCEEDED
from jaxserve_server.app import build_app
from jaxserve_server.errors import bad_request, engine_error, error_body
from tests.server.server_testing import IGNORED_FIELDS_HEADER, MAX_BODY_BYTES, assert_error, wait_idle

CHAT = [{"role": "user", "content": "hi"}]

BAD_COMPLETIONS = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 100000}, "n"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [5000]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "top_k": 10**30}, "top_k"),
    ({"prompt": "x", "temperature": 1e300}, "temperature"),
    ({"prompt": [5000]}, "prompt"),
    ({"prompt": [-1, 3]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": True}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": [[1, 2], "mixed"]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "often"}}, "stream_options"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "guided_json": {"type": "objekt"}}, "structured_outputs.json"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt": "x", "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "min_tokens": 2, "stop_token_ids": list(range(3, 40))}, "stop_token_ids"),
]

BAD_CHATS = [
    # tools imply tool_choice auto, which this server (no --enable-auto-tool-choice) refuses
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": CHAT, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "logprobs"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": CHAT, "max_tokens": 10**6}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].image_url"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": CHAT, "n": -1}, "n"),
    ({"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"messages": CHAT, "guided_choice": []}, "guided_choice"),
    ({"messages": CHAT, "return_tokens_as_token_ids": "yes please"}, "return_tokens_as_token_ids"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[p + str(i) for i, (_, p) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_requests_are_400(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param=param)


@pytest.mark.parametrize("body,param", BAD_CHATS, ids=[p + str(i) for i, (_, p) in enumerate(BAD_CHATS)])
def test_bad_chat_requests_are_400(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)


def test_unsupported_fields_say_so(http):
    err = assert_error(http.post("/v1/chat/completions", json={"messages": CHAT, "functions": [{"name": "f"}]}), 400)
    assert "not supported" in err["message"]
    err = assert_error(http.post("/v1/completions", json={"prompt": "x", "suffix": "y"}), 400)
    assert "not supported" in err["message"]


def test_prompt_too_long_says_the_numbers(http):
    err = assert_error(http.post("/v1/completions", json={"prompt": list(range(10, 310))}), 400, param="prompt")
    assert "300" in err["message"] and "256" in err["message"]
    err = assert_error(http.post("/v1/completions", json={"prompt": list(range(10, 20)), "max_tokens": 250}), 400,
                       param="max_tokens")
    assert "250" in err["message"] and "256" in err["message"]
    long_chat = [{"role": "user", "content": "river " * 400}]
    err = assert_error(http.post("/v1/chat/completions", json={"messages": long_chat}), 400, param="prompt")
    assert "256" in err["message"]


def test_invalid_json_and_wrong_content(http):
    r = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert_error(r, 400, contains="JSON")
    assert_error(http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    assert_error(http.post("/v1/completions", content=b"prompt=x",
                           headers={"content-type": "application/x-www-form-urlencoded"}), 400)
    assert_error(http.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                           headers={"content-type": "application/json"}), 400, param="temperature")


def test_unknown_model_is_404(http):
    err = assert_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, param="model")
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"]
    assert_error(http.post("/v1/chat/completions", json={"model": "nope", "messages": CHAT}), 404, param="model")
    assert_error(http.get("/v1/models/nope"), 404, param="model")
    assert_error(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404, param="model")


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/engines"), 404, contains="/v1/engines")
    assert_error(http.post("/v2/completions", json={}), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_oversized_bodies_are_413(http):
    big = {"prompt": "x" * (MAX_BODY_BYTES + 10)}
    err = assert_error(http.post("/v1/completions", json=big), 413)
    assert str(MAX_BODY_BYTES) in err["message"]

    def chunks():  # no Content-Length: only the bytes received give it away
        for _ in range(20):
            yield b" " * 8192

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413)
    assert http.get("/health").status_code == 200


def test_tokenize_errors(http):
    assert_error(http.post("/detokenize", json={"tokens": [1, 99999]}), 400, param="tokens")
    assert_error(http.post("/detokenize", json={"tokens": "abc"}), 400, param="tokens")
    assert_error(http.post("/tokenize", json={}), 400)


def test_burst_of_malformed_requests_leaves_server_healthy(http, server):
    bodies = [b"", b"{", b"null", b"[]", b"\"str\"", b"{\"prompt\": null}", b"{\"prompt\": 1e999}",
              b"{\"prompt\": [1e400]}", b"{\"prompt\": \"x\", \"max_tokens\": 1e30}",
              b"{\"prompt\": \"x\", \"max_tokens\": 99999999999999999999999999}",
              b"{\"prompt\": \"x\", \"n\": -5}", b"{\"prompt\": \"x\", \"temperature\": Infinity}",
              b"{\"prompt\": \"x\", \"logit_bias\": {\"1\": NaN}}", b"\xff\xfe\x00garbage",
              b"{\"prompt\": [[[1]]]}", b"{\"messages\": [{\"role\": \"user\"}]}",
              b"{\"prompt\": \"x\", \"stop\": {\"a\": 1}}", b"{\"prompt\": \"x\", \"seed\": -99999999999999999999999}"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for body in bodies:
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            if r.status_code == 200 and path == "/tokenize" and IGNORED_FIELDS_HEADER in r.headers:
                continue  # /tokenize takes {"prompt": "x"}: the rest of such a body is unknown to it, so ignored
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    running, usage = wait_idle(server.base)
    assert running == 0 and usage == 0


def test_full_waiting_queue_is_503(server):
    """32 run, 64 may wait (--max-waiting 64); the rest of 160 simultaneous requests get 503."""
    async def run():
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            body = {"prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True, "temperature": 0}
            tasks = [asyncio.create_task(client.post("/completions", json=body)) for _ in range(160)]
            rejected = []
            try:
                for fut in asyncio.as_completed(tasks, timeout=60):
                    r = await fut
                    if r.status_code == 503:
                        rejected.append(r)
                        if len(rejected) >= 5:
                            break
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return rejected

    rejected = asyncio.run(run())
    assert len(rejected) >= 5
    for r in rejected:
        err = assert_error(r, 503)
        assert err["code"] == "overloaded" and "waiting queue" in err["message"]
    running, usage = wait_idle(server.base, timeout_s=30)
    assert running == 0 and usage == 0
    assert httpx.get(f"{server.base}/health").status_code == 200


# ---- in-process: the same app over a scripted engine ---------------------------------------------


class ScriptedEngine:
    """The slice of AsyncLLM the server uses, with scripted failures."""

    served_model_name = "scripted"
    input_pool = concurrent.futures.ThreadPoolExecutor(2)  # the engine client's tokenizing pool
    max_model_len = 64
    config = EngineConfig()

    def __init__(self, tokenizer, mode: str = "ok"):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(vocab_size=len(tokenizer))
        self.mode = mode
        self.dead = False

    @property
    def is_dead(self) -> bool:
        return self.dead

    @property
    def dead_reason(self) -> str | None:
        return "scripted failure" if self.dead else None

    def render_metrics(self) -> bytes:
        return b"# scripted\n"

    async def generate(self, prompt, params, request_id, *, priority=0, cache_salt=None,
                       output_kind=RequestOutputKind.DELTA, entry_times=None):
        if self.mode == "overloaded":
            raise EngineOverloadedError("the waiting queue is full (1 requests); retry later")
        if self.mode == "dead":
            raise EngineDeadError("the engine loop failed: RuntimeError('boom')")
        ids = [40, 41, 42]
        for i, tid in enumerate(ids):
            last = i == len(ids) - 1
            if self.mode == "dies_mid_stream" and i == 1:
                raise EngineDeadError("the engine loop failed: RuntimeError('boom')")
            if output_kind == RequestOutputKind.FINAL_ONLY and not last:
                continue
            toks = ids if output_kind == RequestOutputKind.FINAL_ONLY else [tid]
            yield RequestOutput(request_id, None, [1, 2], [CompletionOutput(
                0, self.tokenizer.decode(toks), toks, finish_reason="length" if last else None)], finished=last)
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    from jaxserve.models.demo import demo_model_path

    return AutoTokenizer.from_pretrained(str(demo_model_path()))


def call(app, method: str, path: str, **kw) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://inproc", timeout=30) as client:
            return await client.request(method, path, **kw)

    return asyncio.run(run())


def test_api_key(demo_tokenizer):
    app = build_app(ScriptedEngine(demo_tokenizer), api_key="sekrit")
    body = {"prompt": "x", "max_tokens": 3}
    err = assert_error(call(app, "POST", "/v1/completions", json=body), 401)
    assert err["code"] == "invalid_api_key"
    assert_error(call(app, "POST", "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(call(app, "POST", "/v1/completions", json=body, headers={"Authorization": "sekrit"}), 401)
    assert_error(call(app, "GET", "/v1/models"), 401)
    assert_error(call(app, "POST", "/tokenize", json={"prompt": "x"}), 401)
    assert_error(call(app, "GET", "/no/such/route"), 401)
    ok = call(app, "POST", "/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert call(app, "GET", "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    for open_path in ("/health", "/metrics", "/version"):
        assert call(app, "GET", open_path).status_code == 200, open_path


def test_api_key_with_openai_client(demo_tokenizer):
    import openai

    # The openai client runs on its own HTTP library (httpx2 in this release); give it an in-process
    # transport of that library.
    http_lib = pytest.importorskip("httpx2") if "httpx2" in openai.AsyncOpenAI.__init__.__annotations__.get(
        "http_client", "") else httpx
    app = build_app(ScriptedEngine(demo_tokenizer), api_key="sekrit")

    async def run(key):
        http_client = http_lib.AsyncClient(transport=http_lib.ASGITransport(app=app), base_url="http://inproc")
        async with openai.AsyncOpenAI(base_url="http://inproc/v1", api_key=key, http_client=http_client,
                                      max_retries=0) as client:
            return await client.completions.create(model="scripted", prompt="x", max_tokens=3)

    assert asyncio.run(run("sekrit")).usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(run("wrong"))


def test_overloaded_engine_is_503(demo_tokenizer):
    app = build_app(ScriptedEngine(demo_tokenizer, mode="overloaded"))
    err = assert_error(call(app, "POST", "/v1/completions", json={"prompt": "x"}), 503)
    assert err["code"] == "overloaded"
    err = assert_error(call(app, "POST", "/v1/chat/completions", json={"messages": CHAT, "stream": True}), 503)
    assert err["code"] == "overloaded"


def test_dead_engine_is_503(demo_tokenizer):
    engine = ScriptedEngine(demo_tokenizer, mode="dead")
    app = build_app(engine)
    assert_error(call(app, "POST", "/v1/completions", json={"prompt": "x"}), 503)
    engine.dead = True
    assert_error(call(app, "GET", "/health"), 503)
    assert_error(call(app, "POST", "/v1/chat/completions", json={"messages": CHAT}), 503)
    assert call(app, "GET", "/metrics").status_code == 200


def test_engine_dying_mid_stream_sends_an_error_event(demo_tokenizer):
    app = build_app(ScriptedEngine(demo_tokenizer, mode="dies_mid_stream"))
    r = call(app, "POST", "/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    assert blocks[-1] == "data: [DONE]"
    assert '"error"' in blocks[-2] and "engine loop failed" in blocks[-2]
    assert '"choices"' in blocks[0]


def test_chat_template_override(demo_tokenizer):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    app = build_app(ScriptedEngine(demo_tokenizer), chat_template=template)
    r = call(app, "POST", "/tokenize", json={"messages": [{"role": "user", "content": "hello"}]})
    assert demo_tokenizer.decode(r.json()["tokens"]) == "[user]hello"
    broken = build_app(ScriptedEngine(demo_tokenizer), chat_template="{% for %}")
    err = assert_error(call(broken, "POST", "/v1/chat/completions", json={"messages": CHAT}), 400)
    assert "chat template" in err["message"]


def test_model_without_chat_template(demo_tokenizer):
    import copy

    tok = copy.deepcopy(demo_tokenizer)
    tok.chat_template = None
    app = build_app(ScriptedEngine(tok))
    err = assert_error(call(app, "POST", "/v1/chat/completions", json={"messages": CHAT}), 400)
    assert "--chat-template" in err["message"]


def test_served_model_name(demo_tokenizer):
    app = build_app(ScriptedEngine(demo_tokenizer), served_model_name="my-model")
    assert call(app, "GET", "/v1/models").json()["data"][0]["id"] == "my-model"
    assert call(app, "POST", "/v1/completions", json={"model": "my-model", "prompt": "x"}).status_code == 200
    assert_error(call(app, "POST", "/v1/completions", json={"model": "scripted", "prompt": "x"}), 404)


# ---- InvalidRequestError: the engine's typed refusal ---------------------------------------------


def test_invalid_request_error_maps_its_param_and_code():
    err = bad_request(InvalidRequestError("max_tokens", "too many", code=CONTEXT_LENGTH_EXCEEDED))
    assert (err.status, err.param, err.code, err.message) == (400, "max_tokens", CONTEXT_LENGTH_EXCEEDED,
                                                              "max_tokens: too many")
    # The fields come from the exception, not its text: this text would parse to another param and code.
    tricky = InvalidRequestError("stop", "top_p exceeds max_model_len")
    for mapped in (bad_request(tricky), engine_error(tricky)):
        assert (mapped.status, mapped.param, mapped.code) == (400, "stop", None)
    body = error_body(err.status, err.message, param=err.param, code=err.code)
    assert body["error"]["type"] == "invalid_request_error"


def test_plain_value_errors_are_400s_without_a_guessed_field():
    err = bad_request(ValueError("top_p: must be in (0, 1], got 0"))
    assert (err.status, err.param, err.code, err.message) == (400, None, None, "top_p: must be in (0, 1], got 0")


class RefusingEngine(ScriptedEngine):
    """Refuses every request the way the engine's validation does."""

    async def generate(self, prompt, params, request_id, **kw):
        raise InvalidRequestError("prompt", "the prompt is refused", code="refused_for_test")
        yield  # an async generator, like AsyncLLM.generate: the error comes on first iteration


@pytest.mark.parametrize("stream", [False, True])
def test_engine_invalid_request_reaches_the_client(demo_tokenizer, stream):
    app = build_app(RefusingEngine(demo_tokenizer))
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        err = assert_error(call(app, "POST", path, json=dict(body, stream=stream)), 400, param="prompt")
        assert err["code"] == "refused_for_test" and err["message"] == "prompt: the prompt is refused"


def test_context_length_errors_carry_openai_code(http):
    too_long = [("/v1/completions", {"prompt": list(range(10, 310))}),
                ("/v1/completions", {"prompt": list(range(10, 20)), "max_tokens": 250}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "river " * 400}]}),
                ("/v1/completions", {"prompt": list(range(10, 310)), "stream": True})]
    for path, body in too_long:
        err = assert_error(http.post(path, json=body), 400)
        assert err["code"] == CONTEXT_LENGTH_EXCEEDED, (path, err)
