"""What each attention layer keeps in the KV cache, and how layers are grouped to share blocks.

vLLM's hybrid KV cache: every layer has a ``KVCacheSpec`` (full attention keeps every position;
a sliding window of W keeps only the last W). Layers with equal specs form groups
(``KVCacheGroupSpec``), and each group has its own block table per request, managed by its own
``SingleTypeKVCacheManager``, all drawing from one ``BlockPool``. All groups have the same
number of layers (``group_size``; a type with more layers is split into several groups), so one
block id means the same amount of memory whichever group holds it: ``group_size`` pages, one in
each of the ``group_size`` KV slots. Layer ``j`` of every group shares slot ``j``.

With a single full-attention type this is one group of all layers, one slot per layer: the
layout jaxserve always had.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from jaxserve.core.kv_cache_utils import cdiv

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV dtype named as jnp names it."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that attends to every earlier position: it keeps them all."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str

    @property
    def page_size_bytes(self) -> int:
        """One block of one layer, K and V."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_bytes(self.dtype)

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request of this type holds at once."""
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A layer whose token at position p attends to ``[p - sliding_window + 1, p]`` only."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_bytes(self.dtype)

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """A step's chunk of up to ``max_num_batched_tokens`` tokens plus the ``W - 1`` before it,
        plus one block for a window that starts mid-block (vLLM's bound)."""
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return min(cdiv(num_tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))


KVCacheSpec = Union[FullAttentionSpec, SlidingWindowSpec]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table per request (equal specs). ``layer_names`` are the
    layers' indices in the model, in order; the j-th uses KV slot j."""

    layer_names: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The cache a runner allocates: ``num_blocks`` block ids, each ``group_size`` pages (one per
    slot), shared by ``kv_cache_groups``.

    Invariants: every group has at most ``group_size`` layers; every layer is in one group; all
    groups have the same block size and page size.
    """

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        if not self.kv_cache_groups:
            raise ValueError("a KV cache config needs at least one group")
        sizes = {(g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes) for g in self.kv_cache_groups}
        if len(sizes) != 1:
            raise ValueError(f"KV cache groups must share block and page size, got {sorted(sizes)}")
        layers = [layer for g in self.kv_cache_groups for layer in g.layer_names]
        if len(layers) != len(set(layers)):
            raise ValueError("a layer is in two KV cache groups")

    @property
    def block_size(self) -> int:
        return self.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def group_size(self) -> int:
        """KV slots: the most layers in one group."""
        return max(len(g.layer_names) for g in self.kv_cache_groups)

    @property
    def bytes_per_block(self) -> int:
        return self.group_size * self.kv_cache_groups[0].kv_cache_spec.page_size_bytes

    def layer_slot(self, layer: int) -> tuple[int, int]:
        """``(group id, KV slot)`` of a layer."""
        for gid, group in enumerate(self.kv_cache_groups):
            if layer in group.layer_names:
                return gid, group.layer_names.index(layer)
        raise KeyError(f"layer {layer} is in no KV cache group")

    def max_num_blocks_per_req(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of ``max_model_len`` tokens can hold at once over all groups."""
        return sum(g.kv_cache_spec.max_num_blocks(max_model_len, max_num_batched_tokens)
                   for g in self.kv_cache_groups)


def get_kv_cache_groups(layer_specs: Sequence[KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """Group layers by spec as vLLM does for a uniform page size.

    ``layer_specs[i]`` is layer i's spec. The group size is the smallest type's layer count, or
    the largest's when that pads fewer than a quarter; a type with more layers is split into
    ``cdiv(n, group_size)`` groups, striding over its layers (``layers[i::num_groups]``) so each
    group spans the model's depth. Types are ordered by their first layer.
    """
    if not layer_specs:
        raise ValueError("no layers to group")
    by_type: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(layer_specs):
        by_type.setdefault(spec, []).append(layer)
    counts = [len(layers) for layers in by_type.values()]
    group_size = min(counts)
    if max(counts) < group_size * 1.25:
        group_size = max(counts)  # a few padded slots beat many groups
    groups: list[KVCacheGroupSpec] = []
    for spec, layers in by_type.items():
        num_groups = cdiv(len(layers), group_size)
        groups.extend(KVCacheGroupSpec(tuple(layers[i::num_groups]), spec) for i in range(num_groups))
    return tuple(groups)


def get_kv_cache_config(layer_specs: Sequence[KVCacheSpec], available_bytes: int) -> KVCacheConfig:
    """The groups and as many blocks as ``available_bytes`` hold (null block included)."""
    groups = get_kv_cache_groups(layer_specs)
    probe = KVCacheConfig(2, groups)
    return KVCacheConfig(available_bytes // probe.bytes_per_block, groups)
