import math

import pytest

from jaxserve.core import SamplingParams, SamplingType
from jaxserve.exceptions import InvalidRequestError


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output and p.logit_bias is None
    assert p.allowed_token_ids is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(seed=1.5), "seed"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_k=2.5), "top_k"),
    (dict(logit_bias={1: math.inf}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
])
def test_validation_names_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=rf"^{field}: ") as err:
        SamplingParams(**kwargs)
    assert err.value.param == field and err.value.code is None
    assert isinstance(err.value, ValueError)  # callers catching ValueError, as with vLLM, still do


def test_temperature_message():
    with pytest.raises(ValueError, match="temperature: must be non-negative, got -1"):
        SamplingParams(temperature=-1)


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), logit_bias={"7": 1})
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4] and p.logit_bias == {7: 1.0}
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(top_k=-1).top_k == -1


def test_sampling_type_and_greedy_resets_filters():
    g = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert g.is_greedy and g.sampling_type == SamplingType.GREEDY
    assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1] and q == SamplingParams(
        stop=["a", "b"], stop_token_ids=[1, 2])

