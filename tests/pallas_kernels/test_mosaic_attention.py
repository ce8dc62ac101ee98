"""The Mosaic GPU kernel, run in Mosaic GPU's interpret mode on the CPU (TMA, barriers, wgmma
simulated), against the oracle on the ragged batches the other kernels face."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxserve.bench.presets import preset_config
from jaxserve.exceptions import ConfigError
from jaxserve.models.config import ModelConfig
from jaxserve.runner import model_runner
from pallas_kernels import mosaic_attention as ma

from .batches import SCENARIOS, Bucket, call, make_batch, naive_attention, poison

SCALE = 0.25
BF16_TOL = dict(rtol=2e-2, atol=2e-2)

# (query heads, kv heads, head_dim, block_size, tiles, scenario): GQA groups 1/2/3/4/8, head sizes
# 64/128, several pages per step and pages crossing steps, split-K with empty splits, a full bucket.
CFG = functools.partial(pk.MosaicConfig, min_split_steps=1)  # splits even on the tests' short contexts
CASES = {
    "g1-d64-mixed": (2, 2, 64, 8, CFG(block_kv=16, num_stages=2, num_splits=1), "mixed"),
    "g4-d128-prefix": (8, 2, 128, 8, CFG(block_kv=32, num_stages=3, num_splits=1), "prefix"),
    "g3-d64-full": (6, 2, 64, 16, None, "full"),
    "g2-d64-decode-split3": (4, 2, 64, 8, CFG(block_kv=16, num_stages=3, num_splits=3), "decode"),
    "g8-d64-prefill-split2": (16, 2, 64, 8, CFG(block_kv=64, num_stages=2, num_splits=2), "prefill"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_oracle_and_never_reads_outside_the_context(name):
    """NaN in padding tokens, free blocks, the null block and the tails of last pages: the kernel
    masks scores and zeroes stale V rows, so none of it reaches the result."""
    hq, hkv, d, bs, config, scenario = CASES[name]
    bucket = Bucket(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, max_blocks=64 // bs,
                    num_blocks=48 if bs == 8 else 24)
    args = poison(make_batch(bucket, SCENARIOS[scenario], dtype=jnp.bfloat16, seed=len(name)))
    fn = pk.get_attention_fn("mosaic", interpret=True, config=config)
    out = jax.jit(lambda *a: fn(*a, sm_scale=SCALE))(*args)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=SCALE), **BF16_TOL)
    clean = tuple(jnp.where(jnp.isnan(a), 0, a) if a.dtype == jnp.bfloat16 else a for a in args)
    np.testing.assert_allclose(out, call("xla", clean, sm_scale=SCALE), **BF16_TOL)
    n_valid = int(np.asarray(args[5])[int(np.asarray(args[6])[0])])
    assert (out[n_valid:] == 0).all()


def test_self_check_passes_interpreted():
    """The start-up check ``auto`` runs on a GPU (the registry's ragged cases, bf16, two splits)."""
    assert pk.mosaic_self_check(interpret=True) == (True, "")


def test_self_check_refuses_a_kernel_whose_fp8_path_is_wrong(monkeypatch):
    """A kernel right on bf16 pools but misreading fp8 ones (its bytes taken as int8) passes the
    bf16 check and fails the fp8 one, naming the pool; the stand-in is the xla backend."""
    xla = pk.get_attention_fn("xla")

    def misreads_fp8(q, k, v, *rest, interpret=False, config=None, **options):
        if k.dtype == jnp.float8_e4m3fn:
            k, v = (jax.lax.bitcast_convert_type(x, jnp.int8).astype(q.dtype) for x in (k, v))
        return xla(q, k, v, *rest, **options)

    monkeypatch.setattr(ma, "ragged_paged_attention_mosaic", misreads_fp8)
    assert ma.mosaic_self_check() == (True, "")
    ok, reason = ma.mosaic_self_check(kv_dtype=jnp.float8_e4m3fn)
    assert not ok and "float8_e4m3fn pool" in reason


def test_the_layers_calls_share_one_lowered_kernel():
    """The engine calls the backend once per layer with equal shapes: one lowered function, called
    per layer (lowering Mosaic GPU's kernel is seconds of Python; XLA inlines the calls). Lowered
    for CUDA, as on a GPU: interpret mode is not wrapped (its callbacks under a nested jit hung a
    full CPU run)."""
    import re

    args = make_batch(Bucket(num_q_heads=2, num_kv_heads=1, head_dim=64), SCENARIOS["mixed"], dtype=jnp.bfloat16)
    fn = pk.get_attention_fn("mosaic", interpret=False)
    step = jax.jit(lambda *a: [fn(*a, sm_scale=SCALE) for _ in range(3)])
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"func\.func private @ragged_paged_attention_mosaic\b", text)) == 1
    assert len(re.findall(r"call @ragged_paged_attention_mosaic\(", text)) == 3


