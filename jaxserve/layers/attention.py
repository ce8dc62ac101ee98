"""Paged attention front end: write this step's K/V into the cache, then attend with a backend.

The KV cache of all layers lives in one array per K and V, ``[num_layers, num_blocks, block_size,
num_kv_heads, head_dim]``. Inside the layer scan it is viewed as one big page pool of
``num_layers * num_blocks`` pages and layer ``l`` addresses its pages as ``block_id + l *
num_blocks``. That keeps every backend on the single contract of ``pallas_kernels`` (no per-layer
slice, which XLA would copy) and lets the scan carry the cache and update it in place.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels


class AttentionMetadata(NamedTuple):
    """Per-step metadata, built on the host in numpy and sent in one transfer."""

    positions: jax.Array  # int32 [T]
    slot_mapping: jax.Array  # int32 [T]; block_id * block_size + offset, -1 for padding tokens
    block_tables: jax.Array  # int32 [R, max_blocks_per_seq]; 0 (the null block) for padding
    kv_lens: jax.Array  # int32 [R]; context length including this step's tokens, 0 for padding
    query_start_loc: jax.Array  # int32 [R + 1]
    num_seqs: jax.Array  # int32 [1]


AttentionFn = Callable[..., jax.Array]


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    num_blocks: int,
    md: AttentionMetadata,
    attn_fn: AttentionFn,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attend ``q [T, Hq, D]`` over this layer's pages; returns ``(out, k_pool, v_pool)``.

    ``k_pool``/``v_pool`` are the all-layer pools viewed as ``[L * num_blocks, block_size, Hkv, D]``.
    """
    block_size = k_pool.shape[1]
    layer_offset = layer * num_blocks
    slots = jnp.where(md.slot_mapping >= 0, md.slot_mapping + layer_offset * block_size, -1)
    k_pool, v_pool = pallas_kernels.write_kv(k_pool, v_pool, k, v, slots)
    out = attn_fn(
        q,
        k_pool,
        v_pool,
        md.kv_lens,
        md.block_tables + layer_offset,
        md.query_start_loc,
        md.num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
    )
    return out, k_pool, v_pool
