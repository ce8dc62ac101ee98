"""The mixed-batch LoRA delta: both forms equal the row-by-row reference, base tokens get nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.layers.lora import (
    lora_delta_gathered,
    lora_delta_one_hot,
    lora_delta_packed,
    lora_delta_ragged,
    lora_delta_reference,
)


def packed(x, slot_ids, a, b):
    """The slot tables' layout: ``a`` as ``(in, slots, rank)``."""
    return lora_delta_packed(x, slot_ids, jax.numpy.transpose(a, (1, 0, 2)), b)


@pytest.mark.parametrize("fn", [lora_delta_one_hot, lora_delta_ragged, packed])
@pytest.mark.parametrize("slots", [1, 4])
def test_each_token_gets_its_own_slot(fn, slots):
    rng = np.random.default_rng(slots)
    tokens, d_in, rank, d_out = 13, 24, 8, 40
    x = rng.standard_normal((tokens, d_in), np.float32)
    a = rng.standard_normal((slots, d_in, rank), np.float32)
    b = rng.standard_normal((slots, rank, d_out), np.float32)
    ids = rng.integers(-1, slots, tokens).astype(np.int32)
    ids[0] = -1
    got = np.asarray(jax.jit(fn)(x, ids, a, b))
    np.testing.assert_allclose(got, lora_delta_reference(x, ids, a, b), rtol=1e-4, atol=1e-4)
    assert not got[ids == -1].any()


def test_one_program_serves_every_slot_assignment():
    fn = jax.jit(lora_delta_one_hot)
    x = np.ones((4, 8), np.float32)
    a, b = np.ones((2, 8, 2), np.float32), np.ones((2, 2, 3), np.float32)
    fn(x, np.array([-1, -1, -1, -1], np.int32), a, b)
    compiled = fn._cache_size()
    for ids in ([0, 1, -1, 0], [1, 1, 1, 1]):
        fn(x, np.array(ids, np.int32), a * ids[0], b)  # other slots, other weights
    assert fn._cache_size() == compiled


@pytest.mark.parametrize("tokens", [2, 9])
def test_gathered_form_equals_one_hot_on_fused_tables(tokens):
    """The decode form (each token's own slot, B part by part) against the one-hot form over a
    random block-diagonal fused table, base tokens included."""
    rng = np.random.default_rng(tokens)
    slots, d_in, rank, widths = 4, 24, 8, (16, 8, 8)
    a = rng.standard_normal((d_in, slots, len(widths) * rank), np.float32)
    b = np.zeros((slots, len(widths) * rank, sum(widths)), np.float32)
    col = 0
    for p, w in enumerate(widths):  # block-diagonal: part p's rank block writes only its own columns
        b[:, p * rank:(p + 1) * rank, col:col + w] = rng.standard_normal((slots, rank, w), np.float32)
        col += w
    x = rng.standard_normal((tokens, d_in), np.float32)
    ids = rng.integers(-1, slots, tokens).astype(np.int32)
    ids[0], ids[1] = -1, slots - 1  # a base token and an adapter token at least
    want = np.asarray(jax.jit(lora_delta_packed)(x, ids, a, b))
    assert np.abs(want[1]).max() > 0
    got = np.asarray(jax.jit(lora_delta_gathered, static_argnums=4)(x, ids, a, b, widths))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not got[ids == -1].any()
