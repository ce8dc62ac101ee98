"""What every decoder layer of one step reads besides its own weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.layers.attention import AttentionFn, AttentionMetadata
from jaxserve.layers.lora import LoRABatch

KVPools = tuple[jax.Array, jax.Array]  # (k, v), each [num_layers * num_blocks, block_size, Hkv, D]


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """Several KV cache groups (vLLM's hybrid cache: layers of one attention type share a block
    table). Layer ``l`` reads group ``layer_group[l]``'s block table and slot mapping, its pages in
    KV slot ``layer_slot[l]`` of the pools (block ``b`` at ``slot * num_blocks + b``)."""

    block_tables: jax.Array  # i32[G, R, P]
    slot_mapping: jax.Array  # i32[G, T]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    def view(self, md: AttentionMetadata, layer: jax.Array | int) -> tuple[AttentionMetadata, jax.Array]:
        """Layer ``layer``'s metadata (its group's tables) and its KV slot; ``layer`` may be traced."""
        group = jnp.asarray(self.layer_group, jnp.int32)[layer]
        slot = jnp.asarray(self.layer_slot, jnp.int32)[layer]
        return md._replace(block_tables=self.block_tables[group], slot_mapping=self.slot_mapping[group]), slot


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
    kv_groups: KVGroups | None = None  # None: one group, layer l in KV slot l
    local_rope: tuple[jax.Array, jax.Array] | None = None  # sliding layers' own (cos, sin): Gemma 3

    def rope_for(self, sliding: bool) -> tuple[jax.Array, jax.Array]:
        """The rotary tables of a layer: its own for a sliding layer of a model that has them."""
        if sliding and self.local_rope is not None:
            return self.local_rope
        return self.cos, self.sin

    def kv_view(self, layer: jax.Array | int) -> tuple[AttentionMetadata, jax.Array | int]:
        """The attention metadata layer ``layer`` reads and the KV slot its pages are in."""
        if self.kv_groups is None:
            return self.md, layer
        return self.kv_groups.view(self.md, layer)
