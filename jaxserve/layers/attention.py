"""Paged attention front end: write this step's K/V into the cache, then attend with a backend.

The KV cache of all layers lives in one array per K and V, ``[num_layers, num_blocks, block_size,
num_kv_heads, head_dim]``. Inside the layer scan it is viewed as one big page pool of
``num_layers * num_blocks`` pages and layer ``l`` addresses its pages as ``block_id + l *
num_blocks``. That keeps every backend on the single contract of ``pallas_kernels`` (no per-layer
slice, which XLA would copy) and lets the scan carry the cache and update it in place.

Tensor parallel: given a mesh, the write and the attention run per shard of the head axis
(``shard_map``): each device holds its query heads and its key/value heads (the pools are split
on that axis too), so the backend sees the same contract with fewer heads, and nothing moves
between devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

import pallas_kernels
from jaxserve.layers.shard import shard_map


class AttentionMetadata(NamedTuple):
    """Per-step metadata, built on the host in numpy and sent in one transfer."""

    positions: jax.Array  # int32 [T]
    slot_mapping: jax.Array  # int32 [T]; block_id * block_size + offset, -1 for padding tokens
    block_tables: jax.Array  # int32 [R, max_blocks_per_seq]; 0 (the null block) for padding
    kv_lens: jax.Array  # int32 [R]; context length including this step's tokens, 0 for padding
    query_start_loc: jax.Array  # int32 [R + 1]
    num_seqs: jax.Array  # int32 [1]


AttentionFn = Callable[..., jax.Array]


def to_cache_dtype(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` as the pool stores it; a float8 pool saturates at its largest finite value (e4m3fn
    has no infinity, and a plain cast of anything past 448 would be NaN). An int8 pool takes the
    float values: ``write_kv`` quantizes each row with its own scale."""
    if jnp.dtype(dtype) == jnp.int8:
        return x
    if jnp.dtype(dtype).itemsize == 1:
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -top, top)
    return x.astype(dtype)


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    num_blocks: int,
    md: AttentionMetadata,
    attn_fn: AttentionFn,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    mesh: Mesh | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attend ``q [T, Hq, D]`` over this layer's pages; returns ``(out, k_pool, v_pool)``.
    ``sinks [Hq]``: attention-sink logits (gpt-oss), passed to the backends that take them only.

    ``k_pool``/``v_pool`` are the all-layer pools viewed as ``[L * num_blocks, block_size, Hkv, D]``.
    ``mesh``: split over its devices on the head axis (``Hq`` and ``Hkv`` both divisible by its size).
    """
    run: Callable[..., tuple[jax.Array, jax.Array, jax.Array]] = functools.partial(
        _write_and_attend, num_blocks=num_blocks, attn_fn=attn_fn, sm_scale=sm_scale, sliding_window=sliding_window)
    # sinks travel as an argument (split by heads with q), seen only by sink-aware backends (SINK_BACKENDS)
    extra = () if sinks is None else (sinks,)
    if mesh is not None and mesh.size > 1:
        heads = PartitionSpec(None, mesh.axis_names, None)
        pool = PartitionSpec(None, None, mesh.axis_names, None)
        extra_specs = () if sinks is None else (PartitionSpec(mesh.axis_names),)
        run = shard_map(run, mesh, in_specs=(heads, heads, heads, pool, pool, PartitionSpec(), PartitionSpec(),
                                             *extra_specs), out_specs=(heads, pool, pool))
    return run(q, k, v, k_pool, v_pool, layer, md, *extra)


def _write_and_attend(q, k, v, k_pool, v_pool, layer, md: AttentionMetadata, sinks=None, *, num_blocks: int,
                      attn_fn: AttentionFn, sm_scale: float, sliding_window: int | None):
    if sinks is not None:
        attn_fn = functools.partial(attn_fn, sinks=sinks)
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
