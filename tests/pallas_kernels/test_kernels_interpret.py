"""Pallas kernels (interpret mode on CPU) against the jnp reference on random ragged batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

from .batches import SCENARIOS, Bucket, call, make_batch, naive_attention, poison

SCALE = 0.25
F32_TOL = dict(rtol=2e-5, atol=2e-5)
LOW_TOL = dict(rtol=2e-2, atol=2e-2)
HEADS = {"g1": (2, 2), "g2": (4, 2), "g3": (6, 2), "g4": (8, 2), "g8": (16, 2)}


def _check(args, tol, **options):
    out = call("pallas", args, sm_scale=SCALE, **options)
    ref_opts = {k: v for k, v in options.items() if k in ("sliding_window", "soft_cap")}
    ref = call("xla", args, sm_scale=SCALE, **ref_opts)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, **tol)
    # padding tokens are zero
    n_valid = int(np.asarray(args[5])[int(np.asarray(args[6]).reshape(-1)[0])])
    assert (out[n_valid:] == 0).all()
    return out


@pytest.mark.parametrize("group", sorted(HEADS))
def test_mixed_kernel_all_scenarios(group):
    """decode-only, prefill-only, mixed, prefix hits and a full bucket; GQA groups 1/2/3/4/8."""
    hq, hkv = HEADS[group]
    bucket = Bucket(num_q_heads=hq, num_kv_heads=hkv)
    for i, name in enumerate(sorted(SCENARIOS)):
        args = make_batch(bucket, SCENARIOS[name], seed=10 + i)
        _check(args, F32_TOL, mode="mixed", block_q=4, block_kv=16)


@pytest.mark.parametrize("tuning", [dict(), dict(block_q=1, block_kv=8),
                                    dict(block_q=16, block_kv=4)])
def test_mixed_kernel_tunings(tuning):
    """Heuristic defaults, one-token tiles, and KV tiles smaller than a page."""
    bucket = Bucket()
    for i, name in enumerate(["mixed", "prefix"]):
        _check(make_batch(bucket, SCENARIOS[name], seed=20 + i), F32_TOL, mode="mixed", **tuning)


@pytest.mark.parametrize("group", ["g1", "g2", "g3", "g8"])
def test_decode_kernel(group):
    hq, hkv = HEADS[group]
    args = make_batch(Bucket(num_q_heads=hq, num_kv_heads=hkv), SCENARIOS["decode"], seed=30)
    _check(args, F32_TOL, mode="decode", block_kv=16, num_kv_splits=1)


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_decode_kernel_split_k(splits):
    """Split-K with more splits than some contexts have KV tiles (empty splits)."""
    args = make_batch(Bucket(), SCENARIOS["decode"], seed=31)
    _check(args, F32_TOL, mode="decode", block_kv=8, num_kv_splits=splits)


@pytest.mark.parametrize("mode", ["mixed", "decode"])
@pytest.mark.parametrize("window,cap", [(5, None), (None, 1.5), (12, 0.7)])
def test_sliding_window_and_soft_cap(mode, window, cap):
    bucket = Bucket(num_q_heads=8, num_kv_heads=2)
    names = ["mixed", "prefix"] if mode == "mixed" else ["decode"]
    tuning = dict(block_q=4, block_kv=8) if mode == "mixed" else dict(block_kv=8, num_kv_splits=2)
    for i, name in enumerate(names):
        args = make_batch(bucket, SCENARIOS[name], seed=40 + i)
        _check(args, F32_TOL, mode=mode, sliding_window=window, soft_cap=cap, **tuning)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mode", ["mixed", "decode"])
def test_low_precision(dtype, mode):
    bucket = Bucket(num_q_heads=8, num_kv_heads=2)
    name = "mixed" if mode == "mixed" else "decode"
    args = make_batch(bucket, SCENARIOS[name], dtype=dtype, seed=50)
    def fn(*a):
        return pk.ragged_paged_attention(*a, sm_scale=SCALE, interpret=True, mode=mode)

    assert jax.eval_shape(fn, *args).dtype == dtype
    _check(args, LOW_TOL, mode=mode)


def test_auto_mode_picks_a_correct_kernel():
    bucket = Bucket()
    for i, name in enumerate(["decode", "mixed"]):
        _check(make_batch(bucket, SCENARIOS[name], seed=60 + i), F32_TOL, mode="auto",
               block_q=4, block_kv=16)


@pytest.mark.parametrize("backend,options,scenario", [
    ("xla", dict(), "mixed"),
    ("pallas", dict(mode="mixed", block_q=4, block_kv=16), "mixed"),
    ("pallas", dict(mode="mixed", block_q=2, block_kv=8, sliding_window=6), "prefix"),
    ("pallas", dict(mode="decode", block_kv=16, num_kv_splits=1), "decode"),
    ("pallas", dict(mode="decode", block_kv=8, num_kv_splits=4), "decode"),
])
def test_never_reads_outside_the_context(backend, options, scenario):
    """NaN in padding tokens, the null block, free blocks and the unused tail of last pages:
    a kernel that touched any of them (even masked: 0 * NaN = NaN) would produce NaN."""
    args = poison(make_batch(Bucket(num_q_heads=8, num_kv_heads=2), SCENARIOS[scenario], seed=70))
    out = call(backend, args, sm_scale=SCALE, **options)
    assert np.isfinite(out).all()
    ref_opts = {k: v for k, v in options.items() if k == "sliding_window"}
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=SCALE, **ref_opts), **F32_TOL)


def test_traced_num_seqs_and_scalar_form():
    """num_seqs as a traced scalar inside jit gives the same result as the [1] form."""
    bucket = Bucket()
    args = make_batch(bucket, SCENARIOS["mixed"], seed=80)
    a = call("pallas", args, sm_scale=SCALE, mode="mixed", block_q=4, block_kv=16)
    args_scalar = args[:-1] + (jnp.asarray(args[-1][0]),)
    b = call("pallas", args_scalar, sm_scale=SCALE, mode="mixed", block_q=4, block_kv=16)
    np.testing.assert_array_equal(a, b)


def test_get_attention_fn():
    bucket = Bucket()
    args = make_batch(bucket, SCENARIOS["decode"], seed=90)
    ref = call("xla", args, sm_scale=SCALE)
    for backend in ("xla", "pallas"):
        fn = pk.get_attention_fn(backend, interpret=True)
        out = np.asarray(jax.jit(lambda *a, fn=fn: fn(*a, sm_scale=SCALE))(*args))
        np.testing.assert_allclose(out, ref, **F32_TOL)
    with pytest.raises(ValueError):
        pk.get_attention_fn("cuda-magic", interpret=False)


def test_grid_bound_covers_worst_case():
    """num_q_tiles bounds sum(ceil(q_len / block_q)) for every ragged split of T tokens."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        t = int(rng.integers(1, 300))
        r = int(rng.integers(1, 64))
        bq = int(2 ** rng.integers(0, 7))
        n = int(rng.integers(1, min(r, t) + 1))  # non-empty requests
        used = int(rng.integers(n, t + 1))  # tokens in use (the rest is padding)
        cuts = np.sort(rng.choice(np.arange(1, used), size=n - 1, replace=False)) if n > 1 else []
        lens = np.diff(np.concatenate([[0], cuts, [used]]).astype(int))
        assert (lens > 0).all() and lens.sum() == used
        assert sum(-(-int(x) // bq) for x in lens) <= pk.num_q_tiles(t, r, bq)
    # tight for decode buckets and single long prefills
    assert pk.num_q_tiles(256, 256, 16) == 256
    assert pk.num_q_tiles(1024, 8, 16) == (1024 + 8 * 15) // 16


def test_invalid_configs_raise():
    args = make_batch(Bucket(), SCENARIOS["decode"], seed=1)
    with pytest.raises(ValueError, match="power of two"):
        pk.ragged_paged_attention(*args, sm_scale=SCALE, interpret=True, block_kv=12)
    with pytest.raises(ValueError, match="mode"):
        pk.ragged_paged_attention(*args, sm_scale=SCALE, interpret=True, mode="prefill")
    with pytest.raises(ValueError, match="sliding_window"):
        pk.ragged_paged_attention(*args, sm_scale=SCALE, interpret=True, sliding_window=0)
