"""The mixed-batch LoRA delta: every form equals the row-by-row reference, base tokens get nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.lora import (
    LoRABatch,
    lora_delta_gathered,
    lora_delta_one_hot,
    lora_delta_packed,
    lora_delta_parts,
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


def fused_tables(rng, slots, d_in, rank, widths, shards):
    """A fused projection's tables as the slot table stores them (``a`` ``(in, slots, parts*rank)``,
    compact ``b`` ``(slots, rank, out)`` with ``shards`` groups of ``widths`` columns) and the
    row-by-row reference's unfused per-part tables, with each part's columns in the fused order."""
    a_parts = [rng.standard_normal((slots, d_in, rank), np.float32) for _ in widths]
    b_parts = [rng.standard_normal((slots, rank, shards * w), np.float32) for w in widths]
    a = np.concatenate([np.transpose(ap, (1, 0, 2)) for ap in a_parts], axis=-1)
    b = np.concatenate([bp.reshape(slots, rank, shards, w) for bp, w in zip(b_parts, widths)], axis=-1)
    return a, b.reshape(slots, rank, -1), a_parts, b_parts


def fused_reference(x, ids, a_parts, b_parts, widths, shards):
    outs = [lora_delta_reference(x, ids, ap, bp).reshape(len(x), shards, w)
            for ap, bp, w in zip(a_parts, b_parts, widths)]
    return np.concatenate(outs, axis=-1).reshape(len(x), -1)


@pytest.mark.parametrize("widths", [(16, 8, 8), (12, 12), (20,)])
@pytest.mark.parametrize("shards", [1, 2])
def test_parts_form_equals_reference(widths, shards):
    """The runner's form on a compact fused table (q|k|v-like, gate|up-like, one part), columns in
    one or two shards' order: each part's delta lands in its own columns only."""
    rng = np.random.default_rng(len(widths) * 10 + shards)
    slots, d_in, rank, tokens = 4, 24, 8, 11
    a, b, a_parts, b_parts = fused_tables(rng, slots, d_in, rank, widths, shards)
    x = rng.standard_normal((tokens, d_in), np.float32)
    ids = rng.integers(-1, slots, tokens).astype(np.int32)
    ids[0], ids[1] = -1, slots - 1
    got = np.asarray(jax.jit(lora_delta_parts, static_argnums=(4, 5))(x, ids, a, b, widths, shards))
    want = fused_reference(x, ids, a_parts, b_parts, widths, shards)
    assert np.abs(want[1]).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not got[ids == -1].any()
    # the stacked (layers, ...) B table, each part slicing its block of one layer, static or traced
    a_layers = np.stack([rng.standard_normal(a.shape, np.float32), a, rng.standard_normal(a.shape, np.float32)])
    b_layers = np.stack([rng.standard_normal(b.shape, np.float32), b, rng.standard_normal(b.shape, np.float32)])
    delta = jax.jit(lora_delta_parts, static_argnums=(4, 5))
    for layer in (1, jnp.int32(1)):
        np.testing.assert_allclose(np.asarray(delta(x, ids, a_layers, b_layers, widths, shards, layer)), want,
                                   rtol=1e-4, atol=1e-4)


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (jit, custom calls)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _eqns(inner)


@pytest.mark.parametrize("layer", [1, "traced"])
def test_fused_parts_slice_the_stacked_table_once_each(layer):
    """A layer's q|k|v delta reads each part's block of the stacked ``(layers, slots, rank, out)``
    B table in one slice, never the layer's whole ``(slots, rank, out)`` slice first: XLA:GPU wrote
    that shared slice out once per layer (a table copy in every step, see
    scripts/gpu_aot_check.py --enable-lora), where one slice per part fuses into its dot."""
    rng = np.random.default_rng(7)
    layers, slots, d_in, rank, tokens, widths, shards = 3, 3, 24, 4, 5, (16, 8, 8), 2
    tables = [fused_tables(rng, slots, d_in, rank, widths, shards) for _ in range(layers)]
    a, b = np.stack([t[0] for t in tables]), np.stack([t[1] for t in tables])
    x = rng.standard_normal((tokens, d_in), np.float32)
    ids = np.array([0, -1, 2, 1, 2], np.int32)
    lora = LoRABatch(jnp.asarray(ids), {"qkv": jnp.asarray(a)}, {"qkv": jnp.asarray(b)})

    def delta(lora, x, i):
        return lora.delta("qkv", x, 1 if layer == 1 else i, widths, shards)

    got = np.asarray(jax.jit(delta)(lora, x, jnp.int32(1)))
    np.testing.assert_allclose(got, fused_reference(x, ids, tables[1][2], tables[1][3], widths, shards),
                               rtol=1e-4, atol=1e-4)
    jaxpr = jax.make_jaxpr(delta)(lora, x, jnp.int32(1)).jaxpr
    one_layer = slots * rank * b.shape[-1]
    sizes = [v.aval.size for eqn in _eqns(jaxpr) for v in eqn.outvars if hasattr(v.aval, "size")]
    assert one_layer not in sizes, "one layer's whole B slice is materialised before the parts'"
    part_blocks = {slots * rank * shards * w for w in widths}
    assert part_blocks <= set(sizes)  # each part's block is sliced straight from the table


@pytest.mark.parametrize("tokens", [2, 9])
def test_gathered_form_equals_parts_form(tokens):
    """The decode form (each token's own slot, B part by part) against the runner's form on a
    random compact fused table, base tokens included."""
    rng = np.random.default_rng(tokens)
    slots, d_in, rank, widths = 4, 24, 8, (16, 8, 8)
    a, b, a_parts, b_parts = fused_tables(rng, slots, d_in, rank, widths, 1)
    x = rng.standard_normal((tokens, d_in), np.float32)
    ids = rng.integers(-1, slots, tokens).astype(np.int32)
    ids[0], ids[1] = -1, slots - 1  # a base token and an adapter token at least
    want = fused_reference(x, ids, a_parts, b_parts, widths, 1)
    assert np.abs(want[1]).max() > 0
    got = np.asarray(jax.jit(lora_delta_gathered, static_argnums=4)(x, ids, a, b, widths))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not got[ids == -1].any()
