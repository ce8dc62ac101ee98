"""KV cache sizing and allocation.

Sizing follows vLLM's knobs, first match wins: ``num_gpu_blocks_override`` (exact blocks),
``kv_cache_memory`` (bytes), ``gpu_memory_utilization`` (a fraction of the device's memory, less
what the weights already hold and a reserve for activations). On CPU, where "device memory" is
the host's, the default is enough for ``max_num_seqs`` full-length sequences, capped at 256 MiB.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.exceptions import ConfigError
from jaxserve.models.config import ModelConfig

logger = logging.getLogger("jaxserve")

CPU_DEFAULT_KV_BYTES = 256 * 1024 * 1024


def bytes_per_block(mc: ModelConfig, block_size: int) -> int:
    """K and V of every layer for one block."""
    itemsize = jnp.dtype(mc.dtype).itemsize
    return 2 * mc.num_hidden_layers * block_size * mc.num_key_value_heads * mc.head_dim * itemsize


def activation_reserve_bytes(mc: ModelConfig, cfg: EngineConfig) -> int:
    """A generous bound on the step's live activations (hidden, MLP, logits, sampler tables)."""
    t = cfg.max_num_batched_tokens
    width = max(mc.hidden_size, mc.intermediate_size * 2, mc.q_size + 2 * mc.kv_size)
    rows = min(cfg.max_num_seqs, t)
    return 8 * t * width * 4 + 6 * rows * mc.vocab_size * 4 + 2 * (cfg.max_num_seqs + 1) * mc.vocab_size * 5


def determine_num_blocks(mc: ModelConfig, cfg: EngineConfig, max_model_len: int) -> int:
    per_block = bytes_per_block(mc, cfg.block_size)
    if cfg.num_gpu_blocks_override is not None:
        return cfg.num_gpu_blocks_override
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    else:
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform == "gpu" else None
        if stats and "bytes_limit" in stats:
            total = stats["bytes_limit"]
            budget = int(cfg.gpu_memory_utilization * total) - stats.get("bytes_in_use", 0)
            budget -= activation_reserve_bytes(mc, cfg)
        else:
            blocks_per_seq = cdiv(max_model_len, cfg.block_size)
            budget = min(CPU_DEFAULT_KV_BYTES, (cfg.max_num_seqs * blocks_per_seq + 1) * per_block)
    num_blocks = int(budget // per_block)
    if num_blocks < 2:
        raise ConfigError(
            f"kv cache: the budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes; "
            "raise kv_cache_memory / gpu_memory_utilization or lower max_model_len")
    return num_blocks


def allocate_kv_cache(mc: ModelConfig, num_blocks: int, block_size: int) -> tuple[jax.Array, jax.Array]:
    shape = (mc.num_hidden_layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim)
    return jnp.zeros(shape, mc.dtype), jnp.zeros(shape, mc.dtype)
