"""Float8 (e4m3fn) K/V pools (--kv-cache-dtype fp8): every built-in backend reads them (the GPU
kernels load the pages as stored and cast them in the kernel) and agrees with the oracle on the
same fp8 values."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

from .batches import SCENARIOS, Bucket, make_batch, naive_attention, poison

SCALE = 0.25


def fp8_batch(head_dim: int, block_size: int, scenario: str, q_dtype=jnp.float32):
    b = Bucket(num_q_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=block_size, max_blocks=64 // block_size)
    q, kc, vc, *rest = make_batch(b, SCENARIOS[scenario])
    return (q.astype(q_dtype), kc.astype(jnp.float8_e4m3fn), vc.astype(jnp.float8_e4m3fn), *rest)


@pytest.mark.parametrize("scenario", ["mixed"])  # decode rows, prefill chunks and prefix hits
@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_fp8_pools_match_oracle(backend, scenario):
    if backend == "cpu" and shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler to build the cpu kernel with")
    fn = pk.ragged_paged_attention_reference if backend == "xla" else pk.ragged_paged_attention_cpu
    # The cpu kernel: its AVX-512 head_dim and its portable loops; the reference has one path.
    for d, bs in ((64, 16), (16, 8)) if backend == "cpu" else ((16, 8),):
        args = fp8_batch(d, bs, scenario)
        out = np.asarray(fn(*args, sm_scale=SCALE).astype(jnp.float32))
        ref = naive_attention(*args, sm_scale=SCALE)  # the oracle reads the same fp8 values
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_cpu_kernel_fp8_pools_with_bf16_queries():
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler to build the cpu kernel with")
    args = fp8_batch(64, 16, "mixed", q_dtype=jnp.bfloat16)
    out = np.asarray(pk.ragged_paged_attention_cpu(*args, sm_scale=SCALE).astype(jnp.float32))
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=SCALE), rtol=2e-2, atol=2e-2)


def _interpreted(backend: str):
    if backend == "triton":
        ok, why = pk.triton_ready(True)
        if not ok:
            pytest.skip(why)
    if backend == "cpu" and shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler to build the cpu kernel with")
    return pk.get_attention_fn(backend, interpret=True)


@pytest.mark.parametrize("backend", pk.BUILTIN_BACKENDS)
def test_every_backend_reads_fp8_pools(backend):
    """bf16 queries over fp8 pools poisoned with NaN outside the live contexts (free blocks, the
    null block, last pages' tails): each backend matches the oracle on the same fp8 values."""
    fn = _interpreted(backend)
    d = 64  # the mosaic kernel's smallest head; the others take any
    b = Bucket(num_q_heads=4, num_kv_heads=2, head_dim=d, block_size=16, max_blocks=4, num_blocks=24)
    q, kc, vc, *rest = make_batch(b, SCENARIOS["mixed"], dtype=jnp.bfloat16, seed=5)
    args = poison((q, kc.astype(jnp.float8_e4m3fn), vc.astype(jnp.float8_e4m3fn), *rest))
    assert args[1].dtype == jnp.float8_e4m3fn and bool(jnp.isnan(args[1].astype(jnp.float32)).any())
    out = jax.jit(lambda *a: fn(*a, sm_scale=SCALE))(*args)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=SCALE), rtol=2e-2, atol=2e-2)
