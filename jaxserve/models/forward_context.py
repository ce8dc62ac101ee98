"""What every decoder layer of one step reads besides its own weights."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from jaxserve.layers.attention import AttentionFn, AttentionMetadata
from jaxserve.layers.lora import LoRABatch

KVPools = tuple[jax.Array, jax.Array]  # (k, v), each [num_layers * num_blocks, block_size, Hkv, D]


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """Built once per forward and shared by all layers; the KV pools travel separately, in the
    layer loop's carry, so that XLA can update them in place."""

    md: AttentionMetadata
    attn_fn: AttentionFn
    cos: jax.Array  # [T, head_dim], rotary tables of this step's positions
    sin: jax.Array
    num_blocks: int  # KV blocks per layer: layer l's pages start at l * num_blocks in the pools
    mesh: Mesh | None = None  # tensor parallel: attention runs per shard of the heads
    lora: LoRABatch | None = None  # this step's adapters; None in a base-only step
