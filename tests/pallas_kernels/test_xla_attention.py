"""The engine's ``xla`` backend (query tiles over the ragged batch) against the naive oracle."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import pallas_kernels as pk

from .batches import SCENARIOS, Bucket, make_batch, naive_attention, poison

SCALE = 0.25


@functools.cache
def xla_fn(**options):
    return jax.jit(functools.partial(pk.ragged_paged_attention_xla, **options))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_q", [1, 2, 8])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1)])
def test_xla_backend_matches_naive(scenario, block_q, heads):
    args = make_batch(Bucket(num_q_heads=heads[0], num_kv_heads=heads[1]), SCENARIOS[scenario], seed=7)
    out = xla_fn(sm_scale=SCALE, block_q=block_q, kv_chunk=8)(*args)
    np.testing.assert_allclose(np.asarray(out), naive_attention(*args, sm_scale=SCALE), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window,cap", [(5, None), (None, 1.5), (12, 0.7)])
def test_xla_backend_window_and_softcap(window, cap):
    args = make_batch(Bucket(), SCENARIOS["mixed"], seed=8)
    out = xla_fn(sm_scale=SCALE, block_q=4, sliding_window=window, soft_cap=cap)(*args)
    ref = naive_attention(*args, sm_scale=SCALE, sliding_window=window, soft_cap=cap)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("block_q", [1, 4])
def test_xla_backend_never_reads_outside_contexts(block_q):
    """Slots outside every context are NaN: a correct backend masks them out of its result."""
    args = poison(make_batch(Bucket(), SCENARIOS["prefix"], seed=9))
    out = np.asarray(xla_fn(sm_scale=SCALE, block_q=block_q)(*args))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=SCALE), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("num_groups", [1, 2, 3, 64])
@pytest.mark.parametrize("scenario", ["mixed", "prefix", "decode"])
def test_xla_backend_tile_groups(scenario, num_groups):
    """Tiles sorted by the context they need and split into loops of their own give the same result
    for any number of groups (64: more groups than tiles, clamped to one tile each)."""
    args = make_batch(Bucket(), SCENARIOS[scenario], seed=11)
    out = xla_fn(sm_scale=SCALE, block_q=2, kv_chunk=8, num_groups=num_groups)(*args)
    np.testing.assert_allclose(np.asarray(out), naive_attention(*args, sm_scale=SCALE), rtol=2e-5, atol=2e-5)


def test_default_tiling_choice():
    """Decode-sized buckets (T <= R) use one-query tiles; larger ones use 8. Both agree."""
    args = make_batch(Bucket(num_tokens=32, num_reqs=8), SCENARIOS["full"], seed=10)
    tiled = xla_fn(sm_scale=SCALE)(*args)
    per_token = pk.ragged_paged_attention_reference(*args, sm_scale=SCALE)
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(per_token), rtol=2e-5, atol=2e-5)
