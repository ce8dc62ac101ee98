"""Engine configuration: sub-configurations, one per file, composed into ``EngineConfig``
(:mod:`.engine`), validated once each, and surfaced one-to-one as flat CLI flags (:mod:`.flags`)
with vLLM's names.

``from jaxserve.config import EngineConfig`` and ``EngineConfig(model=..., max_num_seqs=...)``
are the entry points; ``config.scheduler_config`` and the other sub-configurations are the parts.
"""

from __future__ import annotations

from jaxserve.config.base import SubConfig
from jaxserve.config.cache import KV_CACHE_DTYPES, CacheConfig
from jaxserve.config.compilation import ATTENTION_BACKENDS, CompilationConfig
from jaxserve.config.engine import EngineConfig, sub_config
from jaxserve.config.flags import CLI_SHORT_FLAGS, Flag, add_flags, dataclass_flags, flags_for
from jaxserve.config.limits import LimitsConfig
from jaxserve.config.load import LoadConfig
from jaxserve.config.lora import LoRAConfig
from jaxserve.config.observability import ObservabilityConfig
from jaxserve.config.parallel import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, ParallelConfig
from jaxserve.config.pooling import PoolingConfig
from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.config.speculative import SpecDecodeConfig, SpeculativeConfig
from jaxserve.config.structured_outputs import REASONING_PARSERS, StructuredOutputsConfig

__all__ = [
    "ATTENTION_BACKENDS", "CLI_SHORT_FLAGS", "DEFAULT_MASTER_ADDR", "DEFAULT_MASTER_PORT",
    "KV_CACHE_DTYPES", "REASONING_PARSERS", "CacheConfig", "CompilationConfig", "EngineConfig", "Flag",
    "LimitsConfig", "LoadConfig", "LoRAConfig", "ObservabilityConfig", "ParallelConfig", "PoolingConfig",
    "SchedulerConfig", "SpecDecodeConfig", "SpeculativeConfig",
    "StructuredOutputsConfig", "SubConfig", "add_flags", "dataclass_flags", "flags_for", "sub_config",
]
