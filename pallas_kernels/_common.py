"""Helpers shared by the reference and the kernels (jax/numpy only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .int8_kv import stored_head_dim

INT32_MAX = 2**31 - 1


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_pow2(n: int) -> bool:
    n = int(n)
    return n > 0 and (n & (n - 1)) == 0


def cdiv(a, b):
    return (a + b - 1) // b


def scalar_num_seqs(num_seqs) -> jax.Array:
    """``num_seqs`` may be a Python int, an int32 scalar or an int32 ``[1]`` array."""
    return jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0]


def check_shapes(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc):
    """Static shape checks of the contract; returns (T, Hq, D, NB, BS, Hkv, R, MB). An int8 pool's
    rows are ``D`` values and their scale (:mod:`.int8_kv`)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got {q.shape}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must be equal [num_blocks, block_size, Hkv, D], got {k_cache.shape} "
            f"and {v_cache.shape}")
    t, hq, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    if dk != stored_head_dim(d, k_cache.dtype):
        raise ValueError(f"head_dim mismatch: q {d} vs cache {dk} ({jnp.dtype(k_cache.dtype).name})")
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [R, max_blocks], got {block_tables.shape}")
    r, mb = block_tables.shape
    if kv_lens.shape != (r,):
        raise ValueError(f"kv_lens must be [R]={r}, got {kv_lens.shape}")
    if query_start_loc.shape != (r + 1,):
        raise ValueError(f"query_start_loc must be [R+1]={r + 1}, got {query_start_loc.shape}")
    return t, hq, d, nb, bs, hkv, r, mb


def check_options(sliding_window, soft_cap):
    if sliding_window is not None and int(sliding_window) <= 0:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if soft_cap is not None and float(soft_cap) <= 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")


def finish_softmax(m, l, acc, sinks=None):
    """The online softmax's output ``acc / l`` (0 where nothing was seen). ``sinks`` (broadcast to
    ``m``'s shape): a per-head logit that joins the denominator only (gpt-oss's attention sinks),
    so a row can give less than all of its weight to the context."""
    if sinks is None:
        return jnp.where((l > 0)[..., None], acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    top = jnp.maximum(m, sinks)  # finite: m is -inf only where nothing was seen
    scale = jnp.exp(m - top)
    return acc * (scale / (l * scale + jnp.exp(sinks - top)))[..., None]


def check_sinks(sinks, hq: int):
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must be [Hq]={hq}, got {tuple(sinks.shape)}")


def valid_token_mask(query_start_loc, num_seqs, t: int) -> jax.Array:
    """bool [T]: token is owned by a real request (before ``query_start_loc[num_seqs]``)."""
    end = query_start_loc[scalar_num_seqs(num_seqs)]
    return jnp.arange(t, dtype=jnp.int32) < end
