"""Structured outputs after reasoning, offline: with ``reasoning_parser`` set, the grammar applies
only after ``</think>``. The model is a tiny random Qwen3 whose tokenizer has ``<think>`` and
``</think>`` as tokens (as Qwen3's has); a logit bias on ``</think>`` makes the random model end
its reasoning after a few free tokens, and the bias cannot reach the answer, whose mask comes
first and never allows the tag."""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from tests.shapes import SERVER_SHAPE
from tests.structured.schemas import ANSWER_SCHEMA, THINK_END_BIAS


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    from tests.tiny_models import build_tiny_checkpoint

    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("thinking"), added_tokens=("<think>", "</think>")))


@pytest.fixture(scope="module")
def llm(thinking_model):
    return LLM(thinking_model, show_progress=False, reasoning_parser="deepseek_r1", **SERVER_SHAPE)


def params(end_id: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120, logit_bias={end_id: THINK_END_BIAS},
                          ignore_eos=True, structured_outputs=StructuredOutputsParams(json=ANSWER_SCHEMA), **kw)


def split_at_end(token_ids: list[int], end_id: int) -> tuple[list[int], list[int]]:
    at = token_ids.index(end_id)
    return token_ids[:at], token_ids[at + 1:]


def test_the_grammar_applies_after_the_reasoning_ends_in_the_output(llm):
    tok = llm.get_tokenizer()
    end_id = tok.convert_tokens_to_ids("</think>")
    outs = llm.generate(["Where to go?"] * 6, [params(end_id, s) for s in range(6)], use_tqdm=False)
    reasonings = []
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] == tok.eos_token_id
        reasoning, answer = split_at_end(list(c.token_ids), end_id)
        reasonings.append(tok.decode(reasoning))
        text = c.text
        assert text.startswith(tok.decode(reasoning)) and text.count("</think>") == 1
        jsonschema.validate(json.loads(text.split("</think>", 1)[1]), ANSWER_SCHEMA)
        assert answer[0] == tok.encode("{", add_special_tokens=False)[0]  # the first token after it: constrained
    # The reasoning was free: random text, not JSON (a masked row would have started with "{").
    free = [r for r in reasonings if r]
    assert len(free) >= 3 and not any(r.lstrip().startswith("{") for r in free)
    assert llm.stats()["compile_unexpected_compiles"] == 0


def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_first_token(llm):
    tok = llm.get_tokenizer()
    end_id = tok.convert_tokens_to_ids("</think>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Where to go?"}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=False)
    assert prompt.rstrip().endswith("</think>")
    outs = llm.generate([prompt] * 3, [params(end_id, s) for s in range(3)], use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert end_id not in c.token_ids
        jsonschema.validate(json.loads(c.text), ANSWER_SCHEMA)


def test_async_scheduling_matches_sync_while_reasoning(llm, thinking_model):
    tok = llm.get_tokenizer()
    end_id = tok.convert_tokens_to_ids("</think>")
    batch = [params(end_id, s) for s in range(4)] + [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    prompts = ["Where to go?", "hello", "The quick brown fox", "a b c", "plain"]
    overlapped = llm.generate(prompts, batch, use_tqdm=False)
    sync = LLM(thinking_model, show_progress=False, reasoning_parser="deepseek_r1", async_scheduling=False,
               **SERVER_SHAPE)
    stepped = sync.generate(prompts, batch, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in stepped] == [o.outputs[0].token_ids for o in overlapped]
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1
    assert not llm.llm_engine.core.structured_outputs.num_active
