"""Tools, tool_choice and reasoning over the OpenAI API, with the official ``openai`` client.

In-process, against the real app over an engine that answers with a scripted text (the demo
model is random, so this is how a known tool call or think block comes out of it): the answer
assembly, streamed and not, and the prompt the engine receives. Against the real server: tools
rendered into the prompt, refusals, and ``required``/named calls enforced by structured outputs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from jaxserve import CompletionOutput, EngineConfig, RequestOutput, RequestOutputKind
from jaxserve_server.app import build_app
from jaxserve_server.chat_output import ChatParsers
from tests.server.server_testing import assert_error

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time",
                                          "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_OUTPUT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
THINKING = "<think>\nGreeting, so greet.\n</think>\n\nHello there!"
AUTO = ChatParsers(enable_auto_tool_choice=True, tool_call_parser="hermes")


class ScriptedTextEngine:
    """The slice of AsyncLLM the server uses; every request answers ``script`` in pieces of
    ``piece`` characters and finishes with ``stop``. Prompts and parameters are recorded."""

    served_model_name = "scripted"
    input_pool = concurrent.futures.ThreadPoolExecutor(2)  # the engine client's tokenizing pool
    max_model_len = 4096
    config = EngineConfig()

    def __init__(self, tokenizer, script: str, piece: int = 5):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(vocab_size=len(tokenizer))
        self.is_dead = False
        self.script = script
        self.piece = piece
        self.requests: list[tuple[dict, object]] = []

    def render_metrics(self) -> bytes:
        return b""

    async def generate(self, prompt, params, request_id, *, priority=0, cache_salt=None,
                       output_kind=RequestOutputKind.DELTA, entry_times=None):
        self.requests.append((prompt, params))
        pieces = [self.script[i:i + self.piece] for i in range(0, len(self.script), self.piece)]
        if output_kind == RequestOutputKind.FINAL_ONLY:
            pieces = [self.script]
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            outs = [CompletionOutput(k, text, [7], finish_reason="stop" if last else None) for k in range(params.n)]
            yield RequestOutput(request_id, prompt["prompt"], prompt["prompt_token_ids"], outs, finished=last)
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


def ask(app, fn):
    """Run ``fn(client)`` with an AsyncOpenAI client talking to ``app`` in-process."""
    import openai

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://inproc/v1") as http_client:
            client = openai.AsyncOpenAI(base_url="http://inproc/v1", api_key="x", http_client=http_client,
                                        max_retries=0)
            return await fn(client)

    return asyncio.run(run())


async def collect_stream(client, **kw) -> dict:
    """A streamed answer of choice 0, joined: content, reasoning, calls by index, finish reason."""
    joined: dict = {"content": "", "reasoning": "", "calls": {}, "finish_reason": None, "chunks": 0}
    stream = await client.chat.completions.create(model="scripted", stream=True, **kw)
    async for chunk in stream:
        joined["chunks"] += 1
        choice = chunk.choices[0]
        delta = choice.delta
        joined["content"] += delta.content or ""
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        joined["reasoning"] += extra.get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            entry = joined["calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id is not None:
                assert entry["id"] is None, "a call is announced once"
                entry["id"], entry["name"] = call.id, call.function.name
            assert entry["id"] is not None, "the id comes first"
            entry["arguments"] += call.function.arguments or ""
        joined["finish_reason"] = choice.finish_reason or joined["finish_reason"]
    return joined


@pytest.mark.parametrize("piece", [1, 4, 13])
def test_auto_tool_calls_streamed_and_not(tokenizer, piece):
    engine = ScriptedTextEngine(tokenizer, HERMES_OUTPUT, piece=piece)
    app = build_app(engine, chat_parsers=AUTO)
    kw = dict(messages=ASK, tools=[WEATHER, CLOCK])

    async def both(client):
        full = await client.chat.completions.create(model="scripted", **kw)
        return full, await collect_stream(client, **kw)

    full, streamed = ask(app, both)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris", "unit": "c"}), ("function", "now", {})]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls) and calls[0].id != calls[1].id
    assert streamed["finish_reason"] == "tool_calls"
    assert streamed["content"] == choice.message.content
    assert [(e["name"], e["arguments"]) for _, e in sorted(streamed["calls"].items())] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert all(e["id"].startswith("chatcmpl-tool-") for e in streamed["calls"].values())
    # the template put the tools into the prompt the engine got
    prompt = engine.requests[0][0]["prompt"]
    assert "<tools>\n" + json.dumps(WEATHER) in prompt and json.dumps(CLOCK) in prompt


def test_each_choice_parses_its_own_calls(tokenizer):
    app = build_app(ScriptedTextEngine(tokenizer, HERMES_OUTPUT, piece=6), chat_parsers=AUTO)

    async def stream(client):
        calls: dict[tuple[int, int], list] = {}
        finish = {}
        async for chunk in await client.chat.completions.create(model="scripted", messages=ASK, tools=[CLOCK],
                                                                n=2, stream=True):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    entry = calls.setdefault((choice.index, call.index), [None, "", ""])
                    entry[0] = entry[0] or call.id
                    entry[1] += call.function.name or ""
                    entry[2] += call.function.arguments or ""
                finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        return calls, finish

    calls, finish = ask(app, stream)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert sorted(calls) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [calls[(k, 0)][1] for k in (0, 1)] == ["get_weather"] * 2
    assert len({entry[0] for entry in calls.values()}) == 4  # every call its own id


def test_tool_choice_none_offers_tools_but_parses_nothing(tokenizer):
    engine = ScriptedTextEngine(tokenizer, HERMES_OUTPUT)
    app = build_app(engine, chat_parsers=AUTO)
    full = ask(app, lambda c: c.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER],
                                                        tool_choice="none"))
    assert full.choices[0].message.content == HERMES_OUTPUT and not full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "stop"
    assert json.dumps(WEATHER) in engine.requests[0][0]["prompt"]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_split_streamed_and_not(tokenizer, parser):
    engine = ScriptedTextEngine(tokenizer, THINKING, piece=3)
    app = build_app(engine, chat_parsers=ChatParsers(reasoning_parser=parser))

    async def both(client):
        full = await client.chat.completions.create(model="scripted", messages=ASK)
        return full, await collect_stream(client, messages=ASK)

    full, streamed = ask(app, both)
    msg = full.choices[0].message
    extra = msg.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == "Greeting, so greet."
    assert msg.content == "Hello there!" and full.choices[0].finish_reason == "stop"
    assert (streamed["reasoning"], streamed["content"]) == ("Greeting, so greet.", "Hello there!")


def test_reasoning_qwen3_without_think_is_content(tokenizer):
    app = build_app(ScriptedTextEngine(tokenizer, "Just an answer."),
                    chat_parsers=ChatParsers(reasoning_parser="qwen3"))
    msg = ask(app, lambda c: c.chat.completions.create(model="scripted", messages=ASK)).choices[0].message
    assert msg.content == "Just an answer." and msg.model_extra["reasoning_content"] is None


def test_reasoning_and_tool_calls_together(tokenizer):
    engine = ScriptedTextEngine(tokenizer, "<think>Use the tool.</think>\n" + HERMES_OUTPUT, piece=2)
    parsers = ChatParsers(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    app = build_app(engine, chat_parsers=parsers)
    streamed = ask(app, lambda c: collect_stream(c, messages=ASK, tools=[WEATHER, CLOCK]))
    assert streamed["reasoning"] == "Use the tool." and streamed["content"] == "I will check."
    assert [e["name"] for e in streamed["calls"].values()] == ["get_weather", "now"]


def test_conversation_with_calls_and_results_renders(tokenizer):
    engine = ScriptedTextEngine(tokenizer, "It is sunny.")
    app = build_app(engine, chat_parsers=AUTO)
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"}]
    full = ask(app, lambda c: c.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER]))
    assert full.choices[0].message.content == "It is sunny." and full.choices[0].finish_reason == "stop"
    prompt = engine.requests[0][0]["prompt"]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
            '\n</tool_call><|im_end|>\n') in prompt
    assert prompt.endswith("<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")
    bad = [ASK[0], {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                        "function": {"name": "f", "arguments": "{oops"}}]}]
    resp = asyncio.run(_post(app, {"messages": bad}))
    assert_error(resp, 400, param="messages", contains="JSON")


def test_chat_template_kwargs_reach_the_template(tokenizer):
    engine = ScriptedTextEngine(tokenizer, "ok")
    app = build_app(engine)
    ask(app, lambda c: c.chat.completions.create(model="scripted", messages=ASK,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert engine.requests[0][0]["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


async def _post(app, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://inproc") as client:
        return await client.post("/v1/chat/completions", json=body)


def test_tool_choice_refusals(tokenizer):
    plain = build_app(ScriptedTextEngine(tokenizer, "x"))
    auto = build_app(ScriptedTextEngine(tokenizer, "x"), chat_parsers=AUTO)
    # auto (explicit, or implied by tools) needs the server flags, as in vLLM
    for body in ({"messages": ASK, "tools": [WEATHER]}, {"messages": ASK, "tools": [WEATHER], "tool_choice": "auto"}):
        assert_error(asyncio.run(_post(plain, body)), 400, param="tool_choice", contains="--enable-auto-tool-choice")
    assert asyncio.run(_post(auto, {"messages": ASK, "tools": [WEATHER]})).status_code == 200
    assert_error(asyncio.run(_post(auto, {"messages": ASK, "tool_choice": "required"})), 400, param="tool_choice")
    named_missing = {"messages": ASK, "tools": [WEATHER],
                     "tool_choice": {"type": "function", "function": {"name": "x"}}}
    assert_error(asyncio.run(_post(auto, named_missing)), 400, param="tool_choice", contains="'x'")
    assert_error(asyncio.run(_post(auto, {"messages": ASK, "tools": [{"type": "function"}]})), 400, param="tools")
    assert_error(asyncio.run(_post(auto, {"messages": ASK, "functions": [WEATHER["function"]]})), 400,
                 param="functions")


def test_required_and_named_scripted_answers(tokenizer):
    required = '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}, {"name": "now", "arguments": {}}]'
    engine = ScriptedTextEngine(tokenizer, required, piece=3)
    app = build_app(engine)
    kw = dict(messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required")
    full = ask(app, lambda c: c.chat.completions.create(model="scripted", **kw))
    assert [c.function.name for c in full.choices[0].message.tool_calls] == ["get_weather", "now"]
    assert full.choices[0].finish_reason == "tool_calls"
    schema = engine.requests[0][1].structured_outputs.json
    jsonschema.validate(json.loads(required), schema if isinstance(schema, dict) else json.loads(schema))
    streamed = ask(app, lambda c: collect_stream(c, **kw))
    assert [(e["name"], e["arguments"]) for e in streamed["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]


# ---- against the real server (demo model) --------------------------------------------------------

# Small tools for the real server: the demo tokenizer spends about a token per character of JSON.
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
    "required": ["city", "n"], "additionalProperties": False}}}
# Closed, so that a random model's arguments end: a function without parameters takes any object.
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                      "additionalProperties": False}}}


def test_tools_reach_the_prompt(http, tokenizer):
    body = {"messages": ASK, "tools": [WEATHER, CLOCK]}
    tok = http.post("/tokenize", json=body).json()
    plain = http.post("/tokenize", json={"messages": ASK}).json()
    text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in text
    assert text.endswith(http.post("/detokenize", json={"tokens": plain["tokens"]}).json()["prompt"])
    # a chat request sends the engine exactly those tokens
    engine = ScriptedTextEngine(tokenizer, "x")
    ask(build_app(engine), lambda c: c.chat.completions.create(model="scripted", tool_choice="none", **body))
    assert engine.requests[0][0]["prompt_token_ids"] == tok["tokens"]


def test_auto_without_server_flags_is_400(http):
    assert_error(http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]}), 400,
                 param="tool_choice", contains="--tool-call-parser")


@pytest.fixture(scope="module")
def long_context_client(tmp_path_factory):
    """A server whose context holds tool definitions (the shared one has 256 tokens), with the
    auto tool choice and a reasoning parser on."""
    import openai

    from tests.server.server_testing import start_server, stop_server

    flags = ["--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--reasoning-parser", "qwen3"]
    handle = start_server(flags, tmp_path_factory.mktemp("tools") / "server.log")
    try:
        with openai.OpenAI(base_url=handle.url, api_key="x", max_retries=0, timeout=120) as client:
            yield client
    finally:
        stop_server(handle)


def test_auto_on_a_real_server_streams_what_it_answers(long_context_client):
    # Greedy, so the streamed text is the non-streamed one: its parse must come out the same.
    client = long_context_client
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, tools=[PICK, NOW], max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    msg = choice.message
    assert (msg.content or msg.model_extra.get("reasoning_content") or msg.tool_calls)
    joined = {"content": "", "reasoning": "", "calls": 0}
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        joined["content"] += delta.content or ""
        joined["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
        joined["calls"] += len(delta.tool_calls or [])
    assert joined == {"content": msg.content or "", "reasoning": msg.model_extra.get("reasoning_content") or "",
                      "calls": len(msg.tool_calls or [])}


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_calls_validate(long_context_client, stream):
    client = long_context_client
    model = client.models.list().data[0].id
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        for seed in range(3):
            # one call per answer: a random model may otherwise add calls until max_tokens. The
            # server has a reasoning parser, so the calls are constrained after </think>: here the
            # template closes the think block in the prompt, as Qwen3's does without thinking.
            kw = dict(model=model, messages=ASK, tools=[PICK, NOW], tool_choice=choice, max_tokens=300,
                      temperature=1.0, seed=seed, parallel_tool_calls=False,
                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            if stream:
                calls = _streamed_calls(client.chat.completions.create(stream=True, **kw))
            else:
                answer = client.chat.completions.create(**kw).choices[0]
                assert answer.finish_reason == "tool_calls", answer
                calls = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]
            assert calls
            if isinstance(choice, dict):
                assert [name for name, _ in calls] == ["pick"]
            for name, arguments in calls:
                tool = PICK if name == "pick" else NOW
                jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def _streamed_calls(stream) -> list[tuple[str, str]]:
    calls: dict[int, list] = {}
    finish = None
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("flags", [["--tool-call-parser", "nope"], ["--reasoning-parser", "nope"],
                                   ["--enable-auto-tool-choice"]])
def test_bad_parser_flags_are_one_line_exit_2(flags):
    out = subprocess.run([sys.executable, "-m", "jaxserve_server.cli", "serve", "--port", "0", *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxserve: error: --"), out.stderr
