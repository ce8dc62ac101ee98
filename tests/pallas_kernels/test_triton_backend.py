"""The Triton backend: availability reporting, its launch plan, the kernel run by Triton's
interpreter on CPU (the same source jax_triton compiles on a GPU), and correctness on a GPU."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import triton_cubin

from .batches import SCENARIOS, Bucket, make_batch, naive_attention, poison

AVAILABLE, REASON = pk.triton_available()
# Skip only when the packages are missing: triton imported in compiled mode must fail loudly.
needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="Triton's interpreter needs triton and torch")
TOL = {jnp.float32: 2e-5, jnp.float16: 2e-2, jnp.bfloat16: 2e-2}


def interpreted(args, group: int, **options):
    """The Triton kernel in Triton's interpreter, under jax.jit (a host callback in the program)."""
    fn = jax.jit(functools.partial(pk.ragged_paged_attention_triton, interpret=True, sm_scale=0.25,
                                   block_q=max(1, 16 // group), block_kv=16, **options))
    return np.asarray(fn(*args)).astype(np.float32)


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


@needs_interpreter
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_triton_kernel_interpreted_matches_naive(scenario, group):
    args = make_batch(Bucket(num_q_heads=2 * group, num_kv_heads=2), SCENARIOS[scenario], seed=3)
    np.testing.assert_allclose(interpreted(args, group), naive_attention(*args, sm_scale=0.25),
                               rtol=2e-5, atol=2e-5)


@needs_interpreter
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_triton_kernel_interpreted_half_precision(dtype):
    args = make_batch(Bucket(), SCENARIOS["mixed"], seed=4, dtype=dtype)
    ref = naive_attention(*args, sm_scale=0.25)
    np.testing.assert_allclose(interpreted(args, 2), ref, rtol=TOL[dtype], atol=TOL[dtype])


@needs_interpreter
@pytest.mark.parametrize("window,cap", [(5, None), (None, 1.5), (12, 0.7)])
def test_triton_kernel_interpreted_window_and_softcap(window, cap):
    args = make_batch(Bucket(), SCENARIOS["mixed"], seed=5)
    ref = naive_attention(*args, sm_scale=0.25, sliding_window=window, soft_cap=cap)
    np.testing.assert_allclose(interpreted(args, 2, sliding_window=window, soft_cap=cap), ref,
                               rtol=2e-5, atol=2e-5)


@needs_interpreter
def test_triton_kernel_interpreted_never_reads_outside_contexts():
    """Slots outside every context are NaN: the kernel must mask them out of its result."""
    args = poison(make_batch(Bucket(), SCENARIOS["prefix"], seed=6))
    out = interpreted(args, 2)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=0.25), rtol=2e-5, atol=2e-5)


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


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_compiles_to_an_sm90_cubin_for_every_runner_config():
    """Triton's own compiler (with the ptxas it ships) builds the kernel for an H200 on this CPU.

    A subprocess, because this test process runs Triton in interpreter mode."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pallas_kernels.triton_cubin"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == len(triton_cubin.compile_configs())
    assert {r["config"]["dtype"] for r in results} == {"float32", "bfloat16", "float16"}
    for r in results:
        assert "error" not in r, r
        assert r["cubin_bytes"] > 0 and r["ptx_bytes"] > 0 and r["aligned"]
        assert 0 < r["shared_bytes"] <= triton_cubin.SM90_MAX_SHARED_BYTES, r
        assert 0 < r["registers"] <= 255 and r["spill_stores"] >= 0, r
    # jax-triton's alignment hints let the 2-byte prefill tiles load K/V with asynchronous copies
    assert any(r["async_copies"] for r in results if r["config"]["dtype"] == "bfloat16")


@needs_interpreter
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_triton_launched_through_torch_on_cpu_matches_naive(dtype):
    """The launch path GPU scripts use when jax_triton is missing (torch tensors, triton's own
    launcher), checked here on "cpu", which is Triton's interpreter."""
    args = make_batch(Bucket(), SCENARIOS["mixed"], seed=12, dtype=dtype)
    out = pk.triton_attention.ragged_paged_attention_triton_torch(*args, sm_scale=0.25, device="cpu",
                                                                   block_q=8, block_kv=16)
    np.testing.assert_allclose(out.astype(np.float32), naive_attention(*args, sm_scale=0.25),
                               rtol=TOL[dtype], atol=TOL[dtype])


@needs_interpreter
def test_triton_launched_through_torch_reads_fp8_pools():
    """fp8 pools through the torch launch path (ml_dtypes' e4m3 has no torch twin: it goes by its
    bits; an H200 run failed there before), against the oracle on the same fp8 values."""
    q, kc, vc, *rest = make_batch(Bucket(), SCENARIOS["mixed"], seed=13, dtype=jnp.float16)
    args = (q, kc.astype(jnp.float8_e4m3fn), vc.astype(jnp.float8_e4m3fn), *rest)
    out = pk.triton_attention.ragged_paged_attention_triton_torch(*args, sm_scale=0.25, device="cpu",
                                                                   block_q=8, block_kv=16)
    np.testing.assert_allclose(out.astype(np.float32), naive_attention(*args, sm_scale=0.25), rtol=2e-2, atol=2e-2)
