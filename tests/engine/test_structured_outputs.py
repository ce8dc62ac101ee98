"""Structured outputs offline (``LLM.generate``) on the demo model, whose random weights would
never produce valid JSON on their own: every constrained output must satisfy its constraint, with
async scheduling (the default) and without, under preemption, prefix hits, chunked prefill,
``n > 1`` and logprobs, with no block leaked and nothing compiled after warm-up."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from tests.shapes import ENGINE_TESTS_SHAPE
from tests.structured.schemas import CHOICES, DATE_REGEX, PERSON_SCHEMA, SUM_GRAMMAR, SUM_REGEX

PROMPTS = ["Give me a person as JSON.", "The quick brown fox", "hello", "Ünïcödé 日本語 please answer:"]


@pytest.fixture(scope="module")
def llm(demo_model):
    return LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def json_params(max_tokens: int = 200, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=PERSON_SCHEMA), **kw)


def assert_pool_empty(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1
    assert not llm.llm_engine.core.structured_outputs.num_active  # every matcher released


def test_json_schema_outputs_validate(llm, tokenizer):
    params = [json_params(temperature=0.0)] + [json_params(temperature=1.0, seed=s) for s in range(7)]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params, use_tqdm=False)
    texts = set()
    for out in outputs:
        c = out.outputs[0]
        jsonschema.validate(json.loads(c.text), PERSON_SCHEMA)
        assert c.finish_reason == "stop" and c.token_ids[-1] == tokenizer.eos_token_id
        texts.add(c.text)
    assert len(texts) > 4  # sampled, not one forced string
    unconstrained = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    with pytest.raises(ValueError):
        json.loads(unconstrained[0].outputs[0].text)  # the model alone writes no JSON
    assert_pool_empty(llm)


def test_regex_choice_and_grammar(llm):
    cases = [
        (StructuredOutputsParams(regex=DATE_REGEX), lambda t: re.fullmatch(DATE_REGEX, t)),
        (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
        (StructuredOutputsParams(grammar=SUM_GRAMMAR), lambda t: re.fullmatch(SUM_REGEX, t)),
    ]
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=120, structured_outputs=so)
                  for so, _ in cases]
        outputs = llm.generate(PROMPTS[: len(params)], params, use_tqdm=False)
        for (so, ok), out in zip(cases, outputs):
            text = out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop" and ok(text), (so.kind, text)


def test_json_object(llm):
    """Any JSON object: its keys and values are unbounded, so a random model may not close it in
    time; those that end are objects, the others open like one."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json_object=True)) for s in range(8)]
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS * 2, params, use_tqdm=False)]
    done = [c for c in outputs if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(c.text), dict) for c in done)
    assert all(c.text.startswith("{") for c in outputs)


def test_unconstrained_rows_are_unaffected(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[:2], [plain, plain, json_params(temperature=0.0),
                                                     json_params(temperature=0.5, seed=3)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]


def test_async_scheduling_matches_sync(llm, demo_model):
    params = [json_params(temperature=0.0), json_params(temperature=1.0, seed=5),
              SamplingParams(temperature=1.0, seed=6, max_tokens=60, structured_outputs=StructuredOutputsParams(
                  regex=DATE_REGEX)),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    assert llm.llm_engine.config.async_scheduling
    overlapped = llm.generate(PROMPTS, params, use_tqdm=False)
    sync = LLM(demo_model, show_progress=False, async_scheduling=False, **ENGINE_TESTS_SHAPE)
    stepped = sync.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in stepped] == [o.outputs[0].token_ids for o in overlapped]
    assert sync.stats()["compile_unexpected_compiles"] == 0


def test_n_samples_each_follow_the_schema_with_logprobs(llm):
    out = llm.generate(PROMPTS[:1], json_params(temperature=1.0, seed=11, n=3, logprobs=2), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len({c.text for c in out.outputs}) > 1  # each child its own matcher
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), PERSON_SCHEMA)
        assert len(c.logprobs) == len(c.token_ids)
        for token, position in zip(c.token_ids, c.logprobs):
            # raw logprobs (vLLM's default): of the model's own distribution, before the mask
            assert token in position and position[token].logprob <= max(p.logprob for p in position.values())


def test_preemption_prefix_hits_and_chunked_prefill(llm, demo_model):
    """A pool too small for the batch preempts and recomputes constrained requests (the matcher
    keeps its state), prompts longer than a step's budget are chunked, and a shared prefix is hit;
    greedy outputs equal those of the roomy engine."""
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 1000, 40).tolist()
    prompts = [{"prompt_token_ids": shared + rng.integers(3, 1000, int(k)).tolist()} for k in rng.integers(5, 60, 6)]
    params = [json_params(150, temperature=0.0)] * 4 + [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=DATE_REGEX)),
        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(demo_model, show_progress=False, **{**ENGINE_TESTS_SHAPE, "num_gpu_blocks_override": 24})
    got = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    for out in got[:4]:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON_SCHEMA)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["compile_unexpected_compiles"] == 0
    assert_pool_empty(tight)


def test_invalid_constraints_are_refused_before_the_core(llm):
    bad = [StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integr"}}}),
           StructuredOutputsParams(regex="(unclosed"), StructuredOutputsParams(grammar="start: nowhere")]
    for so in bad:
        with pytest.raises(InvalidRequestError) as err:
            llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=so), use_tqdm=False)
        assert err.value.param == f"structured_outputs.{so.kind}"
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    assert_pool_empty(llm)


def test_no_compile_after_warm_up(llm):
    assert llm.stats()["compile_unexpected_compiles"] == 0
