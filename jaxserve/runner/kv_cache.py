"""KV cache sizing and allocation.

Sizing follows vLLM's knobs, first match wins: ``num_gpu_blocks_override`` (exact blocks),
``kv_cache_memory`` (bytes), ``gpu_memory_utilization``: the fraction of the device's *total*
memory this process may use (vLLM's meaning). The cache gets that share less what is already held
(the weights), less the largest compiled step's temporary memory (``memory_analysis()`` of the
executables) and less :data:`GPU_RESERVE_BYTES`; :func:`kv_cache_budget` is that arithmetic.
XLA's allocator is told the same share before it starts (:func:`configure_xla_allocator`), so the
pool it preallocates is exactly the memory the budget was drawn from.

On CPU, where "device memory" is the host's, the default is enough for ``max_num_seqs``
full-length sequences, capped at 256 MiB.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jaxserve import envs
from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    get_kv_cache_groups,
)
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.exceptions import ConfigError
from jaxserve.models.config import ModelConfig
from jaxserve.models.tp_layout import TPLayout
from pallas_kernels.int8_kv import stored_head_dim

logger = logging.getLogger("jaxserve")

CPU_DEFAULT_KV_BYTES = 256 * 1024 * 1024
# Outside what the budget counts: cuBLAS/cuDNN workspaces, the allocator's fragmentation, and the
# small programs compiled on first use.
GPU_RESERVE_BYTES = 1024 * 1024 * 1024
# XLA's GPU client preallocates this share of the device when XLA_PYTHON_CLIENT_MEM_FRACTION is unset.
XLA_DEFAULT_MEM_FRACTION = 0.75


# --kv-cache-dtype -> the pool's dtype; "auto" is the model's. fp8 is stored with scale 1.0, as vLLM
# stores it without calibrated k/v scales (the values are cast, saturating at e4m3's 448). int8
# (CPU only) keeps a float32 scale per position and KV head at the end of each row
# (pallas_kernels.int8_kv), so its rows are head_dim + 4 bytes.
KV_CACHE_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "int8": jnp.int8}


def kv_cache_dtype(mc: ModelConfig, name: str = "auto") -> jnp.dtype:
    return jnp.dtype(KV_CACHE_DTYPES.get(name, mc.dtype))


def layer_kv_specs(mc: ModelConfig, block_size: int, max_model_len: int,
                   cache_dtype: str = "auto") -> list[KVCacheSpec]:
    """Each layer's ``KVCacheSpec``: its sliding window, or full attention (also for a window no
    shorter than ``max_model_len``, which never drops a block)."""
    dtype, heads = kv_cache_dtype(mc, cache_dtype), mc.num_key_value_heads
    row = stored_head_dim(mc.head_dim, dtype)  # the spec's head_size: what a row stores, scales included
    return [FullAttentionSpec(block_size, heads, row, dtype.name) if w is None or w >= max_model_len
            else SlidingWindowSpec(block_size, heads, row, dtype.name, w) for w in mc.layer_windows]


def kv_cache_groups(mc: ModelConfig, block_size: int, max_model_len: int,
                    cache_dtype: str = "auto") -> tuple[KVCacheGroupSpec, ...]:
    """The layers grouped by attention type (vLLM's rule, ``get_kv_cache_groups``): what the
    runner's block tables and the engine's KV cache manager both follow."""
    return get_kv_cache_groups(layer_kv_specs(mc, block_size, max_model_len, cache_dtype))


def num_kv_slots(groups: tuple[KVCacheGroupSpec, ...]) -> int:
    """The cache's first axis: a slot per layer of the largest group (all layers with one group)."""
    return KVCacheConfig(2, groups).group_size


def bytes_per_block(mc: ModelConfig, block_size: int, tensor_parallel_size: int = 1,
                    cache_dtype: str = "auto", num_slots: int | None = None) -> int:
    """K and V of every KV slot (``num_slots``; None: one per layer) for one block, on one device:
    split ``tensor_parallel_size`` ways on the stored key/value heads
    (:class:`~jaxserve.models.tp_layout.TPLayout`), in the ``--kv-cache-dtype`` ``cache_dtype``
    (int8: a row's scale included)."""
    dtype = kv_cache_dtype(mc, cache_dtype)
    heads = TPLayout.of(mc, tensor_parallel_size).kv_heads_per_shard
    slots = mc.num_hidden_layers if num_slots is None else num_slots
    return 2 * slots * block_size * heads * stored_head_dim(mc.head_dim, dtype) * dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ProposerKV:
    """A speculative proposer's KV pool, sized with the target's: ``per_block`` bytes for each
    target block (a draft model's pool holds as many tokens; an EAGLE head's layer lives in the
    target's block ids) and ``fixed`` bytes besides (the draft's lookahead and null blocks). The
    target's pool gets what is left after both, so the proposer's pool fits the same budget."""

    per_block: int
    fixed: int = 0


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What the KV sizing reads of one device. ``pool_bytes``: XLA's allocator limit (its
    ``bytes_limit``); ``pool_fraction``: the share of the device that limit was set to, so that
    ``total = pool_bytes / pool_fraction``; ``held_bytes``: allocated already (the weights)."""

    pool_bytes: int
    pool_fraction: float
    held_bytes: int

    @property
    def total_bytes(self) -> int:
        return int(self.pool_bytes / self.pool_fraction)


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """Invariant: ``kv_bytes = usable - held - peak_temp - reserve`` with ``usable =
    min(utilization * total, pool)``; it may be negative (the caller refuses it)."""

    total: int
    utilization: float
    usable: int
    held: int
    peak_temp: int
    reserve: int

    @property
    def kv_bytes(self) -> int:
        return self.usable - self.held - self.peak_temp - self.reserve

    def describe(self) -> str:
        gib = 1024**3
        return (f"{self.utilization:.2f} x {self.total / gib:.2f} GiB = {self.usable / gib:.2f} GiB usable - "
                f"{self.held / gib:.2f} GiB held (weights) - {self.peak_temp / gib:.2f} GiB largest step "
                f"temporaries - {self.reserve / gib:.2f} GiB reserve = {self.kv_bytes / gib:.2f} GiB for the KV cache")


def kv_cache_budget(memory: DeviceMemory, utilization: float, peak_temp_bytes: int,
                    reserve_bytes: int = GPU_RESERVE_BYTES) -> KVBudget:
    """vLLM's ``gpu_memory_utilization``: this process may use ``utilization`` of the device's
    total memory; the KV cache gets what the weights, the step's temporaries and the reserve leave.
    A pool smaller than that share caps it (the allocator cannot hand out more)."""
    usable = min(int(utilization * memory.total_bytes), memory.pool_bytes)
    if usable < int(utilization * memory.total_bytes):
        logger.warning("XLA's memory pool (%d bytes) is smaller than gpu_memory_utilization %.2f of the device; "
                       "the KV cache is sized from the pool", memory.pool_bytes, utilization)
    return KVBudget(memory.total_bytes, utilization, usable, memory.held_bytes, peak_temp_bytes, reserve_bytes)


def blocks_per_request(mc: ModelConfig, block_size: int, max_model_len: int,
                       max_num_batched_tokens: int) -> int:
    """The most blocks one ``max_model_len`` request holds at once over all KV cache groups: all
    of its context for a full-attention group, the window and a step's chunk for a sliding one
    (``SlidingWindowSpec``'s bound, which the engine's ``HybridKVCacheManager`` keeps to)."""
    groups = kv_cache_groups(mc, block_size, max_model_len)
    return KVCacheConfig(2, groups).max_num_blocks_per_req(max_model_len, max_num_batched_tokens)


def blocks_for_budget(budget_bytes: int, per_block: int, block_size: int, max_model_len: int,
                      blocks_per_req: int | None = None) -> int:
    """Blocks that fit ``budget_bytes``; refuses a cache that cannot hold one ``max_model_len``
    request (its blocks, ``blocks_per_req`` when a window keeps fewer, plus the null block 0)."""
    num_blocks = max(0, int(budget_bytes // per_block))
    needed = (cdiv(max_model_len, block_size) if blocks_per_req is None else blocks_per_req) + 1
    if num_blocks < needed:
        raise ConfigError(
            f"kv cache: {max(budget_bytes, 0)} bytes hold {num_blocks} blocks of {per_block} bytes, but one "
            f"request of max_model_len={max_model_len} needs {needed}; raise gpu_memory_utilization or "
            "kv_cache_memory, or lower max_model_len, max_num_batched_tokens or max_num_seqs")
    return num_blocks


def gpu_device_memory(device) -> DeviceMemory:
    """The allocator figures of a GPU ``device``; a clear error when it reports none (the
    ``platform`` allocator has no limit to size from)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ConfigError("kv cache: the device reports no memory limit (XLA_PYTHON_CLIENT_ALLOCATOR=platform?); "
                         "set kv_cache_memory or num_gpu_blocks_override")
    fraction = envs.xla_mem_fraction() or XLA_DEFAULT_MEM_FRACTION
    return DeviceMemory(int(stats["bytes_limit"]), fraction, int(stats.get("bytes_in_use", 0)))


