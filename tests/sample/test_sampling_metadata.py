"""The host-side sampling table: array contents, padding, seeds and shapes."""

import numpy as np
import pytest

from jaxserve.sample import SamplingMetadata, SamplingTable, sampling_arrays
from tests.sample.sampler_testlib import params


def build(params_list, num_rows=4, **kw):
    kw.setdefault("positions", [0] * len(params_list))
    return sampling_arrays(params_list, num_rows, **kw)


def test_padding_rows_are_greedy_and_neutral():
    arrays = build([], num_rows=3, max_logit_bias=5, max_allowed_tokens=7)
    assert set(arrays) == set(SamplingMetadata.fields())
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


def test_seeds_engine_fallback_and_modulo():
    rows = [params(temperature=1.0, seed=None), params(temperature=1.0, seed=2**32 + 5),
            params(temperature=0.0, seed=None)]
    arrays = build(rows, seeds=[123, 999, None])
    assert list(arrays["seeds"][:3]) == [123, 5, 0]  # own seed wins; greedy rows need none


def test_random_row_without_any_seed_is_rejected():
    with pytest.raises(ValueError, match="seed"):
        build([params(temperature=1.0, seed=None)])


def test_shape_errors():
    with pytest.raises(ValueError, match="do not fit"):
        build([params()] * 3, num_rows=2, positions=[0, 0, 0])
    with pytest.raises(ValueError, match="positions"):
        build([params()], positions=[])
    with pytest.raises(ValueError, match="seeds"):
        build([params()], seeds=[1, 2])


def test_table_gathers_fresh_buffers_and_pads_with_its_widths():
    table = SamplingTable(3, max_logit_bias=4, max_allowed_tokens=8)
    table.set_row(1, params(temperature=0.5, seed=3, logit_bias={1: 1.0}), None)
    rows = np.asarray([1, table.padding_slot], np.int32)
    a = table.gather(rows, positions=[2])
    b = build([params(temperature=0.5, seed=3, logit_bias={1: 1.0})], num_rows=2, positions=[2],
              max_logit_bias=4, max_allowed_tokens=8)
    for name in SamplingMetadata.fields():
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert not np.shares_memory(a["temperature"], table.gather(rows, positions=[2])["temperature"])
    padding = table.padding(4)
    assert padding["bias_token_ids"].shape == (4, 4) and padding["allowed_token_ids"].shape == (4, 8)
    np.testing.assert_array_equal(padding["temperature"], 0.0)
    md = SamplingMetadata.from_arrays(a)
    assert md.seeds is a["seeds"]


def test_huge_top_k_is_clamped_not_overflowed():
    arrays = build([params(temperature=1.0, top_k=2**40, seed=3)], num_rows=2)
    assert arrays["top_k"][0] == np.iinfo(np.int32).max


def test_all_greedy_of_a_step_reads_the_table_as_the_device_does():
    rows = [params(temperature=0.0), params(temperature=0.7, seed=1), params(temperature=1e-6),
            params(temperature=1.0, seed=2)]
    table = SamplingTable(len(rows))
    for slot, p in enumerate(rows):
        table.set_row(slot, p, None)
    pad = table.padding_slot
    for slots in ([0, 2], [0, 1], [2, pad, pad], [3], [pad]):
        want = all(rows[s].is_greedy for s in slots if s != pad)
        assert table.all_greedy(np.asarray(slots, np.int32)) is want
