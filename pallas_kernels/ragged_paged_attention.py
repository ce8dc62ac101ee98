"""Ragged paged attention as Pallas kernels with the Triton lowering (GPU), or interpret mode (CPU).

Two kernels share one inner loop (online softmax over the request's pages):

``mixed`` (any batch: prefill chunks, decode tokens, prefix hits, all in one launch)
    Grid ``(num_q_tiles, num_kv_heads)``. A *query tile* is ``block_q`` consecutive tokens of ONE
    request times the ``G`` query heads of one KV head (GQA group, padded to a power of two
    ``G_pad``): ``M = block_q * G_pad`` rows that share every K/V page load. Request ``r`` owns
    ``ceil(q_len_r / block_q)`` tiles; ``tile_end = cumsum(tiles)`` is computed in jnp (R ints) and
    each program finds its request by counting ``tile_end <= program_id`` (one vector load of
    ``next_pow2(R)`` ints). The grid size is static and host-independent:
    ``num_q_tiles = (T + min(R, T) * (block_q - 1)) // block_q`` bounds ``sum_r ceil(q_len_r /
    block_q)`` for any ragged split of ``T`` tokens into at most ``min(R, T)`` non-empty requests,
    so at most ``min(R, T)`` programs per head exit early. Each tile walks only the KV tiles its
    rows can see (causal upper bound, sliding-window lower bound).

``decode`` (every request has ``q_len <= 1``)
    Grid ``(R, num_kv_heads, num_kv_splits)``; ``M = max(16, G_pad)`` rows (the group's heads of the
    request's one token). With ``num_kv_splits > 1`` the context is split (split-K, flash-decoding):
    every split writes an unnormalised partial (acc, max, sum) and a small jnp step combines them
    and scatters the rows to their tokens.

Memory access: ``q`` is viewed as ``[T * Hq, D]`` and the caches as ``[num_blocks * block_size,
Hkv, D]`` (free reshapes); a KV tile of ``block_kv`` positions is gathered row by row through the
block table (``block_kv`` and ``block_size`` are independent powers of two). Out-of-range rows are
clamped for loads, and written to ``M`` scratch rows appended to the output (sliced off afterwards),
so no load or store is ever out of bounds or masked; padding tokens are zeroed by a final
``where``. Scores, softmax statistics and accumulators are float32; ``p`` is cast to the cache
dtype for the ``p @ V`` product (bf16/f16 tensor cores); float32 inputs use IEEE (not TF32) dots.
Softmax runs in base 2 (``exp2``) with ``log2(e)`` folded into the scale.

Triton constraints (GPU): ``head_dim``, ``block_size``, ``block_q``, ``block_kv`` are powers of two;
on the GPU keep ``M >= 16``, ``block_kv >= 16``, ``head_dim >= 16`` (tensor-core dot minimum);
interpret mode has no such limits. ``sm_scale``/``sliding_window``/``soft_cap`` are static Python
numbers (each distinct value compiles a kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import INT32_MAX, cdiv, check_options, check_shapes, is_pow2, next_pow2, scalar_num_seqs, valid_token_mask

LOG2E = 1.4426950408889634
NUM_SMS_H200 = 132
MODES = ("mixed", "decode", "auto")


# --------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class MixedConfig:
    block_q: int  # query tokens per tile (tile rows M = block_q * next_pow2(G))
    block_kv: int  # KV positions per inner-loop step
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    block_kv: int
    num_kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2


def default_mixed_config(num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
                         head_dim: int, dtype) -> MixedConfig:
    """Static heuristic from the bucket shape (T, R): small tiles for decode-like buckets."""
    g_pad = next_pow2(num_q_heads // num_kv_heads)
    avg = num_tokens / max(1, min(num_seqs, num_tokens))
    target_rows = 16 if avg <= 4 else (32 if avg <= 32 else 64)
    block_q = max(1, target_rows // g_pad)
    itemsize = jnp.dtype(dtype).itemsize
    block_kv = 64 if (itemsize <= 2 and head_dim <= 128) else 32
    return MixedConfig(block_q=block_q, block_kv=block_kv, num_warps=4, num_stages=2)


def default_decode_config(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                          max_context: int, dtype) -> DecodeConfig:
    """Split the context only when ``R * Hkv`` programs cannot fill the GPU twice over."""
    itemsize = jnp.dtype(dtype).itemsize
    block_kv = 64 if (itemsize <= 2 and head_dim <= 128) else 32
    programs = max(1, num_seqs * num_kv_heads)
    splits = 1
    if programs < 2 * NUM_SMS_H200:
        splits = next_pow2(cdiv(2 * NUM_SMS_H200, programs))
        splits = max(1, min(splits, 16, max_context // (4 * block_kv)))
        splits = 1 << (splits.bit_length() - 1)  # power of two, rounded down
    del num_q_heads  # the decode tile is max(16, G_pad) rows whatever the tuning
    return DecodeConfig(block_kv=block_kv, num_kv_splits=splits, num_warps=4, num_stages=2)


# --------------------------------------------------------------------------------------------
# shared pieces


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static a kernel body needs."""
    t: int
    hq: int
    hkv: int
    g: int
    d: int
    nb: int
    bs: int
    mb: int
    r: int
    rows: int  # M
    block_q: int
    block_kv: int
    splits: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    dtype: str


