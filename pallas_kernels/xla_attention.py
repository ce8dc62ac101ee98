"""Ragged paged attention in jnp with query tiles: the engine's ``xla`` backend.

The reference gathers each token's context separately, so a prompt chunk of ``q`` tokens reads
its request's pages ``q`` times. Here the tokens of each request are cut into tiles of
``block_q`` consecutive queries (the same tiling as the Pallas kernel): a tile gathers its
request's pages once and scores all of its queries with one small matmul per KV head. Tiles come
from a static bound, ``(T + R * (block_q - 1)) // block_q``, so every shape stays static. Decode
buckets (``T <= R``) use one-query tiles: the per-token formulation.

A ``while_loop`` walks the context in chunks of ``kv_chunk`` positions, all tiles at once, and a
tile's work is the number of chunks the loop runs, not the number it needs. One loop for all
tiles would run every tile to the longest context in the batch: a decode batch with contexts of
32..384 tokens would do twice its work, and a prefill tile near a prompt's start (causal: it needs
one chunk) would walk the whole prompt. So tiles are sorted by the chunks they need and split into
``num_groups`` equal groups, each with its own loop bound. Cost: an argsort of the tiles and a
gather of their queries, repaid many times over on mixed context lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._common import check_options, check_shapes, check_sinks, finish_softmax, scalar_num_seqs
from .int8_kv import pages_f32

# The fastest of the sizes tried on the CPU (docs/benchmarks.md): small context chunks pad less
# past the longest context and keep the gathered pages in cache.
DEFAULT_KV_CHUNK = 32
DEFAULT_BLOCK_Q = 8
DEFAULT_NUM_GROUPS = 4


def ragged_paged_attention_xla(
    q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    interpret: bool = False, block_q: int | None = None, kv_chunk: int | None = None,
    num_groups: int | None = None, sinks=None,
):
    """The contract of :mod:`pallas_kernels`; returns ``[T, Hq, D]`` (padding tokens give 0).
    ``sinks``: as :func:`~pallas_kernels.reference.ragged_paged_attention_reference` takes them."""
    del interpret
    check_options(sliding_window, soft_cap)
    t, hq, d, nb, bs, hkv, r, mb = check_shapes(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc)
    check_sinks(sinks, hq)
    if block_q is None:
        block_q = 1 if t <= r else DEFAULT_BLOCK_Q
    if kv_chunk is None:
        kv_chunk = -(-DEFAULT_KV_CHUNK // bs) * bs
    if kv_chunk % bs:
        raise ValueError(f"kv_chunk {kv_chunk} must be a multiple of block_size {bs}")
    g, bq, f32 = hq // hkv, block_q, jnp.float32
    kv_lens = kv_lens.astype(jnp.int32)
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

    # Chunk range each tile needs; tiles sorted by their last chunk share a loop with their peers.
    pages = min(kv_chunk // bs, mb)
    chunk = pages * bs
    first = jnp.zeros_like(pos) if sliding_window is None else jnp.maximum(pos - int(sliding_window) + 1, 0)
    lo = jnp.min(jnp.where(row_live, first // chunk, jnp.int32(2**30)), axis=1)
    hi = jnp.max(jnp.where(row_live, pos // chunk + 1, 0), axis=1)
    groups = max(1, min(num_groups or DEFAULT_NUM_GROUPS, n_tiles))
    order = jnp.argsort(hi).astype(jnp.int32)
    tile = dict(req=tr[order], rows=rows[order], live=row_live[order], pos=pos[order], lo=lo[order],
                hi=hi[order])
    qt = q[jnp.clip(tile["rows"], 0, t - 1)].astype(f32).reshape(n_tiles, bq, hkv, g, d) * f32(sm_scale)
    tile["q"] = jnp.transpose(qt, (0, 2, 1, 3, 4)).reshape(n_tiles, hkv, bq * g, d)  # rows = (query, head)

    k_rows = k_cache.reshape(nb, -1)  # an int8 pool's rows carry their scales (int8_kv)
    v_rows = v_cache.reshape(nb, -1)
    block_tables = block_tables.astype(jnp.int32)
    bounds = [n_tiles * i // groups for i in range(groups + 1)]
    # a tile's rows are (query, head) pairs: each KV head's group of query heads, bq times over
    row_sinks = None if sinks is None else jnp.tile(sinks.astype(f32).reshape(hkv, g), (1, bq))
    outs = [_attend_tiles({k: v[a:b] for k, v in tile.items()}, k_rows, v_rows, kv_lens, block_tables,
                          chunk=chunk, pages=pages, g=g, soft_cap=soft_cap, sliding_window=sliding_window,
                          sinks=row_sinks)
            for a, b in zip(bounds[:-1], bounds[1:])]
    out = jnp.concatenate(outs) if groups > 1 else outs[0]
    out = jnp.transpose(out.reshape(n_tiles, hkv, bq, g, d), (0, 2, 1, 3, 4)).reshape(n_tiles * bq, hq, d)
    target = jnp.where(tile["live"], tile["rows"], t).reshape(-1)  # dead rows land past the end, dropped
    result = jnp.zeros((t, hq, d), f32).at[target].set(out, mode="drop")
    return result.astype(q.dtype)


def _attend_tiles(tile, k_rows, v_rows, kv_lens, block_tables, *, chunk, pages, g, soft_cap, sliding_window,
                  sinks=None):
    """Online-softmax attention of a group of tiles over their context chunks [min lo, max hi)."""
    n, hkv, rq, d = tile["q"].shape
    nb, mb = k_rows.shape[0], block_tables.shape[1]
    f32 = jnp.float32
    ctx = kv_lens[tile["req"]]
    tables = block_tables[tile["req"]]
    pos_rows = jnp.repeat(tile["pos"], g, axis=1)  # [n, bq*g]
    live_rows = jnp.repeat(tile["live"], g, axis=1)
    hi = jnp.max(tile["hi"])
    lo = jnp.minimum(jnp.min(tile["lo"]), hi)
    # the first position any row of a tile may see (its rows' positions ascend)
    win_lo = jnp.zeros((n,), jnp.int32) if sliding_window is None else tile["pos"][:, 0] - int(sliding_window) + 1

    def body(carry):
        c, m, l, acc = carry
        page = jnp.minimum(c * pages + jnp.arange(pages, dtype=jnp.int32), mb - 1)
        blk = jnp.clip(tables[:, page], 0, nb - 1)
        kk = pages_f32(k_rows[blk].reshape(n, chunk, hkv, -1))
        vv = pages_f32(v_rows[blk].reshape(n, chunk, hkv, -1))
        kpos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        # Slots past the context, and before the tile's first window (pages the scheduler released
        # while the block table still names them), may hold anything, even NaN: 0 * NaN would leak.
        vv = jnp.where(((kpos[None, :] < ctx[:, None]) & (kpos[None, :] >= win_lo[:, None]))[:, :, None, None],
                       vv, 0.0)
        s = jnp.einsum("nhrd,nchd->nhrc", tile["q"], kk)
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

    shape = (n, hkv, rq)
    init = (lo, jnp.full(shape, -jnp.inf, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, d), f32))
    _, m, l, acc = jax.lax.while_loop(lambda cr: cr[0] < hi, body, init)
    return finish_softmax(m, l, acc, sinks)