def test_tile_plan_places_every_token_once():
    """Every valid token is one row of one tile, at its position; the static tile count suffices."""
    rng = np.random.default_rng(0)
    r, t = 8, 64
    for bq in (1, 16, 64):
        w = ma.num_query_tiles(t, r, bq)
        plan = jax.jit(functools.partial(ma.tile_plan, r=r, w=w, block_q=bq))
        for _ in range(8):
            n = int(rng.integers(1, r + 1))
            q_lens = rng.multinomial(int(rng.integers(n, t + 1)) - n, np.ones(n) / n) + 1  # ragged, >= 1
            qsl = np.zeros(r + 1, np.int32)
            qsl[1:n + 1] = np.cumsum(q_lens)
            qsl[n + 1:] = qsl[n]
            kv = np.zeros(r, np.int32)
            kv[:n] = q_lens + rng.integers(0, 30, n)
            meta, first, _ = (np.asarray(x) for x in plan(qsl, kv, np.array([n], np.int32)))
            seen = np.zeros(t, int)
            for (req, pos0, ntok), tok0 in zip(meta, first):
                for j in range(ntok):
                    seen[tok0 + j] += 1
                    assert pos0 + j == kv[req] - q_lens[req] + (tok0 + j - qsl[req])
            np.testing.assert_array_equal(seen, (np.arange(t) < qsl[n]).astype(int))


def test_default_tiles_fit_an_sm_and_split_a_lone_long_decode():
    for d in (64, 128, 256):
        for t, r in ((1, 1), (256, 256), (2048, 256)):
            cfg = pk.default_mosaic_config(t, r, 32, 8, d, 16, 40960)
            assert ma.smem_bytes(d, cfg) <= ma.SMEM_BYTES_H200
    # a decode bucket may hold one long sequence: 8 CTAs without splitting, 132 SMs to fill
    assert pk.default_mosaic_config(16, 16, 32, 8, 128, 16, 40960).num_splits == ma.MAX_SPLITS
    assert pk.default_mosaic_config(2048, 256, 32, 8, 128, 16, 40960).num_splits == 1


