"""The pooling side of the engine core: which task a checkpoint serves, and its runner and scheduler.

vLLM's rules, applied here once: a bidirectional encoder (BERT) is never chunked and reads no prefix
cache (every token attends to the whole prompt, so a chunk cannot be computed before the rest is
known), and its token budget is raised to ``max_model_len`` so every prompt fits one step. A causal
decoder is chunked with any pooling type (the pooled state is carried across chunks), but reads the
prefix cache only for LAST pooling: a hit skips the cached tokens' hidden states, which MEAN and CLS
need, while the last token is always computed. Async scheduling is off, as in vLLM: a step's output
ends its requests, so there is nothing to overlap.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.exceptions import ConfigError
from jaxserve.models.pooling_config import resolve_pooler_config, resolve_pooling_task

logger = logging.getLogger("jaxserve")


def pooling_task_for(config: EngineConfig, path: str) -> str | None:
    """The pooling task the checkpoint at ``path`` serves under ``config``'s flags, or None (it generates)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        if config.runner == "pooling" or config.convert in ("embed", "classify"):
            raise ConfigError("runner: a pooling model must be a checkpoint folder (with config.json)")
        return None
    archs = json.loads(config_file.read_text()).get("architectures")
    return resolve_pooling_task(archs, path, config.runner, config.convert)


@dataclasses.dataclass
class PoolingParts:
    runner: Any  # PoolingModelRunner
    scheduler: Scheduler
    max_model_len: int


def max_position_embeddings(path: str) -> int:
    return int(json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings", 2048))


def build_pooling_parts(config: EngineConfig, path: str, task: str, max_model_len: int) -> PoolingParts:
    from jaxserve.engine.kv_cache_setup import make_kv_cache_manager
    from jaxserve.runner.pooling_model_runner import PoolingModelRunner, is_encoder_folder

    if config.is_multi_node or config.tensor_parallel_size > 1:
        raise ConfigError("tensor_parallel_size: a pooling model runs on one device")
    if config.data_parallel_size > 1:
        raise ConfigError("data_parallel_size: a pooling model runs one engine (no replicas yet)")
    if config.enable_lora:
        raise ConfigError("enable_lora: a pooling model serves no LoRA adapters yet")
    pooler = resolve_pooler_config(task, path, config.pooler_config)
    encoder = is_encoder_folder(path)
    caching = config.enable_prefix_caching and not encoder and pooler.pooling_type == "LAST"
    budget = max(config.max_num_batched_tokens, max_model_len) if encoder else config.max_num_batched_tokens
    dtype = "float32" if config.dtype == "auto" else config.dtype  # sentence-transformers' own precision on a CPU
    runner = PoolingModelRunner(config, path, task, pooler, max_model_len, budget, dtype)
    scheduler_config = dataclasses.replace(
        config.scheduler_config.for_scheduler(max_model_len), max_num_batched_tokens=budget,
        enable_chunked_prefill=config.enable_chunked_prefill and not encoder, async_scheduling=False,
        long_prefill_token_threshold=0 if encoder else config.long_prefill_token_threshold)
    kv_manager = (None if encoder else make_kv_cache_manager(
        runner.mc, runner.num_blocks, config.block_size, runner.mc.dtype, max_model_len, budget, caching))
    if kv_manager is not None and len(kv_manager.kv_cache_config.kv_cache_groups) > 1:
        # the pooling runner keeps one block table per request and a KV slot per layer
        raise ConfigError("a pooling model whose layers mix sliding-window and full attention (several KV cache "
                          "groups) is not supported yet")
    scheduler = Scheduler(scheduler_config, kv_manager, num_blocks=runner.num_blocks,
                          block_size=config.block_size, enable_caching=caching)
    logger.info("pooling model (%s, %s pooling, %s): chunked prefill %s, prefix caching %s",
                task, pooler.pooling_type, "encoder" if encoder else "decoder",
                "on" if scheduler_config.enable_chunked_prefill else "off", "on" if caching else "off")
    return PoolingParts(runner, scheduler, max_model_len)
