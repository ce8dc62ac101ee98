"""Tool-call and reasoning parsers on scripted model output, split into stream pieces every way:
the streamed pieces must add up to the non-streamed parse, whatever the split. Also the schemas
that ``tool_choice`` ``required`` and a named function constrain the output with."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import InvalidRequestError
from jaxserve_server.chat_output import ChatParsers, finish_reason, merged
from jaxserve_server.reasoning import extract_reasoning, reasoning_parser_class
from jaxserve_server.tool_calls import ToolChoice, resolve_tool_choice, tool_choice_schema
from jaxserve_server.tool_parsers import (
    HermesToolParser,
    NamedToolCallParser,
    RequiredToolCallsParser,
    ToolParseDelta,
    extract_tool_calls,
    merge,
    tool_parser_class,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters: any object

HERMES_OUTPUT = (
    'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)


def counter_ids():
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


def split(text: str, cuts) -> list[str]:
    cuts = sorted(set(c for c in cuts if 0 < c < len(text)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed(parser, pieces: list[str]) -> ToolParseDelta:
    out = ToolParseDelta()
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish()


def hermes_both_ways(text: str, pieces: list[str]):
    whole = extract_tool_calls(HermesToolParser(make_id=counter_ids()), text)
    stream = merge(streamed(HermesToolParser(make_id=counter_ids()), pieces))
    assert stream == whole, pieces
    return whole


def test_hermes_parses_calls_and_keeps_the_content():
    result = extract_tool_calls(HermesToolParser(), HERMES_OUTPUT)
    assert result.content == "Let me look that up."
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("now", {})]
    ids = [c.id for c in result.tool_calls]
    assert all(i.startswith("chatcmpl-tool-") and len(i) > len("chatcmpl-tool-") for i in ids)
    assert len(set(ids)) == 2


def test_hermes_without_calls_is_all_content():
    text = "No tools needed: 2 < 3 and <tool is not a tag.\n"
    result = extract_tool_calls(HermesToolParser(), text)
    assert result.content == text and result.tool_calls == []


@pytest.mark.parametrize("cut", range(len(HERMES_OUTPUT) + 1))
def test_hermes_every_single_split_point(cut):
    assert len(hermes_both_ways(HERMES_OUTPUT, split(HERMES_OUTPUT, [cut])).tool_calls) == 2


def test_hermes_tags_split_at_every_pair_of_points():
    # Both cuts inside or around each tag: every way a tag can straddle three pieces.
    text = 'a<tool_call>{"name": "now", "arguments": {}}</tool_call>b'
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        hermes_both_ways(text, split(text, [i, j]))


def test_hermes_one_character_at_a_time():
    hermes_both_ways(HERMES_OUTPUT, list(HERMES_OUTPUT))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(HERMES_OUTPUT)), max_size=12))
def test_hermes_random_chunkings(cuts):
    hermes_both_ways(HERMES_OUTPUT, split(HERMES_OUTPUT, cuts))


MALFORMED = ('Before <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> between '
             '<tool_call>{"arguments": {}}</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call> after')


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(MALFORMED)), max_size=10))
def test_hermes_malformed_blocks_fall_back_to_content(cuts):
    result = hermes_both_ways(MALFORMED, split(MALFORMED, cuts))
    # the broken JSON and the call without a name stay as written; the good call is parsed
    assert [c.name for c in result.tool_calls] == ["now"]
    assert result.content.startswith('Before <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n'
                                     '</tool_call>')
    assert '<tool_call>{"arguments": {}}</tool_call>' in result.content
    assert result.content.endswith("after")


def test_hermes_unclosed_block_at_the_end():
    ok = 'x <tool_call>{"name": "now", "arguments": {"a": 1}}'
    result = hermes_both_ways(ok, list(ok))
    assert result.content == "x" and json.loads(result.tool_calls[0].arguments) == {"a": 1}
    cut = 'x <tool_call>{"name": "now", "argu'
    assert hermes_both_ways(cut, list(cut)).content == cut and not hermes_both_ways(cut, [cut]).tool_calls


def test_hermes_streams_one_announcement_per_call():
    parser = HermesToolParser(make_id=counter_ids())
    deltas = [parser.feed(ch) for ch in HERMES_OUTPUT] + [parser.finish()]
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.index, c.id, c.name) for c in calls] == [(0, "call-0", "get_weather"), (1, "call-1", "now")]
    # the content is released before the first block opens, not held to the end
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(d.content for d in deltas[:first_call]) == "Let me look that up."


# The third element names its function after the arguments; the fourth has no arguments key.
REQUIRED_OUTPUT = ('[ {"name": "get_weather", "arguments": {"city": "Pa]r\\"is}", "unit": "c"}},\n'
                   '{"name" : "now", "arguments": {}} ,{"arguments": [1, {"a": "}"}], "n\\u0061me": "late"},'
                   '{"name": "bare"}]')
REQUIRED_CALLS = [("get_weather", '{"city": "Pa]r\\"is}", "unit": "c"}'), ("now", "{}"),
                  ("late", '[1, {"a": "}"}]'), ("bare", "{}")]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(REQUIRED_OUTPUT)), max_size=12))
def test_required_array_any_split(cuts):
    whole = extract_tool_calls(RequiredToolCallsParser(make_id=counter_ids()), REQUIRED_OUTPUT)
    stream = merge(streamed(RequiredToolCallsParser(make_id=counter_ids()), split(REQUIRED_OUTPUT, cuts)))
    assert stream == whole
    assert whole.content is None
    assert [(c.name, c.arguments) for c in whole.tool_calls] == REQUIRED_CALLS


def test_required_arguments_stream_before_the_element_closes():
    parser = RequiredToolCallsParser(make_id=counter_ids())
    deltas = [parser.feed(ch) for ch in REQUIRED_OUTPUT] + [parser.finish()]
    first = [c for d in deltas for c in d.tool_calls if c.index == 0]
    assert first[0].name == "get_weather" and first[0].arguments == ""  # announced at its name
    assert len(first) > 10 and "".join(c.arguments for c in first) == REQUIRED_CALLS[0][1]
    assert all(c.id is None and c.name is None for c in first[1:])


def test_named_function_streams_its_arguments_verbatim():
    args = '{"city": "Paris", "unit": "f"}'
    parser = NamedToolCallParser("get_weather", make_id=counter_ids())
    deltas = [parser.feed(piece) for piece in split(args, [3, 9, 20])] + [parser.finish()]
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0].name == "get_weather" and calls[0].id == "call-0"
    assert all(c.index == 0 and c.id is None and c.name is None for c in calls[1:])
    assert "".join(c.arguments for c in calls) == args
    assert extract_tool_calls(NamedToolCallParser("get_weather"), args).tool_calls[0].arguments == args


THINKING = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello <b>there</b>!"


@pytest.mark.parametrize("name,text,expected", [
    ("qwen3", THINKING, ("The user greets me.\nI greet back.", "Hello <b>there</b>!")),
    ("qwen3", "Hello, no thinking.", (None, "Hello, no thinking.")),
    ("qwen3", "  <think>cut off before the end", ("cut off before the end", None)),
    ("qwen3", "Not at the start: <think>x</think>", (None, "Not at the start: <think>x</think>")),
    ("qwen3", "<thin", (None, "<thin")),
    ("deepseek_r1", THINKING, ("The user greets me.\nI greet back.", "Hello <b>there</b>!")),
    ("deepseek_r1", "opened by the template</think>\nanswer", ("opened by the template", "answer")),
    ("deepseek_r1", "never closed", ("never closed", None)),
])
def test_reasoning_split(name, text, expected):
    assert extract_reasoning(reasoning_parser_class(name)(), text) == expected
    for cuts in itertools.combinations(range(len(text) + 1), 2):
        parser = reasoning_parser_class(name)()
        pieces = [parser.feed(p) for p in split(text, cuts)] + [parser.finish()]
        reasoning = "".join(p.reasoning for p in pieces) or None
        content = "".join(p.content for p in pieces) or None
        assert (reasoning, content) == expected, cuts


def test_reasoning_then_tool_calls_on_the_content():
    text = "<think>I should call the clock.</think>\n" + HERMES_OUTPUT
    parsers = ChatParsers(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    whole = parsers.new_choice_parser(ToolChoice("auto"))
    reasoning, content, calls = merged(whole.feed(text) + whole.finish())
    assert reasoning == "I should call the clock." and content == "Let me look that up."
    assert [c.name for c in calls] == ["get_weather", "now"] and whole.called
    for cut in range(len(text) + 1):
        parser = parsers.new_choice_parser(ToolChoice("auto"))
        delta = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        got = merged(delta)
        assert (got[0], got[1], [(c.name, c.arguments) for c in got[2]]) == (
            reasoning, content, [(c.name, c.arguments) for c in calls])


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("named", "now")])
def test_constrained_calls_follow_the_reasoning(choice):
    # The engine constrains required/named calls only after </think>: the split applies to them too.
    calls_json = '[{"name": "now", "arguments": {}}]' if choice.mode == "required" else "{}"
    text = "<think>Time is asked.</think>\n" + calls_json
    parsers = ChatParsers(reasoning_parser="deepseek_r1")
    for cut in range(len(text) + 1):
        parser = parsers.new_choice_parser(choice)
        reasoning, content, calls = merged(parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish())
        assert reasoning == "Time is asked." and content is None, cut
        assert [(c.name, c.arguments) for c in calls] == [("now", "{}")] and parser.called


def test_free_text_passes_through_untouched_without_parsers():
    parser = ChatParsers().new_choice_parser(ToolChoice("none"))
    assert not parser.active
    assert parser.feed(" <tool_call> ").content == " <tool_call> "


def test_finish_reason_with_calls():
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"
    assert finish_reason("stop", False) == "stop"


def test_unknown_parser_names_are_refused():
    for bad in (ChatParsers(tool_call_parser="nope"), ChatParsers(reasoning_parser="nope"),
                ChatParsers(enable_auto_tool_choice=True)):
        with pytest.raises(ValueError):
            bad.check()
    with pytest.raises(ValueError, match="hermes"):
        tool_parser_class("mistral")
    ChatParsers(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1").check()


# ---- tool_choice: modes and the schemas of required / named ---------------------------------------


class Named:
    def __init__(self, name):
        self.function = type("F", (), {"name": name})()


def test_tool_choice_resolution():
    tools = [WEATHER, CLOCK]
    assert resolve_tool_choice(None, None, auto_enabled=False) == ToolChoice("none")
    assert resolve_tool_choice(tools, "none", auto_enabled=False) == ToolChoice("none")
    assert resolve_tool_choice(tools, None, auto_enabled=True) == ToolChoice("auto")
    assert resolve_tool_choice(tools, "required", auto_enabled=False) == ToolChoice("required")
    assert resolve_tool_choice(tools, Named("now"), auto_enabled=False) == ToolChoice("named", "now")
    for args in ((tools, None), (tools, "auto"), (None, "required"), (tools, Named("missing"))):
        with pytest.raises(InvalidRequestError) as info:
            resolve_tool_choice(*args, auto_enabled=False)
        assert info.value.param == "tool_choice"


def test_required_schema_accepts_calls_and_refuses_the_rest():
    schema = tool_choice_schema([WEATHER, CLOCK], ToolChoice("required"))
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}},
            {"name": "now", "arguments": {"anything": [1, 2]}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}],  # city is required
                [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "k"}}],
                [{"name": "other", "arguments": {}}], [{"name": "now"}],
                [{"name": "now", "arguments": {}, "extra": 1}], {"name": "now", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_schema([WEATHER, CLOCK], ToolChoice("required"), parallel_tool_calls=False)
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


def test_named_schema_is_the_functions_parameters():
    schema = tool_choice_schema([WEATHER, CLOCK], ToolChoice("named", "get_weather"))
    assert schema == WEATHER["function"]["parameters"]
    jsonschema.validate({"city": "Lima"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Lima", "country": "PE"}, schema)
    assert tool_choice_schema([WEATHER, CLOCK], ToolChoice("named", "now")) == {"type": "object"}
    assert tool_choice_schema([WEATHER], ToolChoice("auto")) is None
