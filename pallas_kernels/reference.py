"""Pure-jnp ragged paged attention (the oracle, and the ``xla`` backend) and ``write_kv``.

Formulation (token-major, chunked over the context):

* every token ``t`` finds its request ``req[t]`` (``searchsorted`` over ``query_start_loc``) and its
  position ``pos[t] = kv_len - q_len + (t - q_start)`` in that request's context;
* a ``while_loop`` walks the context in chunks of ``kv_chunk`` positions (a multiple of the block
  size), from the first chunk any token needs (sliding window) to the last one
  (``max(pos) // kv_chunk``); each step gathers, for every token, the pages of its own request that
  cover the chunk (``[T, kv_chunk, Hkv, D]``), scores them in f32 and folds them into an online
  softmax (running max / sum / accumulator).

Cost: ``O(T * max_kv_len * Hq * D)`` flops (the dense cost, padded to the longest context in the
batch, *not* to ``max_blocks * block_size`` and independent of ``R`` and ``num_blocks``), and
``O(T * kv_chunk * Hkv * D)`` temporary memory per step.  ``kv_chunk`` is picked statically so that
the per-step gather stays around 8M elements (large chunks for decode batches, small ones for long
prefills); pass ``kv_chunk=`` to override.  Everything is computed in float32 and cast back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._common import check_options, check_shapes, check_sinks, finish_softmax, scalar_num_seqs
from .int8_kv import is_int8, pages_f32, quantize_rows

_GATHER_BUDGET = 8 * 1024 * 1024  # elements of K gathered per loop step


def _default_kv_chunk(t: int, hkv: int, d: int, bs: int, mb: int) -> int:
    per_pos = max(1, t * hkv * d)
    pages = max(1, min(_GATHER_BUDGET // (per_pos * bs), 64, mb))
    return pages * bs


def token_metadata(query_start_loc, kv_lens, num_seqs, t: int):
    """Per-token ``(req, pos, valid)``: owning request (clamped to [0, R)), position, mask."""
    r = kv_lens.shape[0]
    ns = scalar_num_seqs(num_seqs)
    tok = jnp.arange(t, dtype=jnp.int32)
    # request r owns [qsl[r], qsl[r+1]); searchsorted(side='right') over qsl[1:] gives r.
    req = jnp.searchsorted(query_start_loc[1:], tok, side="right").astype(jnp.int32)
    req = jnp.clip(req, 0, r - 1)
    q_start = query_start_loc[req]
    q_len = query_start_loc[req + 1] - q_start
    kv_len = kv_lens[req]
    pos = kv_len - q_len + (tok - q_start)
    valid = (tok < query_start_loc[ns]) & (req < ns) & (tok >= q_start) & (pos >= 0)
    return req, pos, valid


def ragged_paged_attention_reference(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    kv_chunk: int | None = None,
    sinks=None,
):
    """Ragged paged attention in plain jnp (see module docstring); returns ``[T, Hq, D]``.

    ``interpret`` is accepted for signature compatibility and ignored. Padding tokens give zeros.
    ``sinks`` (float ``[Hq]`` or None): each head's attention-sink logit, in the softmax's
    denominator only (gpt-oss).
    """
    del interpret
    check_options(sliding_window, soft_cap)
    t, hq, d, nb, bs, hkv, r, mb = check_shapes(
        q, k_cache, v_cache, kv_lens, block_tables, query_start_loc)
    check_sinks(sinks, hq)
    g = hq // hkv
    kv_lens = kv_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    if kv_chunk is None:
        kv_chunk = _default_kv_chunk(t, hkv, d, bs, mb)
    if kv_chunk % bs:
        raise ValueError(f"kv_chunk {kv_chunk} must be a multiple of block_size {bs}")
    pages_per_chunk = kv_chunk // bs
    f32 = jnp.float32

    req, pos, valid = token_metadata(query_start_loc, kv_lens, num_seqs, t)
    kv_len_t = kv_lens[req]
    bt_t = block_tables[req]  # [T, MB]
    qf = q.astype(f32).reshape(t, hkv, g, d) * f32(sm_scale)

    # chunk range that any valid token needs
    if sliding_window is None:
        first = jnp.zeros_like(pos)
    else:
        first = jnp.maximum(pos - int(sliding_window) + 1, 0)
    lo = jnp.min(jnp.where(valid, first // kv_chunk, jnp.int32(2**30)))
    hi = jnp.max(jnp.where(valid, pos // kv_chunk + 1, 0))
    lo = jnp.minimum(lo, hi)

    def body(carry):
        c, m, l, acc = carry
        page = c * pages_per_chunk + jnp.arange(pages_per_chunk, dtype=jnp.int32)
        page = jnp.minimum(page, mb - 1)
        blk = jnp.clip(bt_t[:, page], 0, nb - 1)  # [T, P]
        kpos = c * kv_chunk + jnp.arange(kv_chunk, dtype=jnp.int32)  # [C]
        kk = pages_f32(k_cache[blk].reshape(t, kv_chunk, hkv, -1))
        vv = pages_f32(v_cache[blk].reshape(t, kv_chunk, hkv, -1))
        # Slots past the context, and before a window (pages the scheduler released while the
        # block table still names them), may hold anything, even NaN: 0 * NaN would leak into acc.
        in_ctx = kpos[None, :] < kv_len_t[:, None]  # [T, C]
        seen = in_ctx if sliding_window is None else in_ctx & (kpos[None, :] >= first[:, None])
        vv = jnp.where(seen[:, :, None, None], vv, 0.0)
        s = jnp.einsum("thgd,tchd->thgc", qf, kk, precision=jax.lax.Precision.HIGHEST)
        if soft_cap is not None:
            s = f32(soft_cap) * jnp.tanh(s / f32(soft_cap))
        mask = in_ctx & (kpos[None, :] <= pos[:, None]) & valid[:, None]
        if sliding_window is not None:
            mask &= kpos[None, :] > pos[:, None] - int(sliding_window)
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum(
            "thgc,tchd->thgd", p, vv, precision=jax.lax.Precision.HIGHEST)
        return c + 1, m_new, l, acc

    init = (lo, jnp.full((t, hkv, g), -jnp.inf, f32), jnp.zeros((t, hkv, g), f32),
            jnp.zeros((t, hkv, g, d), f32))
    _, m, l, acc = jax.lax.while_loop(lambda cr: cr[0] < hi, body, init)
    out = finish_softmax(m, l, acc, None if sinks is None else sinks.astype(f32).reshape(hkv, g))
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(t, hq, d).astype(q.dtype)


def write_kv(k_cache, v_cache, k_new, v_new, slot_mapping):
    """Scatter this step's keys/values into the paged cache; returns ``(k_cache, v_cache)``.

    ``slot = block_id * block_size + offset``; negative slots (padding tokens) are ignored. This is
    an XLA scatter at ``(block_id, offset)`` of the cache as it is shaped; when the caller jits
    with the caches donated, XLA updates them in place, so the cost is just the ``T * Hkv * D``
    written elements. A custom kernel would not be faster for a pure scatter, so there is none.
    Duplicate non-negative slots are not allowed (last writer is unspecified). An int8 pool gets
    each row quantized with its own scale (:func:`.int8_kv.quantize_rows`).

    Not on the cache viewed flat as ``[num_blocks * block_size, Hkv, D]``: for one token XLA turns
    the scatter into a dynamic-update-slice whose dropped-slot check reads the old row, and behind
    the reshape's bitcast that read is not fused with the update, so XLA:CPU copied the whole
    cache to update it, every layer of a scanned decode step.
    """
    nb, bs, hkv, _ = k_cache.shape
    slots = slot_mapping.astype(jnp.int32).reshape(-1)
    blocks = jnp.where(slots < 0, nb, slots // bs)  # out of range -> dropped (negatives would wrap)
    offsets = slots % bs

    def put(cache, new):
        rows = new.reshape(-1, hkv, new.shape[-1])
        rows = quantize_rows(rows) if is_int8(cache.dtype) else rows.astype(cache.dtype)
        return cache.at[blocks, offsets].set(rows, mode="drop")

    return put(k_cache, k_new), put(v_cache, v_new)
