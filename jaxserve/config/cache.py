"""The KV cache: block size, prefix caching, its size and storage (vLLM's ``CacheConfig``)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.base import SubConfig

# --kv-cache-dtype values, in vLLM's spellings (--quantization's are QUANTIZATION_METHODS).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")


@dataclasses.dataclass
class CacheConfig(SubConfig):
    block_size: int = 16
    """Tokens per KV cache block."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (hash chain over full blocks)."""
    kv_cache_memory: int | None = None
    """KV cache size in bytes (overrides gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's total memory this engine may use (vLLM's meaning): the KV cache gets
    what the weights, the largest step's temporaries and a fixed reserve leave of it."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV cache blocks."""
    kv_cache_dtype: str = "auto"
    """KV cache storage (vLLM's flag): auto (the model's dtype) or fp8 / fp8_e4m3 (float8 e4m3,
    scale 1.0 as vLLM uses without calibrated scales): half of bfloat16's bytes per token. int8
    (jaxserve's, CPU backends only; vLLM has no int8 value): a float32 scale per position and KV
    head, so (head_dim + 4) / (2 * head_dim) of bfloat16's bytes."""

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise self.bad("block_size", "must be a positive power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise self.bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise self.bad("kv_cache_memory", "must be a positive number of bytes")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise self.bad("num_gpu_blocks_override", "must be >= 2 (block 0 is reserved)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise self.bad("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