def _dot_precision(dtype):
    # float32 inputs: full-precision dot (Triton IEEE), otherwise the fast default (bf16/f16 MMA).
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _attend(q, q_pos, r, h, kv_len, lo_t, hi_t, bt_ref, k_ref, v_ref, c: _Static):
    """Online softmax of q [M, D] over KV tiles [lo_t, hi_t) of request r, kv head h.

    ``q_pos`` int32 [M] is each row's position in the context (-1 masks the row out).
    Returns (m, l, acc) in base-2 units, float32: running max [M], sum [M], accumulator [M, D].
    """
    bkv, bs = c.block_kv, c.bs
    prec = _dot_precision(c.dtype)
    neg_inf = jnp.float32(-jnp.inf)
    # scores are turned into base-2 logits: s2 = log2(e) * (capped) score
    if c.soft_cap is None:
        scale = jnp.float32(c.sm_scale * LOG2E)
    else:
        scale = jnp.float32(c.sm_scale)
    last = jnp.maximum(kv_len - 1, 0)

    def body(j, carry):
        m, l, acc = carry
        kv_pos = j * bkv + lax.iota(jnp.int32, bkv)
        pos_c = jnp.minimum(kv_pos, last)
        page = jnp.minimum(lax.div(pos_c, jnp.int32(bs)), c.mb - 1)
        blk = jnp.clip(bt_ref[r, page], 0, c.nb - 1)
        slot = blk * bs + lax.rem(pos_c, jnp.int32(bs))
        # an fp8 pool is loaded as stored (half the bytes) and cast to the query dtype here
        k = k_ref[slot, h, :].astype(c.dtype)  # [bkv, D]
        v = v_ref[slot, h, :].astype(c.dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32) * scale
        if c.soft_cap is not None:
            cap = jnp.float32(c.soft_cap)
            s = (cap * LOG2E) * jnp.tanh(s / cap)
        mask = kv_pos[None, :] <= q_pos[:, None]
        if c.sliding_window is not None:
            mask = mask & (kv_pos[None, :] > q_pos[:, None] - c.sliding_window)
        s = jnp.where(mask, s, neg_inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == neg_inf, jnp.float32(0), m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32)
        acc = acc * alpha[:, None] + pv
        return m_new, l, acc

    rows = q.shape[0]
    init = (jnp.full((rows,), neg_inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, c.d), jnp.float32))
    return lax.fori_loop(lo_t, hi_t, body, init)


def _normalize(l, acc):
    ok = l > 0
    return jnp.where(ok[:, None], acc / jnp.where(ok, l, jnp.float32(1))[:, None], jnp.float32(0))


def _kv_lower_bound(first_pos, c: _Static):
    if c.sliding_window is None:
        return jnp.int32(0)
    return jnp.maximum(first_pos - (c.sliding_window - 1), 0)


# --------------------------------------------------------------------------------------------
# mixed kernel


