"""Int8 K/V pools with a scale per position and KV head (--kv-cache-dtype int8): the rows' layout,
``write_kv`` into them, and the CPU backends (the jnp reference, the tiled ``xla`` backend, the C++
kernel) reading them: exactly the oracle on the dequantized values, and the float pool within the
rounding's bound."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.int8_kv import SCALE_BYTES, dequantize_rows, quantize_rows

from .batches import SCENARIOS, Bucket, make_batch, naive_attention, poison

SCALE = 0.25
CPU_BACKENDS = ("reference", "xla", "cpu")
MEAN_ERR = 0.02  # int8 rounding gives 0.005-0.007 on these batches, one scale for all rows 0.13-0.29


def _fn(backend: str):
    if backend == "cpu" and shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler to build the cpu kernel with")
    return pk.ragged_paged_attention_reference if backend == "reference" else pk.get_attention_fn(backend)


def test_rows_round_trip_within_half_a_step():
    rng = np.random.default_rng(0)
    # heads of very different magnitudes: a per-head (not per-pool) scale keeps each one's precision
    x = rng.standard_normal((6, 3, 32)).astype(np.float32) * np.array([1e-3, 1.0, 40.0])[None, :, None]
    x[2, 1] = 0.0  # an all-zero row: scale 0, reads back as zeros
    rows = quantize_rows(jnp.asarray(x))
    assert rows.dtype == jnp.int8 and rows.shape == (6, 3, 32 + SCALE_BYTES)
    scale = np.abs(x).max(-1) / 127.0
    stored = np.asarray(jax.lax.bitcast_convert_type(rows[..., -SCALE_BYTES:], jnp.float32))
    np.testing.assert_allclose(stored, scale, rtol=1e-6)
    back = np.asarray(dequantize_rows(rows))
    assert np.all(np.abs(back - x) <= scale[..., None] * (0.5 + 1e-5))
    np.testing.assert_array_equal(back[2, 1], 0.0)
    assert np.abs(np.asarray(rows[..., :-SCALE_BYTES])).max() == 127  # each row's largest uses the full range


def test_write_kv_quantizes_each_row_and_drops_padding():
    rng = np.random.default_rng(1)
    pool = jnp.zeros((4, 8, 2, 16 + SCALE_BYTES), jnp.int8)
    new = jnp.asarray(rng.standard_normal((3, 2, 16)).astype(np.float32) * 5)
    k, v = pk.write_kv(pool, pool, new, -new, jnp.asarray([9, -1, 30], jnp.int32))
    got = np.asarray(dequantize_rows(k))
    for row, slot in ((0, 9), (2, 30)):
        scale = np.abs(np.asarray(new[row])).max(-1, keepdims=True) / 127
        assert np.all(np.abs(got[slot // 8, slot % 8] - np.asarray(new[row])) <= scale * 0.5 + 1e-6)
    np.testing.assert_array_equal(np.asarray(dequantize_rows(v))[1, 1], -got[1, 1])
    assert int(jnp.count_nonzero(k)) == int(jnp.count_nonzero(k[1, 1])) + int(jnp.count_nonzero(k[3, 6]))


def _int8_batch(head_dim: int, block_size: int, q_dtype=jnp.float32, seed: int = 0):
    b = Bucket(num_q_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=block_size, max_blocks=64 // block_size,
               num_blocks=24)
    q, kc, vc, *rest = make_batch(b, SCENARIOS["mixed"], seed=seed)
    # keys of uneven size per head and channel, as real ones are; values plain
    kc = kc * jnp.linspace(0.2, 6.0, head_dim)[None, None, None, :] * jnp.asarray([1.0, 3.0])[None, None, :, None]
    return (q.astype(q_dtype), kc, vc, *rest)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_backends_read_int8_pools(backend):
    """Against the oracle on the dequantized values (tight: only the order of sums differs), and
    against the float pool within the rounding (a scale read wrong, or from the wrong head, is off
    by the scale's own order)."""
    fn = _fn(backend)
    shapes = ((64, 16), (16, 8)) if backend == "cpu" else ((16, 8),)  # the kernel's AVX-512 D and portable D
    for d, bs in shapes:
        q, kc, vc, *rest = _int8_batch(d, bs)
        k8, v8 = quantize_rows(kc), quantize_rows(vc)
        out = np.asarray(jax.jit(lambda *a: fn(*a, sm_scale=SCALE))(q, k8, v8, *rest))
        deq = naive_attention(q, dequantize_rows(k8), dequantize_rows(v8), *rest, sm_scale=SCALE)
        np.testing.assert_allclose(out, deq, rtol=2e-5, atol=2e-5)
        # The mean error: these keys make sharp softmaxes, where a near-tie moves single outputs.
        exact = naive_attention(q, kc, vc, *rest, sm_scale=SCALE)
        assert np.abs(out - exact).mean() < MEAN_ERR
        # the bound means something: the pool read with one scale for every row misses it
        flat = jnp.max(jax.lax.bitcast_convert_type(k8[..., -SCALE_BYTES:], jnp.float32))
        wrong = k8.at[..., -SCALE_BYTES:].set(jax.lax.bitcast_convert_type(
            jnp.full(k8.shape[:-1], flat, jnp.float32), jnp.int8))
        off = np.asarray(fn(q, wrong, v8, *rest, sm_scale=SCALE))
        assert np.abs(off - exact).mean() > 5 * MEAN_ERR


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_int8_pools_poisoned_outside_the_contexts(backend):
    """bf16 queries; every slot no live request owns holds NaN scales (and NaN queries past the
    batch): each backend stays finite and matches the oracle."""
    fn = _fn(backend)
    q, kc, vc, *rest = _int8_batch(64, 16, q_dtype=jnp.bfloat16, seed=5)
    pq, pk_, pv, *prest = poison((q, kc, vc, *rest))
    k8, v8 = quantize_rows(pk_), quantize_rows(pv)
    assert bool(jnp.isnan(dequantize_rows(k8)).any())
    out = jax.jit(lambda *a: fn(*a, sm_scale=SCALE))(pq, k8, v8, *prest)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    ref = naive_attention(pq, dequantize_rows(k8), dequantize_rows(v8), *prest, sm_scale=SCALE)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


def test_a_pool_without_room_for_scales_is_refused():
    q, kc, vc, *rest = _int8_batch(16, 8)
    with pytest.raises(ValueError, match="head_dim"):
        pk.ragged_paged_attention_reference(q, kc.astype(jnp.int8), vc.astype(jnp.int8), *rest, sm_scale=SCALE)
