"""Joining the hosts: ``jax.distributed.initialize`` with the engine's node settings.

It must run before anything starts a JAX backend (even ``jax.devices()``), so the engine calls
it first. Two settings are made before it:

- CPU devices use gloo for their cross-process collectives (XLA:CPU has none by default);
- recoverability is on, so that a host which stops does not make the coordination service
  terminate every other process: rank 0 must live on to fail its requests and answer ``/health``
  with 503 (see :mod:`.liveness`).
"""

from __future__ import annotations

import logging
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.exceptions import ConfigError

logger = logging.getLogger("jaxserve")


def start_distributed_runtime(config: EngineConfig) -> None:
    """Join the ``config.nnodes`` processes (rank ``config.node_rank``) at the coordinator; returns
    once all have joined, or raises after JAX's initialization timeout. Idempotent."""
    import jax

    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    address = config.coordinator_address()
    logger.info("node %d of %d: joining the coordinator at %s", config.node_rank, config.nnodes, address)
    jax.distributed.initialize(coordinator_address=address, num_processes=config.nnodes,
                               process_id=config.node_rank,
                               heartbeat_timeout_seconds=config.node_heartbeat_timeout_s)
    logger.info("node %d of %d joined: %d devices here, %d in all", config.node_rank, config.nnodes,
                jax.local_device_count(), jax.device_count())


def node_devices(config: EngineConfig) -> list[Any]:
    """The mesh of a multi-node engine: ``tensor_parallel_size / nnodes`` devices of every host,
    host by host (so each host holds an equal share of every sharded weight). Every rank computes
    the same list."""
    import jax

    per_host = config.tensor_parallel_size // config.nnodes
    by_host: dict[int, list[Any]] = {}
    for device in jax.devices():
        by_host.setdefault(device.process_index, []).append(device)
    for rank in range(config.nnodes):
        have = len(by_host.get(rank, []))
        if have < per_host:
            raise ConfigError(f"tensor_parallel_size: {config.tensor_parallel_size} over {config.nnodes} nodes needs "
                              f"{per_host} devices on each, node {rank} has {have}")
    return [d for rank in range(config.nnodes) for d in sorted(by_host[rank], key=lambda d: d.id)[:per_host]]


def coordination_client() -> Any:
    """The distributed runtime's client (its key-value store and liveness queries). JAX exposes
    it only as ``jax._src.distributed.global_state.client``; ``multihost_utils`` reads it there too."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("the distributed runtime is not started (start_distributed_runtime first)")
    return client
