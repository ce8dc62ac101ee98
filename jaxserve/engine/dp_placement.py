"""Which devices each data-parallel replica runs on: replica ``i`` gets devices ``[i*N, (i+1)*N)``
with ``N = tensor_parallel_size``. Checked before any weight is loaded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from jaxserve.config import EngineConfig
from jaxserve.exceptions import ConfigError


def replica_device_groups(config: EngineConfig, devices: Optional[Sequence[Any]] = None) -> list[list[Any]]:
    """``data_parallel_size`` groups of ``tensor_parallel_size`` devices (JAX's local devices by
    default). Raises ConfigError (a ValueError) naming both sizes when the devices are too few."""
    if devices is None:
        import jax

        devices = jax.local_devices()
    dp = config.data_parallel_size
    # tensor_parallel_size arrives with tensor parallelism; until then every replica has one device.
    tp = getattr(config, "tensor_parallel_size", 1)
    if dp * tp > len(devices):
        raise ConfigError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} devices, "
                          f"but only {len(devices)} are available (on a CPU, "
                          "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N of them)")
    return [list(devices[i * tp:(i + 1) * tp]) for i in range(dp)]
