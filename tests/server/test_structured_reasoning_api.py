"""Structured outputs after reasoning through the real server, with the official ``openai`` client:
``jaxserve serve --reasoning-parser deepseek_r1`` on a tiny random Qwen3 whose tokenizer has
``<think>``/``</think>`` tokens. A logit bias on ``</think>`` makes the random model end its
reasoning after a few free tokens; the answer after it must validate, streamed and not, and the
free text before it arrives as ``reasoning_content``."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.structured.schemas import ANSWER_SCHEMA, THINK_END_BIAS

MESSAGES = [{"role": "user", "content": "Where to go?"}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    import openai
    from transformers import AutoTokenizer

    from tests.server.server_testing import start_server, stop_server
    from tests.tiny_models import build_tiny_checkpoint

    folder = build_tiny_checkpoint(tmp_path_factory.mktemp("thinking"), added_tokens=("<think>", "</think>"))
    end_id = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("</think>")
    handle = start_server([str(folder), "--served-model-name", "thinker", "--reasoning-parser", "deepseek_r1"],
                          tmp_path_factory.mktemp("thinking-log") / "server.log")
    try:
        with openai.OpenAI(base_url=handle.url, api_key="x", max_retries=0, timeout=120) as client:
            yield client, end_id
    finally:
        stop_server(handle)


def ask(end_id: int, seed: int) -> dict:
    return dict(model="thinker", messages=MESSAGES, response_format=RESPONSE_FORMAT, max_tokens=120,
                temperature=1.0, seed=seed, logit_bias={str(end_id): THINK_END_BIAS}, extra_body={"ignore_eos": True})


def test_reasoning_then_an_answer_that_validates(thinking_server):
    client, end_id = thinking_server
    reasonings = []
    for seed in range(4):
        kw = ask(end_id, seed)
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "stop"
        extra = choice.message.model_extra
        assert extra["reasoning_content"] == extra["reasoning"]
        jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)
        reasonings.append(extra["reasoning_content"] or "")
        content, reasoning = "", ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        assert (content, reasoning) == (choice.message.content, reasonings[-1])  # seeded: the same answer
    # Free text came first: the random model's, which no JSON mask would have let through.
    assert sum(bool(r) for r in reasonings) >= 2
    assert not any(r.lstrip().startswith("{") for r in reasonings if r)
