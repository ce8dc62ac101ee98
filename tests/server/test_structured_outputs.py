"""Structured outputs over HTTP with the official ``openai`` client against the shared server (demo
model, async scheduling): ``response_format`` (``json_schema``, ``json_object``), vLLM's
``structured_outputs`` body field and the older ``guided_*`` fields, streamed and not. The demo
model's random weights never write JSON by themselves, so every valid answer is the constraint's
doing."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server.server_testing import assert_error, wait_idle
from tests.structured.schemas import CHOICES, DATE_REGEX, PERSON_SCHEMA

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}


def streamed_chat_text(client, **kw) -> tuple[str, str]:
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_chat_json_schema_streamed_and_not(openai_client):
    for seed in range(3):
        kw = dict(model="jaxserve-demo", messages=MESSAGES, response_format=RESPONSE_FORMAT, max_tokens=200,
                  temperature=1.0, seed=seed)
        resp = openai_client.chat.completions.create(**kw)
        message = resp.choices[0].message.content
        jsonschema.validate(json.loads(message), PERSON_SCHEMA)
        assert resp.choices[0].finish_reason == "stop"
        streamed, finish = streamed_chat_text(openai_client, **kw)
        assert streamed == message and finish == "stop"


def test_completion_json_schema_n_and_logprobs(openai_client):
    resp = openai_client.completions.create(model="jaxserve-demo", prompt="A person:", max_tokens=200, n=3,
                                            temperature=1.0, seed=7, logprobs=2,
                                            extra_body={"response_format": RESPONSE_FORMAT})
    assert len(resp.choices) == 3
    for choice in resp.choices:
        jsonschema.validate(json.loads(choice.text), PERSON_SCHEMA)
        # the end token the complete grammar forced is listed (as for any EOS) but adds no text
        assert "".join(choice.logprobs.tokens[:-1]) == choice.text and choice.logprobs.tokens[-1] == "<|im_end|>"
    streamed = {}
    for chunk in openai_client.completions.create(model="jaxserve-demo", prompt="A person:", max_tokens=200, n=2,
                                                  temperature=1.0, seed=8, stream=True,
                                                  extra_body={"response_format": RESPONSE_FORMAT}):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert len(streamed) == 2
    for text in streamed.values():
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_json_object_response_format(openai_client):
    done = 0
    for seed in range(6):
        resp = openai_client.chat.completions.create(model="jaxserve-demo", messages=MESSAGES, max_tokens=200,
                                                     temperature=1.0, seed=seed,
                                                     response_format={"type": "json_object"})
        content = resp.choices[0].message.content
        assert content.startswith("{")
        if resp.choices[0].finish_reason == "stop":  # a random model may not close an open object in time
            assert isinstance(json.loads(content), dict)
            done += 1
    assert done


def test_structured_outputs_field_and_guided_fields(openai_client):
    cases = [
        ({"structured_outputs": {"regex": DATE_REGEX}}, lambda t: re.fullmatch(DATE_REGEX, t)),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"structured_outputs": {"json": json.dumps(PERSON_SCHEMA), "disable_any_whitespace": True}},
         lambda t: jsonschema.validate(json.loads(t), PERSON_SCHEMA) is None and "\n" not in t),
        ({"guided_regex": DATE_REGEX}, lambda t: re.fullmatch(DATE_REGEX, t)),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"guided_json": PERSON_SCHEMA}, lambda t: jsonschema.validate(json.loads(t), PERSON_SCHEMA) is None),
        ({"guided_grammar": 'start: "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
    ]
    for body, ok in cases:
        for seed in (1, 2):
            resp = openai_client.completions.create(model="jaxserve-demo", prompt="Answer:", max_tokens=150,
                                                    temperature=1.0, seed=seed, extra_body=body)
            text = resp.choices[0].text
            assert resp.choices[0].finish_reason == "stop" and ok(text), (body, text)
            chat = openai_client.chat.completions.create(model="jaxserve-demo", messages=MESSAGES, max_tokens=150,
                                                         temperature=1.0, seed=seed, extra_body=body)
            assert ok(chat.choices[0].message.content), (body, chat.choices[0].message.content)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "structured_outputs.json", "objekt"),
    ({"structured_outputs": {"regex": "([a-z]"}}, "structured_outputs.regex", "unclosed"),
    ({"guided_grammar": "start: missing_rule"}, "structured_outputs.grammar", "missing_rule"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one constraint"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "one constraint"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "exactly one"),
])
def test_invalid_constraints_are_400_naming_the_problem(http, body, param, words):
    err = assert_error(http.post("/v1/completions", json={"prompt": "x", **body}), 400, param=param)
    assert words in err["message"]


def test_openai_client_sees_bad_request(openai_client, server):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(
            model="jaxserve-demo", messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}})
    assert "nowhere" in str(err.value)
    running, usage = wait_idle(server.base)  # nothing leaked by the refused and the finished requests
    assert running == 0 and usage == 0
