"""Engine core: requests, KV block management and the scheduler. Pure Python (stdlib + numpy),
never jax, so it is tested in milliseconds."""

from jaxserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jaxserve.core.kv_cache_coordinator import HybridKVCacheCoordinator
from jaxserve.core.kv_cache_manager import HybridKVCacheManager, KVCacheManager
from jaxserve.core.kv_cache_spec import (
                                          FullAttentionSpec,
                                          KVCacheConfig,
                                          KVCacheGroupSpec,
                                          KVCacheSpec,
                                          SlidingWindowSpec,
                                          get_kv_cache_config,
                                          get_kv_cache_groups,
)
from jaxserve.core.kv_cache_utils import (
                                          BlockHash,
                                          generate_block_hash_extra_keys,
                                          hash_block_tokens,
                                          hash_request_tokens,
)
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue
from jaxserve.core.sampling_params import SamplingParams, SamplingType
from jaxserve.core.sched_output import (
                                          CachedRequestData,
                                          EngineCoreOutput,
                                          ModelRunnerOutput,
                                          NewRequestData,
                                          SchedulerOutput,
)
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.core.stats import PrefixCacheStats, SchedulerStats, SpecDecodingStats

__all__ = [
    "BlockHash", "BlockPool", "CachedRequestData", "EngineCoreOutput", "FCFSRequestQueue",
    "FreeKVCacheBlockQueue", "FullAttentionSpec", "HybridKVCacheCoordinator", "HybridKVCacheManager",
    "KVCacheBlock", "KVCacheConfig", "KVCacheGroupSpec", "KVCacheManager", "KVCacheSpec",
    "SlidingWindowSpec", "get_kv_cache_config", "get_kv_cache_groups", "ModelRunnerOutput",
    "NewRequestData", "PrefixCacheStats", "PriorityRequestQueue", "Request", "RequestStatus",
    "SamplingParams", "SamplingType", "Scheduler", "SchedulerConfig", "SchedulerOutput",
    "SchedulerStats", "SpecDecodingStats", "create_request_queue", "generate_block_hash_extra_keys",
    "hash_block_tokens", "hash_request_tokens",
]