def configure_xla_allocator(utilization: float) -> None:
    """Have XLA's GPU allocator preallocate ``utilization`` of the device, unless the user chose a
    share already. Only before JAX starts its backends: afterwards the pool exists, the setting
    would misstate it, and the sizing uses that pool (see :func:`kv_cache_budget`)."""
    if envs.xla_mem_fraction() is None and not _backends_started():
        envs.set_xla_mem_fraction(utilization)


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # private module; assume started, which only skips the setting
        return True
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return True if started is None else bool(started())


def determine_num_blocks(mc: ModelConfig, cfg: EngineConfig, max_model_len: int, *, platform: str = "cpu",
                         memory: DeviceMemory | None = None, peak_temp_bytes: int = 0,
                         proposer: ProposerKV | None = None) -> int:
    """Blocks of the KV cache. On a GPU without an explicit size, ``memory`` (the device's
    figures) and ``peak_temp_bytes`` (the largest compiled step's temporaries) are required;
    a budget (the GPU's or ``kv_cache_memory``) also holds ``proposer``'s pool."""
    slots = num_kv_slots(kv_cache_groups(mc, cfg.block_size, max_model_len, cfg.kv_cache_dtype))
    per_block = bytes_per_block(mc, cfg.block_size, cfg.tensor_parallel_size, cfg.kv_cache_dtype, slots)
    if cfg.num_gpu_blocks_override is not None:
        return cfg.num_gpu_blocks_override
    blocks_per_seq = blocks_per_request(mc, cfg.block_size, max_model_len, cfg.max_num_batched_tokens)
    extra = proposer or ProposerKV(0)
    if cfg.kv_cache_memory is not None:
        return blocks_for_budget(cfg.kv_cache_memory - extra.fixed, per_block + extra.per_block, cfg.block_size,
                                 max_model_len, blocks_per_seq)
    if platform == "gpu":
        if memory is None:
            raise ConfigError("kv cache: sizing by gpu_memory_utilization needs the device's memory figures")
        budget = kv_cache_budget(memory, cfg.gpu_memory_utilization, peak_temp_bytes)
        logger.info("KV cache budget: %s%s", budget.describe(), "" if proposer is None else
                    f", shared with the proposer's pool ({extra.per_block} bytes a block, {extra.fixed} more)")
        return blocks_for_budget(budget.kv_bytes - extra.fixed, per_block + extra.per_block, cfg.block_size,
                                 max_model_len, blocks_per_seq)
    budget_bytes = min(CPU_DEFAULT_KV_BYTES, (cfg.max_num_seqs * blocks_per_seq + 1) * per_block)
    return blocks_for_budget(budget_bytes, per_block, cfg.block_size, max_model_len, blocks_per_seq)


def kv_cache_shape(mc: ModelConfig, num_blocks: int, block_size: int, tensor_parallel_size: int = 1,
                   num_slots: int | None = None, cache_dtype: str = "auto") -> tuple[int, ...]:
    """The whole cache's shape: ``num_slots`` KV slots (None: one per layer); its key/value heads
    are the stored ones (replicated when fewer than ``tensor_parallel_size``); an int8 row ends
    with its scale's 4 bytes."""
    heads = TPLayout.of(mc, tensor_parallel_size).stored_kv_heads
    slots = mc.num_hidden_layers if num_slots is None else num_slots
    return (slots, num_blocks, block_size, heads, stored_head_dim(mc.head_dim, kv_cache_dtype(mc, cache_dtype)))


def allocate_kv_cache(mc: ModelConfig, num_blocks: int, block_size: int, tensor_parallel_size: int = 1,
                      cache_dtype: str = "auto", num_slots: int | None = None) -> tuple[jax.Array, jax.Array]:
    shape = kv_cache_shape(mc, num_blocks, block_size, tensor_parallel_size, num_slots, cache_dtype)
    dtype = kv_cache_dtype(mc, cache_dtype)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