def _mixed_kernel(te_ref, qsl_ref, kvl_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, c: _Static):
    i = pl.program_id(0)
    h = pl.program_id(1)
    te = te_ref[...]  # [R_pad] cumulative tile ends, INT32_MAX padded
    r = jnp.sum((te <= i).astype(jnp.int32))

    @pl.when(r < c.r)
    def _():
        q_start = qsl_ref[r]
        q_len = qsl_ref[r + 1] - q_start
        kv_len = kvl_ref[r]
        n_tiles = lax.div(q_len + (c.block_q - 1), jnp.int32(c.block_q))
        tile = i - (te_ref[r] - n_tiles)
        g_pad = c.rows // c.block_q
        row = lax.iota(jnp.int32, c.rows)
        tq = lax.div(row, jnp.int32(g_pad))
        gi = lax.rem(row, jnp.int32(g_pad))
        off = tile * c.block_q + tq
        valid = (off < q_len) & (gi < c.g)
        dst = (q_start + off) * c.hq + h * c.g + gi
        q = q_ref[jnp.where(valid, dst, 0), :]
        ctx0 = kv_len - q_len
        q_pos = jnp.where(valid, ctx0 + off, -1)
        first = ctx0 + tile * c.block_q
        last = ctx0 + jnp.minimum(q_len, tile * c.block_q + c.block_q) - 1
        lo_t = lax.div(_kv_lower_bound(first, c), jnp.int32(c.block_kv))
        hi_t = lax.div(last + c.block_kv, jnp.int32(c.block_kv))
        _, l, acc = _attend(q, q_pos, r, h, kv_len, lo_t, hi_t, bt_ref, k_ref, v_ref, c)
        out = _normalize(l, acc).astype(o_ref.dtype)
        o_ref[jnp.where(valid, dst, c.t * c.hq + row), :] = out


def _tile_ends(query_start_loc, num_seqs, r: int, block_q: int):
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    active = jnp.arange(r, dtype=jnp.int32) < scalar_num_seqs(num_seqs)
    tiles = jnp.where(active, cdiv(jnp.maximum(q_lens, 0), block_q), 0)
    te = jnp.cumsum(tiles).astype(jnp.int32)
    r_pad = next_pow2(r)
    return jnp.concatenate([te, jnp.full((r_pad - r,), INT32_MAX, jnp.int32)])


