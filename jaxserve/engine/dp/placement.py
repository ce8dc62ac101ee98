"""Which devices each data-parallel replica runs on, and the replicas' engines started there:
replica ``i`` gets devices ``[i*N, (i+1)*N)`` with ``N = tensor_parallel_size``, checked before
any weight is loaded."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.exceptions import ConfigError

logger = logging.getLogger("jaxserve")


def replica_device_groups(config: EngineConfig, devices: Sequence[Any] | None = None) -> list[list[Any]]:
    """``data_parallel_size`` groups of ``tensor_parallel_size`` devices (JAX's local devices by
    default). Raises ConfigError (a ValueError) naming both sizes when the devices are too few."""
    if devices is None:
        import jax

        devices = jax.local_devices()
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    if dp * tp > len(devices):
        raise ConfigError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} devices, "
                          f"but only {len(devices)} are available (on a CPU, "
                          "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N of them)")
    return [list(devices[i * tp:(i + 1) * tp]) for i in range(dp)]


def start_replica_engines(config: EngineConfig, *, served_model_name: str | None = None,
                          show_progress: bool = True, record_steps: bool = False) -> list[LLMEngine]:
    """One ``LLMEngine`` per device group, replica ``i`` labelled ``engine="i"`` in the metrics.
    The device count is checked before any weight is loaded. Replica ``i`` seeds its RNG with
    ``seed + i``: unseeded requests on different replicas must not draw the same samples.

    The replicas start concurrently, one thread each: loading weights and XLA's compiles release
    the GIL, so M replicas start in about one replica's time where the cores allow. If one fails,
    those that started are shut down and its error is raised."""
    groups = replica_device_groups(config)
    # transformers' lazy module is not thread-safe on first access: resolve the name here, once.
    from transformers import AutoTokenizer  # noqa: F401

    def start(index: int) -> LLMEngine:
        devices = groups[index]
        logger.info("data parallel: starting replica %d of %d on %s", index, len(groups), devices)
        return LLMEngine(config.replace(seed=config.seed + index), show_progress=show_progress,
                         record_steps=record_steps, served_model_name=served_model_name, devices=devices,
                         engine_index=index)

    with concurrent.futures.ThreadPoolExecutor(len(groups), thread_name_prefix="jaxserve-dp-start") as pool:
        futures = [pool.submit(start, i) for i in range(len(groups))]
        concurrent.futures.wait(futures)
    failed = [exc for f in futures if (exc := f.exception()) is not None]
    if failed:
        for future in futures:
            if future.exception() is None:
                future.result().shutdown()
        raise failed[0]
    return [f.result() for f in futures]
