"""``LLM(model=<NNX module>)``: a model object is served as it is, under the same contract as
``LlamaForCausalLM``; anything that lacks part of the contract is refused, naming the part."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.exceptions import ConfigError
from jaxserve.models import load_model
from tests.shapes import ENGINE_TESTS_SHAPE

PROMPTS = [[5, 17, 99, 230, 41], [7, 7, 300, 12, 55, 61, 80, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class ForcedToken(nnx.Module):
    """Wraps a model and adds a large bias to one token's logit: greedy decoding must pick it."""

    def __init__(self, base, token: int):
        self.base = base
        self.config = base.config
        self.token = token

    def __call__(self, input_ids, kv_cache, md, attn_fn):
        return self.base(input_ids, kv_cache, md, attn_fn)

    def compute_logits(self, hidden):
        return self.base.compute_logits(hidden).at[:, self.token].add(1e4)


class NoLogits(nnx.Module):
    def __init__(self, base):
        self.config = base.config

    def __call__(self, input_ids, kv_cache, md, attn_fn):
        raise AssertionError("never called")


def greedy_ids(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def from_path(demo_model):
    return LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)


def test_model_object_generates_like_its_checkpoint(demo_model, from_path):
    llm = LLM(load_model(demo_model), tokenizer=demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)
    assert greedy_ids(llm) == greedy_ids(from_path)
    text = llm.generate("The scheduler", GREEDY, use_tqdm=False)[0]
    expected = from_path.generate("The scheduler", GREEDY, use_tqdm=False)[0]
    assert text.outputs[0].text == expected.outputs[0].text != ""
    assert llm.llm_engine.served_model_name == "LlamaForCausalLM"
    assert llm.llm_engine.core.model_source is None


def test_a_changed_layer_changes_the_output(demo_model, from_path):
    baseline = greedy_ids(from_path)
    token = next(t for t in range(3, 1000) if all(t not in ids for ids in baseline))
    llm = LLM(ForcedToken(load_model(demo_model), token), show_progress=False, **ENGINE_TESTS_SHAPE)
    assert greedy_ids(llm) == [[token] * GREEDY.max_tokens] * len(PROMPTS)


def test_tokenizer_object_is_used(demo_model, from_path):
    tok = from_path.get_tokenizer()
    llm = LLM(load_model(demo_model), tokenizer=tok, show_progress=False, **ENGINE_TESTS_SHAPE)
    assert llm.get_tokenizer() is tok
    out = llm.generate("a prompt", GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode("a prompt")


def test_without_a_tokenizer_only_token_ids(demo_model):
    llm = LLM(load_model(demo_model), show_progress=False, **ENGINE_TESTS_SHAPE)
    assert llm.get_tokenizer() is None
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("make, needle", [
    (lambda m: object(), "not a flax.nnx.Module"),
    (lambda m: NoLogits(m), "no method compute_logits()"),
    (lambda m: nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "'config' attribute"),
])
def test_contract_violations_are_named(demo_model, make, needle):
    with pytest.raises(ConfigError, match=r"model object cannot be served") as err:
        LLM(make(load_model(demo_model)), show_progress=False, **ENGINE_TESTS_SHAPE)
    assert needle in str(err.value)


def test_wrong_config_type_is_named(demo_model):
    model = load_model(demo_model)
    model.config = {"vocab_size": 10}
    with pytest.raises(ConfigError, match="config is a dict"):
        LLM(model, show_progress=False, **ENGINE_TESTS_SHAPE)


def test_checkpoint_settings_are_refused_with_a_model_object(demo_model):
    with pytest.raises(ConfigError, match="a model object is served as it is built"):
        LLM(load_model(demo_model), dtype="bfloat16", show_progress=False, **ENGINE_TESTS_SHAPE)


def test_forced_token_wrapper_really_adds_the_bias(demo_model):
    """The wrapper's logits differ from the base's only in the forced column."""
    base = load_model(demo_model)
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(3, base.config.hidden_size)), jnp.float32)
    diff = np.asarray(ForcedToken(base, 9).compute_logits(hidden) - base.compute_logits(hidden))
    assert np.allclose(diff[:, 9], 1e4) and not np.delete(diff, 9, axis=1).any()
