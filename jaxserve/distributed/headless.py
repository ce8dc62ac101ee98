"""A rank > 0 of a multi-node engine: no API server, no scheduler work, no detokenizing.

``run_headless(config)`` joins the hosts, builds the same engine core as rank 0 (the same model
shards, the same compiled steps, warmed up in the same order), then replays rank 0's runner
calls until rank 0 says stop (returns) or vanishes (raises ``NodeLostError``). vLLM calls such a
node headless too (``vllm serve --headless``).
"""

from __future__ import annotations

import logging

from jaxserve.config import EngineConfig

logger = logging.getLogger("jaxserve")


def run_headless(config: EngineConfig, *, show_progress: bool = True) -> int:
    """Follow rank 0 until it stops; returns the number of steps run."""
    from jaxserve.distributed.channel import ControlChannel
    from jaxserve.distributed.liveness import Heartbeat
    from jaxserve.distributed.lockstep import LockstepFollower
    from jaxserve.distributed.runtime import coordination_client, start_distributed_runtime
    from jaxserve.engine.engine_core import EngineCore

    if not config.is_multi_node or config.node_rank == 0:
        raise ValueError(f"node_rank: a headless node has rank 1 to nnodes - 1, got {config.node_rank} "
                         f"with nnodes={config.nnodes}")
    start_distributed_runtime(config)
    client = coordination_client()
    heartbeat = Heartbeat(client, config.node_rank).start()  # beats while the model loads and compiles
    try:
        core = EngineCore(config, show_progress=show_progress)
        follower = LockstepFollower(core.runner, ControlChannel(client, config.node_rank, config.nnodes))
        heartbeat.progress = lambda: follower.messages_applied
        logger.info("node %d of %d ready: following rank 0 at %s", config.node_rank, config.nnodes,
                    config.coordinator_address())
        follower.run()
    finally:
        heartbeat.stop()
    # Leave the coordination service before rank 0 stops it: a client that finds the service gone
    # terminates its process.
    import jax

    jax.distributed.shutdown()
    logger.info("node %d of %d: rank 0 stopped; %d steps run", config.node_rank, config.nnodes, follower.steps)
    return follower.steps
