"""min_tokens and stop tokens through the whole engine, as vLLM behaves: EOS and stop ids are masked
out of the logits until min_tokens outputs exist, and the token that stops a request adds no text."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.engine.test_engine_features import assert_pool_empty
from tests.shapes import ENGINE_TESTS_SHAPE


@pytest.fixture(scope="module")
def llm(demo_model):
    return LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)


def generate(llm: LLM, **params):
    return llm.generate(["hello"], SamplingParams(temperature=0, **params), use_tqdm=False)[0].outputs[0]


def test_min_tokens_forbids_eos_even_when_it_is_the_likeliest(llm):
    eos = llm.get_tokenizer().eos_token_id
    out = generate(llm, min_tokens=32, max_tokens=32, logit_bias={eos: 100})
    assert len(out.token_ids) == 32 and eos not in out.token_ids
    assert out.finish_reason == "length"
    early = generate(llm, min_tokens=5, max_tokens=32, logit_bias={eos: 100})
    assert early.token_ids[5:] == [eos] and eos not in early.token_ids[:5]  # free to end once 5 exist
    assert early.finish_reason == "stop"
    assert_pool_empty(llm)


def test_min_tokens_forbids_stop_token_ids_and_the_extra_eos_ids(llm):
    free = generate(llm, max_tokens=12, ignore_eos=True)
    stop_id = free.token_ids[0]
    out = generate(llm, min_tokens=6, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id],
                   logit_bias={stop_id: 100})
    assert stop_id not in out.token_ids[:6] and out.token_ids[6] == stop_id
    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("stop", stop_id, 7)
    assert_pool_empty(llm)


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_stays_in_token_ids_but_not_in_the_text(llm, include):
    tok = llm.get_tokenizer()
    free = generate(llm, max_tokens=12, ignore_eos=True)
    stop_id = next(t for t in free.token_ids if tok.decode([t]).strip() and "\ufffd" not in tok.decode([t]))
    out = generate(llm, max_tokens=12, stop_token_ids=[stop_id], include_stop_str_in_output=include)
    cut = free.token_ids.index(stop_id)
    assert out.token_ids == free.token_ids[: cut + 1] and out.stop_reason == stop_id
    shown = out.token_ids if include else out.token_ids[:-1]
    assert out.text == tok.decode(shown)
    assert out.text.endswith(tok.decode([stop_id])) == include
    assert_pool_empty(llm)


def test_eos_text_is_not_shown_with_special_tokens(llm):
    tok = llm.get_tokenizer()
    out = generate(llm, min_tokens=2, max_tokens=32, skip_special_tokens=False,
                   logit_bias={tok.eos_token_id: 100})
    assert out.token_ids[-1] == tok.eos_token_id and out.finish_reason == "stop"
    assert tok.eos_token not in out.text
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=False)
    assert_pool_empty(llm)
