"""The jax_triton backend: availability reporting, its launch plan (CPU), and correctness (GPU)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

from .batches import SCENARIOS, Bucket, make_batch, naive_attention

AVAILABLE, REASON = pk.triton_available()


def test_triton_available_reports_a_reason():
    ok, reason = pk.triton_available()
    assert isinstance(ok, bool) and isinstance(reason, str)
    assert ok or reason


@pytest.mark.skipif(AVAILABLE, reason="triton backend is available here")
def test_unavailable_backend_raises_runtime_error():
    with pytest.raises(RuntimeError, match="unavailable"):
        pk.get_attention_fn("triton", interpret=False)
    args = make_batch(Bucket(), SCENARIOS["decode"])
    with pytest.raises(RuntimeError):
        pk.ragged_paged_attention_triton(*args, sm_scale=0.25)


def test_triton_has_no_interpret_mode():
    with pytest.raises(RuntimeError, match="interpret"):
        pk.get_attention_fn("triton", interpret=True)


def _plan(**kw):
    base = dict(num_tokens=256, num_q_heads=32, num_kv_heads=8, head_dim=128, num_blocks=4096,
                block_size=16, num_seqs=256, max_blocks=128, dtype=jnp.bfloat16, sm_scale=0.125)
    base.update(kw)
    return pk.triton_launch_plan(**base)


def test_launch_plan_decode_bucket():
    p = _plan(block_q=4, block_kv=64)
    assert p.grid == (pk.num_q_tiles(256, 256, 4), 8) == (256, 8)
    c = p.constexprs
    assert (c["G"], c["G_PAD"], c["ROWS"], c["R_PAD"]) == (4, 4, 16, 256)
    assert c["SCALE"] == pytest.approx(0.125 * math.log2(math.e))
    assert c["SOFT_CAP"] == 0.0 and c["WINDOW"] == 0 and c["IEEE"] is False
    assert p.out_rows == 256 * 32


def test_launch_plan_prefill_bucket_and_options():
    p = _plan(num_tokens=8192, num_seqs=8, dtype=jnp.float32, sliding_window=4096,
              soft_cap=30.0, num_warps=8, num_stages=3)
    c = p.constexprs
    assert c["IEEE"] is True and c["WINDOW"] == 4096 and c["SOFT_CAP"] == 30.0
    assert c["SCALE"] == pytest.approx(0.125)  # log2(e) applied after the cap
    assert p.grid[0] == pk.num_q_tiles(8192, 8, c["BLOCK_Q"]) and p.grid[1] == 8
    assert (p.num_warps, p.num_stages) == (8, 3)
    assert c["ROWS"] == c["BLOCK_Q"] * c["G_PAD"] >= 16


def test_launch_plan_non_power_of_two_group_and_r():
    p = _plan(num_q_heads=24, num_kv_heads=8, num_seqs=100, block_q=8)
    c = p.constexprs
    assert (c["G"], c["G_PAD"], c["ROWS"], c["R_PAD"]) == (3, 4, 32, 128)


@pytest.mark.parametrize("bad", [dict(block_kv=48), dict(head_dim=96), dict(block_size=12),
                                 dict(block_q=1, num_q_heads=8), dict(block_kv=8)])
def test_launch_plan_rejects_invalid_shapes(bad):
    with pytest.raises(ValueError):
        _plan(**bad)


@pytest.mark.skipif(not AVAILABLE, reason=f"triton backend unavailable: {REASON}")
@pytest.mark.parametrize("scenario", ["decode", "mixed", "prefix"])
def test_triton_matches_naive_on_gpu(scenario):
    bucket = Bucket(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=64,
                    max_blocks=4)
    args = make_batch(bucket, SCENARIOS[scenario], seed=1)
    out = pk.ragged_paged_attention_triton(*args, sm_scale=0.125, block_q=8, block_kv=16)
    np.testing.assert_allclose(np.asarray(out), naive_attention(*args, sm_scale=0.125),
                               rtol=1e-4, atol=1e-4)
