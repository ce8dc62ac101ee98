"""Which KV cache manager an engine's scheduler gets, from the model's attention layers."""

from __future__ import annotations

from jaxserve.core import FullAttentionSpec, HybridKVCacheManager, KVCacheConfig
from jaxserve.models.config import ModelConfig
from jaxserve.runner.kv_cache import kv_cache_groups


def make_kv_cache_manager(model_config: ModelConfig, num_blocks: int, block_size: int,
                          kv_dtype: str, max_model_len: int, max_num_batched_tokens: int,
                          enable_caching: bool) -> HybridKVCacheManager | None:
    """A ``HybridKVCacheManager`` over the runner's KV cache groups (``runner.kv_cache.kv_cache_groups``:
    one per attention type, Gemma 3's local and global layers; Mistral's one window is one group),
    sliding-window groups giving the blocks out of their window back to the pool. ``None`` (the
    scheduler's plain ``KVCacheManager``) for full attention everywhere (a window no shorter than
    ``max_model_len`` counts as full). ``kv_dtype`` is unused: the grouping does not depend on it."""
    groups = kv_cache_groups(model_config, block_size, max_model_len)
    if len(groups) == 1 and isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        return None
    return HybridKVCacheManager(KVCacheConfig(num_blocks, groups), max_model_len,
                                max_num_batched_tokens, enable_caching)
