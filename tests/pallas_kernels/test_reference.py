"""The jnp oracle (``xla`` backend) against a naive per-request loop, and ``write_kv``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

from .batches import SCENARIOS, Bucket, call, make_batch, naive_attention, poison

SCALE = 0.25


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 2), (16, 2), (6, 2)])
def test_reference_matches_naive(scenario, heads):
    bucket = Bucket(num_q_heads=heads[0], num_kv_heads=heads[1])
    args = make_batch(bucket, SCENARIOS[scenario], seed=sorted(SCENARIOS).index(scenario))
    out = call("xla", args, sm_scale=SCALE)
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=SCALE), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window,cap", [(5, None), (None, 1.5), (12, 0.7), (1, None)])
@pytest.mark.parametrize("scenario", ["mixed", "prefix", "decode"])
def test_reference_window_and_softcap(scenario, window, cap):
    args = make_batch(Bucket(), SCENARIOS[scenario], seed=3)
    out = call("xla", args, sm_scale=SCALE, sliding_window=window, soft_cap=cap)
    ref = naive_attention(*args, sm_scale=SCALE, sliding_window=window, soft_cap=cap)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["reference", "xla"])
@pytest.mark.parametrize("window", [5, 12])
def test_window_ignores_the_pages_the_scheduler_released(backend, window):
    """NaN in the pages before each request's window (released by the scheduler, still named by
    the block table) and everywhere else outside the contexts never reaches the output."""
    args = poison(make_batch(Bucket(), SCENARIOS["prefix"], seed=4), sliding_window=window)
    if backend == "reference":
        out = call("xla", args, sm_scale=SCALE, sliding_window=window)
    else:
        fn = jax.jit(lambda *a: pk.get_attention_fn("xla")(*a, sm_scale=SCALE, sliding_window=window))
        out = np.asarray(fn(*args))
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=SCALE, sliding_window=window),
                               rtol=2e-5, atol=2e-5)


def test_reference_small_kv_chunk_and_scalar_num_seqs():
    """Chunked loop with one page per step, and num_seqs given as a scalar."""
    args = make_batch(Bucket(), SCENARIOS["mixed"], seed=5, num_seqs_scalar=True)
    out = call("xla", args, sm_scale=SCALE, kv_chunk=8)
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=SCALE), rtol=2e-5, atol=2e-5)


def test_reference_padding_is_zero_and_finite():
    bucket = Bucket()
    args = list(make_batch(bucket, SCENARIOS["decode"], seed=1))
    args[0] = args[0].at[6:].set(jnp.nan)  # padding tokens may hold anything
    out = call("xla", tuple(args), sm_scale=SCALE)
    assert np.isfinite(out).all()
    assert (out[6:] == 0).all()


def test_reference_empty_batch():
    args = make_batch(Bucket(), [(1, 1)], seed=2)
    args = args[:-1] + (jnp.asarray([0], jnp.int32),)
    out = call("xla", args, sm_scale=SCALE)
    assert (out == 0).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_reference_low_precision_inputs(dtype):
    args = make_batch(Bucket(), SCENARIOS["mixed"], dtype=dtype, seed=4)
    out = pk.ragged_paged_attention_reference(*args, sm_scale=SCALE)
    assert out.dtype == dtype
    ref = naive_attention(*args, sm_scale=SCALE)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2, atol=2e-2)


def test_write_kv_scatters_and_ignores_negative_slots():
    nb, bs, hkv, d = 6, 4, 2, 3
    k = jnp.zeros((nb, bs, hkv, d), jnp.float32)
    v = jnp.ones((nb, bs, hkv, d), jnp.bfloat16)
    slots = jnp.array([5, -1, 0, 23, -7, 9], jnp.int32)
    k_new = jnp.arange(6 * hkv * d, dtype=jnp.float32).reshape(6, hkv, d) + 1
    v_new = -k_new
    k2, v2 = jax.jit(pk.write_kv, donate_argnums=(0, 1))(k, v, k_new, v_new, slots)
    assert k2.dtype == jnp.float32 and v2.dtype == jnp.bfloat16
    k_exp = np.zeros((nb * bs, hkv, d), np.float32)
    v_exp = np.ones((nb * bs, hkv, d), np.float32)
    for i, s in enumerate(np.asarray(slots)):
        if s >= 0:
            k_exp[s] = np.asarray(k_new[i])
            v_exp[s] = np.asarray(v_new[i])
    np.testing.assert_array_equal(np.asarray(k2).reshape(-1, hkv, d), k_exp)
    np.testing.assert_array_equal(np.asarray(v2, np.float32).reshape(-1, hkv, d), v_exp)
    # block 5 offset 3 = slot 23; block 0 offset 0 = slot 0
    np.testing.assert_array_equal(np.asarray(k2[5, 3]), np.asarray(k_new[3]))


def test_write_then_attend_roundtrip():
    """write_kv feeding the reference equals attention over the written context."""
    bucket = Bucket()
    args = make_batch(bucket, [(3, 10), (1, 5)], seed=9)
    q, kc, vc, kv_lens, bt, qsl, ns = args
    # overwrite this step's positions (the last q_len of each context) through write_kv
    slots = []
    rng = np.random.default_rng(0)
    for r, (ql, kl) in enumerate([(3, 10), (1, 5)]):
        for p in range(kl - ql, kl):
            bs = bucket.block_size
            slots.append(int(bt[r, p // bs]) * bs + p % bs)
    slots += [-1] * (bucket.num_tokens - len(slots))
    shape = (bucket.num_tokens, bucket.num_kv_heads, bucket.head_dim)
    new_k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    kc2, vc2 = pk.write_kv(kc, vc, new_k, new_k, jnp.asarray(slots, jnp.int32))
    args2 = (q, kc2, vc2, kv_lens, bt, qsl, ns)
    out = call("xla", args2, sm_scale=SCALE)
    np.testing.assert_allclose(out, naive_attention(*args2, sm_scale=SCALE), rtol=2e-5, atol=2e-5)
    # the untouched padding slots of the null block stay as they were
    np.testing.assert_array_equal(np.asarray(kc2[0]), np.asarray(kc[0]))
