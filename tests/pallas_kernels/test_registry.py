"""Registering an attention backend: checked against the reference, then found by name."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk


def dense_attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *, sm_scale,
                    sliding_window=None, soft_cap=None, causal=True, windowed=True):
    """Every token against the whole gathered page table of its request, masked to its context.
    ``causal=False`` / ``windowed=False`` drop a mask: wrong on purpose, for the refusals."""
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    r, mb = block_tables.shape
    tok = jnp.arange(t)
    req = jnp.clip(jnp.searchsorted(query_start_loc[1:], tok, side="right"), 0, r - 1)
    q_len = query_start_loc[req + 1] - query_start_loc[req]
    pos = kv_lens[req] - q_len + tok - query_start_loc[req]
    valid = tok < query_start_loc[jnp.reshape(num_seqs, (-1,))[0]]
    k = k_cache[block_tables[req]].reshape(t, mb * bs, hkv, d)
    v = v_cache[block_tables[req]].reshape(t, mb * bs, hkv, d)
    g = hq // hkv
    scores = jnp.einsum("tkgd,tskd->tkgs", q.reshape(t, hkv, g, d), k) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(mb * bs)
    keep = key_pos[None, :] <= (pos if causal else kv_lens[req] - 1)[:, None]
    if sliding_window is not None and windowed:
        keep &= key_pos[None, :] > pos[:, None] - sliding_window
    scores = jnp.where(keep[:, None, None, :], scores, -jnp.inf)
    out = jnp.einsum("tkgs,tskd->tkgd", jax.nn.softmax(scores, axis=-1), v).reshape(t, hq, d)
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)


@pytest.fixture
def registry_names():
    added = []
    yield added
    for name in added:
        if name in pk.available_backends():
            pk.unregister_attention_backend(name)


def test_a_correct_backend_is_registered_and_found(registry_names):
    check = pk.register_attention_backend("dense_test", dense_attention)
    registry_names.append("dense_test")
    assert check is not None and check.ok and set(check.errors) == {c.name for c in pk.registry.CHECK_CASES}
    assert "dense_test" in pk.available_backends() and pk.available_backends()[:len(pk.BACKENDS)] == pk.BACKENDS
    fn = pk.get_attention_fn("dense_test", interpret=True)
    args = pk.registry.make_check_batch(pk.registry.CHECK_CASES[2])
    want = pk.ragged_paged_attention_reference(*args, sm_scale=0.25)
    assert float(jnp.max(jnp.abs(fn(*args, sm_scale=0.25) - want))) < 2e-3


def test_the_check_covers_soft_cap_and_sliding_window():
    assert pk.check_against_reference(dense_attention, sliding_window=5, soft_cap=2.0).ok
    check = pk.check_against_reference(functools.partial(dense_attention, windowed=False), sliding_window=5)
    assert not check.ok and check.max_abs_error > check.atol


def test_a_wrong_backend_is_refused_with_its_errors(registry_names):
    with pytest.raises(ValueError, match="disagrees with ragged_paged_attention_reference"):
        pk.register_attention_backend("wrong_test", functools.partial(dense_attention, causal=False))
    assert "wrong_test" not in pk.available_backends()
    with pytest.raises(ValueError, match="unknown attention backend 'wrong_test'"):
        pk.get_attention_fn("wrong_test")


def test_names_are_guarded(registry_names):
    for name in ("xla", "cpu", "auto", ""):
        with pytest.raises(ValueError, match="built in or reserved"):
            pk.register_attention_backend(name, dense_attention, check=False)
    pk.register_attention_backend("twice_test", dense_attention, check=False)
    registry_names.append("twice_test")
    with pytest.raises(ValueError, match="already registered"):
        pk.register_attention_backend("twice_test", dense_attention, check=False)
    assert pk.register_attention_backend("twice_test", dense_attention, check=False, replace=True) is None
    pk.unregister_attention_backend("twice_test")
    with pytest.raises(KeyError):
        pk.unregister_attention_backend("twice_test")
