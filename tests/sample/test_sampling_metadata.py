"""The host-side builder: array contents, padding, seeds, and validation errors naming the field."""

import math

import numpy as np
import pytest
from tests.sample.sampler_testlib import params

from jaxserve.sample import SamplingMetadata, SamplingMetadataBuilder, build_sampling_arrays

V = 100


def build(params_list, num_rows=4, **kw):
    kw.setdefault("positions", [0] * len(params_list))
    return build_sampling_arrays(params_list, num_rows, vocab_size=V, **kw)


def test_padding_rows_are_greedy_and_neutral():
    arrays = build([], num_rows=3, max_logit_bias=5, max_allowed_tokens=7)
    assert set(arrays) == set(SamplingMetadata._fields)
    np.testing.assert_array_equal(arrays["temperature"], 0.0)
    np.testing.assert_array_equal(arrays["top_k"], 0)
    np.testing.assert_array_equal(arrays["top_p"], 1.0)
    np.testing.assert_array_equal(arrays["repetition_penalty"], 1.0)
    np.testing.assert_array_equal(arrays["presence_penalty"], 0.0)
    assert arrays["bias_token_ids"].shape == (3, 5) and (arrays["bias_token_ids"] == -1).all()
    assert arrays["allowed_token_ids"].shape == (3, 7) and (arrays["allowed_token_ids"] == -1).all()
    assert not arrays["has_allowed"].any()
    assert arrays["seeds"].dtype == np.uint32 and arrays["positions"].dtype == np.int32


def test_rows_carry_their_params():
    p = params(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.05, presence_penalty=0.5,
               frequency_penalty=-0.5, repetition_penalty=1.3, seed=42,
               logit_bias={3: 2.0, 7: -1.5}, allowed_token_ids=[1, 2, 3])
    arrays = build([None, p], positions=[0, 9])
    row = {name: value[1] for name, value in arrays.items()}
    assert row["temperature"] == np.float32(0.7) and row["top_k"] == 0  # -1 means off
    assert row["top_p"] == np.float32(0.9) and row["min_p"] == np.float32(0.05)
    assert row["presence_penalty"] == 0.5 and row["frequency_penalty"] == -0.5
    assert row["repetition_penalty"] == np.float32(1.3)
    assert row["seeds"] == 42 and row["positions"] == 9
    assert list(row["bias_token_ids"][:3]) == [3, 7, -1] and list(row["bias_values"][:3]) == [2.0, -1.5, 0.0]
    assert list(row["allowed_token_ids"][:4]) == [1, 2, 3, -1] and row["has_allowed"]
    assert arrays["temperature"][0] == 0.0 and not arrays["has_allowed"][0]  # None is a padding slot


def test_missing_attributes_take_vllm_defaults():
    class OnlySeed:
        seed = 1

    arrays = build([OnlySeed()])
    assert arrays["temperature"][0] == 1.0 and arrays["top_p"][0] == 1.0 and arrays["top_k"][0] == 0


def test_seeds_engine_fallback_and_modulo():
    rows = [params(temperature=1.0, seed=None), params(temperature=1.0, seed=2**32 + 5), params(temperature=0.0, seed=None)]
    arrays = build(rows, seeds=[123, 999, None])
    assert list(arrays["seeds"][:3]) == [123, 5, 0]  # own seed wins; greedy rows need none


def test_random_row_without_any_seed_is_rejected():
    with pytest.raises(ValueError, match=r"^seed:"):
        build([params(temperature=1.0, seed=None)])


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("seed", "abc"),
        ("logprobs", 6),
        ("logprobs", -1),
        ("logit_bias", {V: 1.0}),
        ("logit_bias", {1: math.inf}),
        ("logit_bias", {i: 1.0 for i in range(9)}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [0, V]),
        ("allowed_token_ids", list(range(17))),
    ],
)
def test_validation_errors_name_the_field(field, value):
    builder = SamplingMetadataBuilder(vocab_size=V, max_logit_bias=8, max_allowed_tokens=16, max_num_logprobs=5)
    with pytest.raises(ValueError, match=rf"^{field}:"):
        builder.validate(params(**{field: value}))
    with pytest.raises(ValueError, match=rf"^{field}:"):
        builder.build([params(**{field: value})], 2, positions=[0])


def test_oversized_allowed_list_error_names_width():
    with pytest.raises(ValueError, match=r"allowed_token_ids: 300 ids exceed .*max_allowed_tokens=256"):
        build([params(allowed_token_ids=list(range(300)))], max_allowed_tokens=256)


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^num_rows:"):
        build([params()] * 3, num_rows=2, positions=[0, 0, 0])
    with pytest.raises(ValueError, match=r"^positions:"):
        build([params()], positions=[])
    with pytest.raises(ValueError, match=r"^seeds:"):
        build([params()], seeds=[1, 2])


def test_builder_matches_function_and_fresh_buffers():
    builder = SamplingMetadataBuilder(vocab_size=V, max_logit_bias=4, max_allowed_tokens=8)
    rows = [params(temperature=0.5, seed=3, logit_bias={1: 1.0})]
    a = builder.build(rows, 4, positions=[2])
    b = build(rows, positions=[2], max_logit_bias=4, max_allowed_tokens=8)
    for name in SamplingMetadata._fields:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.shares_memory(a["temperature"], builder.build(rows, 4, positions=[2])["temperature"])
    padding = builder.padding(4)
    assert padding["bias_token_ids"].shape == (4, 4) and padding["allowed_token_ids"].shape == (4, 8)
    md = SamplingMetadata.from_arrays(a)
    assert md.seeds is a["seeds"]


def test_huge_top_k_is_clamped_not_overflowed():
    from types import SimpleNamespace

    from jaxserve.sample.metadata import build_sampling_arrays

    params = SimpleNamespace(temperature=1.0, top_k=2**40, seed=3)
    arrays = build_sampling_arrays([params], 2, positions=[0], vocab_size=50)
    assert arrays["top_k"][0] == np.iinfo(np.int32).max