def test_split_runs_cover_each_context_once():
    """Every KV step of a tile is in exactly one split's run; every run but a context's last has
    min_split_steps or more steps; the splits past the context are empty."""
    kv_end = np.arange(0, 700, 7)
    for splits, least in ((1, 8), (3, 1), (16, 8), (16, 1)):
        _, lo, hi = (np.asarray(x) for x in ma.split_run(0, kv_end[None], np.arange(splits)[:, None], 64, splits,
                                                          least))
        for j, end in enumerate(kv_end):
            runs = [(a, b) for a, b in zip(lo[:, j], hi[:, j]) if a < b]
            assert [i for a, b in runs for i in range(a, b)] == list(range(-(-int(end) // 64)))
            assert all(b - a >= least for a, b in runs[:-1])


# (pool dtype, window, tiles, scenario): fp8 pools through the staging tiles, windows shorter than
# one step, spanning steps and over a split context; every pool NaN outside the live context.
WINDOW_FP8_CASES = {
    "fp8-nowindow-mixed": (jnp.float8_e4m3fn, None, CFG(block_kv=16, num_stages=2, num_splits=1), "mixed"),
    "bf16-window20-split2": (jnp.bfloat16, 20, CFG(block_kv=16, num_stages=2, num_splits=2), "mixed"),
    "fp8-window12-decode-split3": (jnp.float8_e4m3fn, 12, CFG(block_kv=16, num_stages=3, num_splits=3), "decode"),
    "fp8-window5-prefix": (jnp.float8_e4m3fn, 5, CFG(block_kv=16, num_stages=2, num_splits=1), "prefix"),
}


@pytest.mark.parametrize("name", sorted(WINDOW_FP8_CASES))
def test_fp8_pools_and_sliding_windows_match_the_oracle(name):
    kv_dtype, window, config, scenario = WINDOW_FP8_CASES[name]
    bucket = Bucket(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8, max_blocks=8, num_blocks=48)
    q, kc, vc, *rest = make_batch(bucket, SCENARIOS[scenario], dtype=jnp.bfloat16, seed=len(name))
    args = poison((q, kc.astype(kv_dtype), vc.astype(kv_dtype), *rest))
    fn = pk.get_attention_fn("mosaic", interpret=True, config=config)
    out = jax.jit(lambda *a: fn(*a, sm_scale=SCALE, sliding_window=window))(*args)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=SCALE, sliding_window=window), **BF16_TOL)


def test_window_runs_skip_the_pages_before_the_window():
    """Split runs over a window start at the step of the window's start and cover the rest once."""
    pos0 = np.arange(0, 700, 7)
    for window, splits, least in ((64, 1, 8), (100, 3, 1), (300, 16, 1)):
        _, lo, hi = (np.asarray(x) for x in ma.split_run(pos0[None], 1, np.arange(splits)[:, None], 64, splits,
                                                          least, window))
        for j, p in enumerate(pos0):
            steps = [i for a, b in zip(lo[:, j], hi[:, j]) if a < b for i in range(a, b)]
            assert steps == list(range(max(int(p) - window + 1, 0) // 64, int(p) // 64 + 1))


def test_fp8_staging_fits_the_smem_budget():
    """fp8 ring + bf16 staging tiles take less shared memory than the bf16 ring at head_dim 128."""
    cfg = pk.default_mosaic_config(16, 16, 32, 8, 128, 16, 40960, kv_itemsize=1)
    assert ma.smem_bytes(128, cfg, kv_itemsize=1) < ma.smem_bytes(128, cfg) <= ma.SMEM_BYTES_H200


def test_refuses_what_it_does_not_do():
    args = make_batch(Bucket(head_dim=64), SCENARIOS["mixed"], dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="soft cap"):
        pk.ragged_paged_attention_mosaic(*args, sm_scale=SCALE, interpret=True, soft_cap=2.0)
    f16_pool = (args[0], args[1].astype(jnp.float16), args[2].astype(jnp.float16), *args[3:])
    with pytest.raises(ValueError, match="float8_e4m3fn, got float16"):
        pk.ragged_paged_attention_mosaic(*f16_pool, sm_scale=SCALE, interpret=True)
    f32 = make_batch(Bucket(head_dim=64), SCENARIOS["mixed"], dtype=jnp.float32)
    with pytest.raises(ValueError, match="bf16 or f16"):
        pk.ragged_paged_attention_mosaic(*f32, sm_scale=SCALE, interpret=True)
    small = make_batch(Bucket(head_dim=16), SCENARIOS["mixed"], dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        pk.ragged_paged_attention_mosaic(*small, sm_scale=SCALE, interpret=True)


QWEN3 = ModelConfig.from_dict(preset_config("qwen3-0.6b"))  # bf16, head_dim 128, no window


def _model(**changes):
    return dataclasses.replace(QWEN3, **changes)


def test_backend_choice():
    resolve = model_runner.resolve_attention_backend
    # auto is pallas on every GPU (mosaic measured slower on an H200: opt-in), the CPU kernel here.
    assert resolve("auto", "gpu", mc=QWEN3, abstract=True) == "pallas"
    assert resolve("auto", "gpu", mc=QWEN3) == "pallas"
    assert resolve("mosaic", "gpu", mc=QWEN3, abstract=True) == "mosaic"  # compile-only: no self-check
    assert resolve("mosaic", "cpu", mc=QWEN3) == "mosaic"  # interpreted: tests only
    assert resolve("mosaic", "gpu", mc=_model(sliding_window=4096), abstract=True) == "mosaic"
    # Asked for on a GPU that can run it, mosaic must pass its self-check over the pool's dtype.
    checked = []

    def check(kv_dtype=None, result=(True, "")):
        checked.append(kv_dtype)
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pk, "mosaic_self_check", check)
        assert resolve("mosaic", "gpu", mc=QWEN3, kv_cache_dtype="fp8") == "mosaic"
        assert checked == [jnp.float8_e4m3fn]
        mp.setattr(pk, "mosaic_self_check", lambda kv_dtype=None: (False, "wgmma needs sm_90a"))
        with pytest.raises(ConfigError, match="mosaic cannot serve this model: wgmma needs sm_90a"):
            resolve("mosaic", "gpu", mc=QWEN3)
    with pytest.raises(ConfigError, match="mosaic cannot serve this model: .*head_dim"):
        resolve("mosaic", "gpu", mc=_model(head_dim=80))
    with pytest.raises(ConfigError, match="mosaic cannot serve this model: .*float32"):
        resolve("mosaic", "gpu", mc=_model(dtype="float32"), abstract=True)


# The engine's windowed-Mistral steps (window 24, pages of 16, steps of 64 positions): decodes at
# contexts 41-45, whose first step holds a page wholly before the window, and the second chunk of
# a 40-token prompt.
ENGINE_WINDOW_STEP = [(1, 45), (16, 40), (1, 41), (3, 30), (1, 9)]


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_window_ignores_the_pages_the_scheduler_released(kv_dtype):
    """Pages wholly before a request's window are freed by the scheduler while the runner's block
    table still names them: another request may have written anything there, NaN included. The
    first step of a window loads such a page beside live ones; its V rows must not reach ``p V``
    (0 * NaN), or one request's overflow poisons another's output."""
    bucket = Bucket(num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16, max_blocks=4, num_blocks=24)
    q, kc, vc, *rest = make_batch(bucket, ENGINE_WINDOW_STEP, dtype=jnp.bfloat16, seed=7)
    args = poison((q, kc.astype(kv_dtype), vc.astype(kv_dtype), *rest), sliding_window=24)
    fn = pk.get_attention_fn("mosaic", interpret=True, config=pk.MosaicConfig(block_kv=64, num_stages=2))
    out = np.asarray(jax.jit(lambda *a: fn(*a, sm_scale=SCALE, sliding_window=24))(*args).astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, naive_attention(*args, sm_scale=SCALE, sliding_window=24), **BF16_TOL)
