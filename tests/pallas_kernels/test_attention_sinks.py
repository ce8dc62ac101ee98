"""Attention sinks (gpt-oss): a learned per-head logit in the softmax's denominator, in the jnp
oracle, the ``xla`` backend and the ``cpu`` kernel, against the naive float64 loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

from .batches import SCENARIOS, Bucket, make_batch, naive_attention, poison

SCALE = 0.25


def _sinks(hq: int, seed: int) -> jax.Array:
    # large enough (some above every score) that a wrong fold shows; per head, so a head mix-up shows
    return jnp.asarray(np.random.default_rng(seed).normal(0.0, 2.0, hq), jnp.float32)


@pytest.mark.parametrize("backend", ["reference", "xla", "cpu"])
@pytest.mark.parametrize("scenario,window", [("mixed", None), ("prefix", 5), ("decode", 12)])
def test_sinks_match_naive(backend, scenario, window):
    heads = (6, 2)  # 3 query heads per KV head: a head mix-up in the grouped rows shows
    bucket = Bucket(num_q_heads=heads[0], num_kv_heads=heads[1])
    args = poison(make_batch(bucket, SCENARIOS[scenario], seed=7), sliding_window=window)
    sinks = _sinks(heads[0], seed=heads[0])
    if backend == "cpu" and not pk.cpu_attention_available()[0]:
        pytest.skip(f"the cpu kernel is unavailable: {pk.cpu_attention_available()[1]}")
    fn = pk.ragged_paged_attention_reference if backend == "reference" else pk.get_attention_fn(backend)
    out = jax.jit(lambda *a: fn(*a, sm_scale=SCALE, sliding_window=window, sinks=sinks))(*args)
    ref = naive_attention(*args, sm_scale=SCALE, sliding_window=window, sinks=np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5)
    plain = naive_attention(*args, sm_scale=SCALE, sliding_window=window)
    assert np.abs(ref - plain).max() > 1e-2  # the sinks changed the output


def test_sinks_pull_the_output_toward_zero():
    """A sink far above every score takes all the weight: the output goes to 0 (finite), where
    plain attention would return a convex mix of the values."""
    args = make_batch(Bucket(), SCENARIOS["mixed"], seed=2)
    sinks = jnp.full((Bucket().num_q_heads,), 1e4, jnp.float32)
    out = np.asarray(pk.ragged_paged_attention_reference(*args, sm_scale=SCALE, sinks=sinks))
    assert np.isfinite(out).all() and np.abs(out).max() < 1e-6


def test_sinks_of_the_wrong_shape_are_refused():
    args = make_batch(Bucket(), SCENARIOS["decode"], seed=1)
    with pytest.raises(ValueError, match="sinks must be"):
        pk.get_attention_fn("xla")(*args, sm_scale=SCALE, sinks=jnp.zeros((3,)))