def num_q_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static grid size of the mixed kernel's query axis (see module docstring)."""
    n = min(num_seqs, num_tokens)
    return max(1, (num_tokens + n * (block_q - 1)) // block_q)


def _static(q, k_cache, block_tables, *, rows, block_q, block_kv, splits, sm_scale, sliding_window,
            soft_cap):
    t, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    r, mb = block_tables.shape
    return _Static(t=t, hq=hq, hkv=hkv, g=hq // hkv, d=d, nb=nb, bs=bs, mb=mb, r=r, rows=rows,
                   block_q=block_q, block_kv=block_kv, splits=splits, sm_scale=float(sm_scale),
                   sliding_window=None if sliding_window is None else int(sliding_window),
                   soft_cap=None if soft_cap is None else float(soft_cap),
                   dtype=jnp.dtype(q.dtype).name)


def _check_pow2(**kw):
    for name, v in kw.items():
        if not is_pow2(v):
            raise ValueError(f"{name}={v} must be a power of two (Triton block shapes)")


def ragged_paged_attention_mixed(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                                 num_seqs, *, sm_scale, sliding_window=None, soft_cap=None,
                                 interpret=False, block_q=None, block_kv=None, num_warps=None,
                                 num_stages=None):
    """The mixed prefill/decode kernel (any batch). See module docstring."""
    check_options(sliding_window, soft_cap)
    t, hq, d, nb, bs, hkv, r, mb = check_shapes(q, k_cache, v_cache, kv_lens, block_tables,
                                                query_start_loc)
    dflt = default_mixed_config(t, r, hq, hkv, d, q.dtype)
    block_q = dflt.block_q if block_q is None else int(block_q)
    block_kv = dflt.block_kv if block_kv is None else int(block_kv)
    num_warps = dflt.num_warps if num_warps is None else int(num_warps)
    num_stages = dflt.num_stages if num_stages is None else int(num_stages)
    g_pad = next_pow2(hq // hkv)
    _check_pow2(head_dim=d, block_size=bs, block_q=block_q, block_kv=block_kv)
    rows = block_q * g_pad
    c = _static(q, k_cache, block_tables, rows=rows, block_q=block_q, block_kv=block_kv, splits=1,
                sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    kv_lens = kv_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    te = _tile_ends(query_start_loc, num_seqs, r, block_q)
    grid = (num_q_tiles(t, r, block_q), hkv)
    out = pl.pallas_call(
        functools.partial(_mixed_kernel, c=c),
        out_shape=jax.ShapeDtypeStruct((t * hq + rows, d), q.dtype),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_mixed",
    )(te, query_start_loc, kv_lens, block_tables, q.reshape(t * hq, d),
      k_cache.reshape(nb * bs, hkv, d), v_cache.reshape(nb * bs, hkv, d))
    out = out[: t * hq].reshape(t, hq, d)
    valid = valid_token_mask(query_start_loc, num_seqs, t)
    return jnp.where(valid[:, None, None], out, jnp.zeros((), q.dtype))


# --------------------------------------------------------------------------------------------
# decode kernel


def _decode_kernel(ns_ref, qsl_ref, kvl_ref, bt_ref, q_ref, k_ref, v_ref, *out_refs, c: _Static):
    r = pl.program_id(0)
    h = pl.program_id(1)
    s = pl.program_id(2)
    q_start = qsl_ref[r]
    q_len = qsl_ref[r + 1] - q_start
    kv_len = kvl_ref[r]
    active = (r < ns_ref[0]) & (q_len > 0) & (kv_len > 0)
    row = lax.iota(jnp.int32, c.rows)
    valid = (row < c.g) & active
    dst = q_start * c.hq + h * c.g + row
    q = q_ref[jnp.where(valid, dst, 0), :]
    q_pos = jnp.where(valid, kv_len - 1, -1)
    lo_t = lax.div(_kv_lower_bound(kv_len - 1, c), jnp.int32(c.block_kv))
    hi_t = lax.div(kv_len + (c.block_kv - 1), jnp.int32(c.block_kv))
    if c.splits == 1:
        a, b = lo_t, hi_t
    else:
        per = lax.div(hi_t - lo_t + (c.splits - 1), jnp.int32(c.splits))
        a = lo_t + s * per
        b = jnp.minimum(a + per, hi_t)
    a = jnp.where(active, a, 0)
    b = jnp.where(active, b, 0)
    m, l, acc = _attend(q, q_pos, r, h, kv_len, a, b, bt_ref, k_ref, v_ref, c)
    if c.splits == 1:
        (o_ref,) = out_refs
        out = _normalize(l, acc).astype(o_ref.dtype)
        o_ref[jnp.where(valid, dst, c.t * c.hq + row), :] = out
    else:
        acc_ref, m_ref, l_ref = out_refs
        base = ((r * c.hkv + h) * c.splits + s) * c.rows
        acc_ref[pl.ds(base, c.rows), :] = acc
        m_ref[pl.ds(base, c.rows)] = m
        l_ref[pl.ds(base, c.rows)] = l


def ragged_paged_attention_decode(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                                  num_seqs, *, sm_scale, sliding_window=None, soft_cap=None,
                                  interpret=False, block_kv=None, num_kv_splits=None,
                                  num_warps=None, num_stages=None):
    """Decode-only kernel: every request must have ``q_len <= 1`` (others give undefined rows)."""
    check_options(sliding_window, soft_cap)
    t, hq, d, nb, bs, hkv, r, mb = check_shapes(q, k_cache, v_cache, kv_lens, block_tables,
                                                query_start_loc)
    dflt = default_decode_config(r, hq, hkv, d, mb * bs, q.dtype)
    block_kv = dflt.block_kv if block_kv is None else int(block_kv)
    splits = dflt.num_kv_splits if num_kv_splits is None else int(num_kv_splits)
    num_warps = dflt.num_warps if num_warps is None else int(num_warps)
    num_stages = dflt.num_stages if num_stages is None else int(num_stages)
    if splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {splits}")
    rows = max(16, next_pow2(hq // hkv))  # the group's heads, padded to the tensor-core minimum
    _check_pow2(head_dim=d, block_size=bs, block_kv=block_kv)
    c = _static(q, k_cache, block_tables, rows=rows, block_q=1, block_kv=block_kv, splits=splits,
                sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    kv_lens = kv_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    ns = jnp.asarray(num_seqs, jnp.int32).reshape(-1)[:1]
    out_shape: Any  # one output, or the three partial results of the split KV
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((t * hq + rows, d), q.dtype)
    else:
        n = r * hkv * splits * rows
        out_shape = (jax.ShapeDtypeStruct((n, d), jnp.float32),
                     jax.ShapeDtypeStruct((n,), jnp.float32),
                     jax.ShapeDtypeStruct((n,), jnp.float32))
    res: Any = pl.pallas_call(
        functools.partial(_decode_kernel, c=c),
        out_shape=out_shape,
        grid=(r, hkv, splits),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_decode",
    )(ns, query_start_loc, kv_lens, block_tables, q.reshape(t * hq, d),
      k_cache.reshape(nb * bs, hkv, d), v_cache.reshape(nb * bs, hkv, d))
    valid = valid_token_mask(query_start_loc, num_seqs, t)
    if splits == 1:
        out = res[: t * hq].reshape(t, hq, d)
        return jnp.where(valid[:, None, None], out, jnp.zeros((), q.dtype))
    acc, m, l = res
    return _combine_splits(acc, m, l, query_start_loc, kv_lens, ns[0], c, q.dtype)


def _combine_splits(acc, m, l, query_start_loc, kv_lens, ns, c: _Static, dtype):
    shape = (c.r, c.hkv, c.splits, c.rows)
    acc = acc.reshape(shape + (c.d,))
    m = m.reshape(shape)
    l = l.reshape(shape)
    m_max = jnp.max(m, axis=2, keepdims=True)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    w = jnp.exp2(m - m_max)  # -inf partials weigh 0
    num = jnp.sum(w[..., None] * acc, axis=2)
    den = jnp.sum(w * l, axis=2)
    out = jnp.where((den > 0)[..., None], num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    out = out[:, :, : c.g, :].reshape(c.r, c.hq, c.d).astype(dtype)
    q_start = query_start_loc[:-1]
    q_len = query_start_loc[1:] - q_start
    active = (jnp.arange(c.r) < ns) & (q_len > 0) & (kv_lens > 0)
    tok = jnp.where(active, q_start, c.t)  # inactive rows -> out of range -> dropped
    return jnp.zeros((c.t, c.hq, c.d), dtype).at[tok].set(out, mode="drop")


# --------------------------------------------------------------------------------------------
# dispatcher


def ragged_paged_attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
                           *, sm_scale, sliding_window=None, soft_cap=None, interpret=False,
                           mode="mixed", block_q=None, block_kv=None, num_kv_splits=None,
                           num_warps=None, num_stages=None):
    """Ragged paged attention (Pallas, Triton lowering). Contract in the package docstring.

    ``mode`` (static): ``"mixed"`` (default, any batch), ``"decode"`` (caller guarantees every
    ``q_len <= 1``; e.g. a decode-only step bucket), or ``"auto"`` (``lax.cond`` on the batch's max
    ``q_len``: both kernels are compiled and the predicate is read on the host by XLA's conditional,
    so prefer choosing statically). Tuning: ``block_q`` (mixed only), ``block_kv``,
    ``num_kv_splits`` (decode only), ``num_warps``, ``num_stages``; ``None`` = heuristic default.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    common: dict[str, Any] = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                  interpret=interpret, block_kv=block_kv, num_warps=num_warps,
                                  num_stages=num_stages)
    args = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)

    def mixed(*a: Any) -> jax.Array:
        return ragged_paged_attention_mixed(*a, block_q=block_q, **common)

    def decode(*a: Any) -> jax.Array:
        return ragged_paged_attention_decode(*a, num_kv_splits=num_kv_splits, **common)

    if mode == "mixed":
        return mixed(*args)
    if mode == "decode":
        return decode(*args)
    qsl = query_start_loc.astype(jnp.int32)
    r = kv_lens.shape[0]
    active = jnp.arange(r) < scalar_num_seqs(num_seqs)
    max_q = jnp.max(jnp.where(active, qsl[1:] - qsl[:-1], 0))
    return lax.cond(max_q <= 1, lambda a: decode(*a), lambda a: mixed(*a), args)


# --------------------------------------------------------------------------------------------
# configurations the runner may choose (each is lowered for CUDA in the tests)

LOWERING_DTYPES = ("float32", "bfloat16", "float16")
LOWERING_HEAD_DIMS = (64, 128)
LOWERING_BLOCK_SIZES = (16, 32)
# (kernel, tuning, dtypes it applies to); an empty tuning = the heuristic default for the shape.
# The large prefill tile (128 rows at G=2, 3 stages) is for 2-byte dtypes only: in float32 its
# tiles would not fit the registers / shared memory of one SM.
_ALL = LOWERING_DTYPES
LOWERING_TUNINGS: tuple[tuple[str, dict[str, int], tuple[str, ...]], ...] = (
    ("mixed", dict(), _ALL),
    ("mixed", dict(block_q=16, block_kv=32, num_warps=4, num_stages=2), _ALL),
    ("mixed", dict(block_q=64, block_kv=64, num_warps=8, num_stages=3), ("bfloat16", "float16")),
    ("decode", dict(), _ALL),
    ("decode", dict(block_kv=32, num_kv_splits=4, num_warps=4, num_stages=2), _ALL),
)


def lowerable_configs():
    """Every kernel configuration the runner may pick, as dicts; the tests lower each for CUDA.

    Keys: ``mode`` ("mixed"/"decode"), ``dtype``, ``head_dim``, ``block_size`` and the tuning
    keywords to pass to :func:`ragged_paged_attention`.
    """
    out = []
    for mode, tuning, dtypes in LOWERING_TUNINGS:
        for dtype in dtypes:
            for head_dim in LOWERING_HEAD_DIMS:
                for block_size in LOWERING_BLOCK_SIZES:
                    out.append(dict(mode=mode, dtype=dtype, head_dim=head_dim,
                                    block_size=block_size, **tuning))
    return out


# jax >= 0.11 compiles a Pallas Triton kernel while lowering it, for the compute capability of
# a CUDA device: a real one or a compile-only one (jax.experimental.topologies, which needs the
# CUDA plugin). Older versions lower for CUDA with no device at all.
CUDA_LOWERING_NEEDS_DEVICE = jax.__version_info__ >= (0, 11)


def lower_for_cuda(config: dict, *, num_tokens=64, num_seqs=8, num_q_heads=16, num_kv_heads=8,
                   num_blocks=64, max_blocks=16, sliding_window=None, soft_cap=None, sharding=None):
    """Lower one :func:`lowerable_configs` entry for CUDA (works on a CPU-only jaxlib before 0.11).

    ``sharding``: place the arguments on a (compile-only) CUDA device instead of naming the
    platform, as jax >= 0.11 needs (:data:`CUDA_LOWERING_NEEDS_DEVICE`). Returns the StableHLO text.
    """
    cfg = dict(config)
    mode, dtype = cfg.pop("mode"), jnp.dtype(cfg.pop("dtype"))
    d, bs = cfg.pop("head_dim"), cfg.pop("block_size")
    sds = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    args = (sds((num_tokens, num_q_heads, d), dtype),
            sds((num_blocks, bs, num_kv_heads, d), dtype),
            sds((num_blocks, bs, num_kv_heads, d), dtype),
            sds((num_seqs,), jnp.int32), sds((num_seqs, max_blocks), jnp.int32),
            sds((num_seqs + 1,), jnp.int32), sds((1,), jnp.int32))
    fn = functools.partial(ragged_paged_attention, sm_scale=1.0 / math.sqrt(d), mode=mode,
                           sliding_window=sliding_window, soft_cap=soft_cap, **cfg)
    traced = jax.jit(fn).trace(*args)
    return (traced.lower() if sharding is not None else traced.lower(lowering_platforms=("cuda",))).as_text()
