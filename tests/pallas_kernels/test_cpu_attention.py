"""The ``cpu`` backend (C++ kernel through XLA's FFI) against the naive oracle.

The kernel takes different paths by shape, and each gets its own cases here: head_dim 16 /
block_size 8 takes the portable loops; head_dim 32, 64 or 128 scores pages of 16 or 32 positions
by AVX-512 tree reductions and sums P.V over several rows at once (8, 2 or 1 per pass by
head_dim); head_dim 48 takes the portable loops with a runtime head_dim.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import cpu_attention

from .batches import SCENARIOS, Bucket, make_batch, naive_attention, poison

SCALE = 0.25

if shutil.which(os.environ.get("CXX", "g++")) is None:
    pytest.skip("no C++ compiler to build the cpu kernel with", allow_module_level=True)

SHAPES = {  # (head_dim, block_size)
    "portable": (16, 8),
    "avx512-d32": (32, 16),
    "avx512-d64-bs32": (64, 32),
    "runtime-d48": (48, 16),
    "d128": (128, 16),
}


@functools.cache
def cpu_fn(**options):
    return jax.jit(functools.partial(pk.ragged_paged_attention_cpu, **options))


def bucket(shape: str, heads=(4, 2), **kw) -> Bucket:
    d, bs = SHAPES[shape]
    return Bucket(num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=d, block_size=bs,
                  max_blocks=64 // bs, **kw)


def check(args, rtol=2e-5, atol=2e-5, **options):
    out = np.asarray(cpu_fn(sm_scale=SCALE, **options)(*args).astype(jnp.float32))
    ref = naive_attention(*args, sm_scale=SCALE, **options)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol)
    return out


def test_kernel_builds_and_registers():
    ok, reason = pk.cpu_attention_available()
    assert ok, reason


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (4, 4)])
def test_cpu_backend_matches_naive(shape, scenario, heads):
    check(make_batch(bucket(shape, heads), SCENARIOS[scenario], seed=3))


@pytest.mark.parametrize("shape", ["portable", "avx512-d32"])
@pytest.mark.parametrize("window,cap", [(5, None), (None, 1.5), (12, 0.7), (1, None)])
def test_cpu_backend_window_and_softcap(shape, window, cap):
    for scenario in ("mixed", "prefix", "decode"):
        check(make_batch(bucket(shape), SCENARIOS[scenario], seed=4), sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("shape", ["portable", "avx512-d32", "avx512-d64-bs32"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_cpu_backend_never_reads_outside_contexts(shape, scenario):
    """NaN in every slot outside the contexts (the AVX-512 path scores whole pages, stale tails
    included, and must mask them) and in the padding queries; padding tokens give exactly 0."""
    args = poison(make_batch(bucket(shape), SCENARIOS[scenario], seed=5))
    out = check(args)
    assert np.isfinite(out).all()
    n_valid = int(np.asarray(args[5])[int(np.asarray(args[6])[0])])
    assert (out[n_valid:] == 0).all()


@pytest.mark.parametrize("shape", ["portable", "avx512-d32"])
def test_cpu_backend_random_batches(shape):
    """Twenty random ragged batches through one compiled call: prompts, chunks over a prefix,
    decodes, in any order, with padding rows and tokens."""
    b = bucket(shape, (8, 2), num_tokens=64, num_reqs=8, num_blocks=80)
    rng = np.random.default_rng(0)
    for i in range(20):
        n = int(rng.integers(1, b.num_reqs + 1))
        budget, reqs = b.num_tokens, []
        for _ in range(n):
            q_len = int(rng.integers(1, max(2, min(budget, 20)) + 1)) if budget > 0 else 0
            if q_len == 0 or q_len > budget:
                break
            budget -= q_len
            reqs.append((q_len, int(rng.integers(q_len, 65))))
        check(make_batch(b, reqs, seed=100 + i))


def test_cpu_backend_bfloat16():
    args = make_batch(bucket("avx512-d32"), SCENARIOS["mixed"], dtype=jnp.bfloat16, seed=6)
    out = cpu_fn(sm_scale=SCALE)(*args)
    assert out.dtype == jnp.bfloat16
    ref = naive_attention(*args, sm_scale=SCALE)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, rtol=2e-2, atol=2e-2)


def test_cpu_backend_scalar_num_seqs():
    check(make_batch(bucket("avx512-d32"), SCENARIOS["mixed"], seed=7, num_seqs_scalar=True))


def test_cpu_backend_rejects_other_dtypes():
    args = make_batch(bucket("portable"), SCENARIOS["decode"], dtype=jnp.float16)
    with pytest.raises(ValueError, match="float16"):
        pk.ragged_paged_attention_cpu(*args, sm_scale=SCALE)


def test_build_is_reused_and_a_missing_compiler_is_named(monkeypatch):
    first = cpu_attention.build_library()
    stamp = first.stat().st_mtime_ns
    assert cpu_attention.build_library() == first and first.stat().st_mtime_ns == stamp
    monkeypatch.setenv("CXX", "no-such-compiler-jaxserve")
    with pytest.raises(RuntimeError, match="no-such-compiler-jaxserve"):
        cpu_attention.build_library()


def test_a_build_in_flight_is_waited_for_not_repeated(tmp_path, monkeypatch):
    """The engine's early background build and the runner's registration may overlap: the
    compiler runs once, and both get the same library."""
    runs = []
    real_run = subprocess.run

    def counting_run(cmd, *args, **kwargs):
        runs.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counting_run)
    early = threading.Thread(target=cpu_attention.prebuild, args=(tmp_path,))
    early.start()
    while not runs and early.is_alive():  # the early build has its compiler running
        time.sleep(0.01)
    assert cpu_attention._build_once(tmp_path).is_file()
    early.join()
    assert len(runs) == 1 and len(list(tmp_path.glob("*.so"))) == 1


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("window", [None, 7])
def test_cpu_backend_rows_do_not_depend_on_their_tile(shape, window):
    """A query's output is bit-identical whether it is computed inside a prefill chunk (a tile of
    several queries) or alone as a decode row over the same context: seeded sampling must not
    change with how the scheduler cut the batch."""
    d, bs = SHAPES[shape]
    b = Bucket(num_tokens=32, num_reqs=16, num_q_heads=8, num_kv_heads=2, head_dim=d, block_size=bs,
               max_blocks=64 // bs, num_blocks=64 // bs + 4)
    chunk, ctx = 13, 40  # queries at positions 27..39, past a 27-token prefix
    q, kc, vc, kv_lens, tables, qsl, _ = make_batch(b, [(chunk, ctx)], seed=9)
    options = dict(sliding_window=window)
    together = np.asarray(cpu_fn(sm_scale=SCALE, **options)(q, kc, vc, kv_lens, tables, qsl, jnp.array([1], jnp.int32)))
    alone_lens = np.zeros(b.num_reqs, np.int32)
    alone_lens[:chunk] = np.arange(ctx - chunk + 1, ctx + 1)
    alone_tables = np.repeat(np.asarray(tables)[:1], b.num_reqs, axis=0)
    alone_qsl = np.minimum(np.arange(b.num_reqs + 1), chunk).astype(np.int32)
    alone = np.asarray(cpu_fn(sm_scale=SCALE, **options)(
        q, kc, vc, jnp.asarray(alone_lens), jnp.asarray(alone_tables), jnp.asarray(alone_qsl),
        jnp.array([chunk], jnp.int32)))
    np.testing.assert_array_equal(alone[:chunk], together[:chunk])
    check((q, kc, vc, kv_lens, tables, qsl, jnp.array([1], jnp.int32)), **options)
