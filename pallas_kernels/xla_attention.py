"""Ragged paged attention in jnp with query tiles: the engine's ``xla`` backend for prefill.

The reference gathers each token's context separately, so a prompt chunk of ``q`` tokens reads
its request's pages ``q`` times. Here the tokens of each request are cut into tiles of
``block_q`` consecutive queries (the same tiling as the Pallas kernel): a tile gathers its
request's pages once and scores all of its queries with one small matmul per KV head. Tiles come
from a static bound, ``(T + R * (block_q - 1)) // block_q``, so every shape stays static.

When every tile would hold one token (decode buckets, ``T <= R``) tiling gains nothing and the
per-token reference is used. Cost: pages read ``~T / block_q + R`` times instead of ``T`` times.
Both paths walk the context in small chunks (``kv_chunk`` positions) up to the longest context in
the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._common import check_options, check_shapes, scalar_num_seqs
from .reference import ragged_paged_attention_reference

# Measured on the 2-core CPU with the cpu-bench model (jaxserve bench throughput): small context
# chunks win (1.9x over 512-position chunks: less padding past the longest context, and the
# gathered pages stay in cache), and 8-query tiles beat 16 and 32.
DEFAULT_KV_CHUNK = 32
DEFAULT_BLOCK_Q = 8


def ragged_paged_attention_xla(
    q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    interpret: bool = False, block_q: int | None = None, kv_chunk: int | None = None,
):
    """The contract of :mod:`pallas_kernels`; returns ``[T, Hq, D]`` (padding tokens give 0)."""
    del interpret
    check_options(sliding_window, soft_cap)
    t, hq, d, nb, bs, hkv, r, mb = check_shapes(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc)
    if block_q is None:
        block_q = 1 if t <= r else DEFAULT_BLOCK_Q
    if kv_chunk is None:
        kv_chunk = -(-DEFAULT_KV_CHUNK // bs) * bs
    if block_q == 1:
        return ragged_paged_attention_reference(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                                                num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                                                soft_cap=soft_cap, kv_chunk=kv_chunk)
    g, bq, f32 = hq // hkv, block_q, jnp.float32
    kv_lens = kv_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    qsl = query_start_loc.astype(jnp.int32)
    ns = scalar_num_seqs(num_seqs)

    # Tile table: tile j belongs to request tr[j] and covers its queries [row0, row0 + bq).
    q_lens = jnp.where(jnp.arange(r) < ns, qsl[1:] - qsl[:-1], 0)
    tiles_per_req = (q_lens + bq - 1) // bq
    tile_end = jnp.cumsum(tiles_per_req)
    n_tiles = (t + min(r, t) * (bq - 1)) // bq
    j = jnp.arange(n_tiles, dtype=jnp.int32)
    tr = jnp.clip(jnp.searchsorted(tile_end, j, side="right"), 0, r - 1).astype(jnp.int32)
    tile_live = j < tile_end[-1]
    rows = (qsl[tr] + (j - (tile_end[tr] - tiles_per_req[tr])) * bq)[:, None] + jnp.arange(bq, dtype=jnp.int32)
    row_live = tile_live[:, None] & (rows < qsl[tr + 1][:, None])
    pos = (kv_lens[tr] - q_lens[tr] - qsl[tr])[:, None] + rows  # context position of each query
    ctx = kv_lens[tr]
    qt = q[jnp.clip(rows, 0, t - 1)].astype(f32).reshape(n_tiles, bq, hkv, g, d) * f32(sm_scale)
    qt = jnp.transpose(qt, (0, 2, 1, 3, 4)).reshape(n_tiles, hkv, bq * g, d)  # rows = (query, head)
    pos_rows = jnp.repeat(pos, g, axis=1)  # [N, bq*g]
    live_rows = jnp.repeat(row_live, g, axis=1)

    if kv_chunk % bs:
        raise ValueError(f"kv_chunk {kv_chunk} must be a multiple of block_size {bs}")
    pages = min(kv_chunk // bs, mb)
    chunk = pages * bs
    first = jnp.zeros_like(pos) if sliding_window is None else jnp.maximum(pos - int(sliding_window) + 1, 0)
    lo = jnp.min(jnp.where(row_live, first // chunk, jnp.int32(2**30)))
    hi = jnp.max(jnp.where(row_live, pos // chunk + 1, 0))
    lo = jnp.minimum(lo, hi)
    k_rows = k_cache.reshape(nb, bs * hkv * d)
    v_rows = v_cache.reshape(nb, bs * hkv * d)
    tables = block_tables[tr]

    def body(carry):
        c, m, l, acc = carry
        page = jnp.minimum(c * pages + jnp.arange(pages, dtype=jnp.int32), mb - 1)
        blk = jnp.clip(tables[:, page], 0, nb - 1)
        kk = k_rows[blk].reshape(n_tiles, chunk, hkv, d).astype(f32)
        vv = v_rows[blk].reshape(n_tiles, chunk, hkv, d).astype(f32)
        kpos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        # Stale slots past the context may hold anything (even NaN); 0 * NaN would leak into acc.
        vv = jnp.where((kpos[None, :] < ctx[:, None])[:, :, None, None], vv, 0.0)
        s = jnp.einsum("nhrd,nchd->nhrc", qt, kk)
        if soft_cap is not None:
            s = f32(soft_cap) * jnp.tanh(s / f32(soft_cap))
        mask = (kpos[None, None, :] < ctx[:, None, None]) & (kpos[None, None, :] <= pos_rows[:, :, None])
        mask &= live_rows[:, :, None]
        if sliding_window is not None:
            mask &= kpos[None, None, :] > pos_rows[:, :, None] - int(sliding_window)
        s = jnp.where(mask[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("nhrc,nchd->nhrd", p, vv)
        return c + 1, m_new, l, acc

    shape = (n_tiles, hkv, bq * g)
    init = (lo, jnp.full(shape, -jnp.inf, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, d), f32))
    _, m, l, acc = jax.lax.while_loop(lambda cr: cr[0] < hi, body, init)
    out = jnp.where((l > 0)[..., None], acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = jnp.transpose(out.reshape(n_tiles, hkv, bq, g, d), (0, 2, 1, 3, 4)).reshape(n_tiles * bq, hq, d)
    target = jnp.where(row_live, rows, t).reshape(-1)  # dead rows land past the end and are dropped
    result = jnp.zeros((t, hq, d), f32).at[target].set(out, mode="drop")
    return result.astype(q.dtype)
