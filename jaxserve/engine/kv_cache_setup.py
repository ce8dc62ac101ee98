"""Which KV cache manager an engine's scheduler gets, from the model's attention layers."""

from __future__ import annotations

from jaxserve.core import (
    HybridKVCacheManager,
    KVCacheConfig,
    SlidingWindowSpec,
    get_kv_cache_groups,
)
from jaxserve.models.config import ModelConfig


def make_kv_cache_manager(model_config: ModelConfig, num_blocks: int, block_size: int,
                          kv_dtype: str, max_model_len: int, max_num_batched_tokens: int,
                          enable_caching: bool) -> HybridKVCacheManager | None:
    """A ``HybridKVCacheManager`` for a model whose layers all use one sliding window (Mistral's
    ``sliding_window``): one group, so the runner's one block table per request still holds, and
    the blocks out of the window go back to the pool. ``None`` (the scheduler's plain
    ``KVCacheManager``) for full attention, or a window no shorter than ``max_model_len``."""
    window = model_config.sliding_window
    if window is None or window >= max_model_len:
        return None
    spec = SlidingWindowSpec(block_size, model_config.num_key_value_heads, model_config.head_dim,
                             kv_dtype, window)
    groups = get_kv_cache_groups([spec] * model_config.num_hidden_layers)
    assert len(groups) == 1  # one spec: one group, one KV slot per layer (the runner's layout)
    return HybridKVCacheManager(KVCacheConfig(num_blocks, groups), max_model_len,
                                max_num_batched_tokens, enable_caching)
