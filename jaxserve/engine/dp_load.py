"""What the data-parallel router reads of a replica: its load and its prefix cache, both plain
Python state of the replica's scheduler, read from the caller's thread.

The reads race with the replica's loop thread and may be a step old; single dict lookups and int
reads are atomic under the GIL, so the worst case is a slightly stale routing choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxserve.engine.dp_router import ReplicaLoad, choose_replica

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.core.request import Request
    from jaxserve.engine.llm_engine import LLMEngine


def hash_for_routing(request: Request, config: EngineConfig) -> None:
    """With prefix caching, compute the request's block hashes now (off the engine thread); the
    scheduler reuses them."""
    if config.enable_prefix_caching:
        request.init_block_hashes(config.block_size)


def replica_load(engine: LLMEngine, live_seqs: int, request: Request) -> ReplicaLoad:
    """The replica's load for ``request``. ``live_seqs``: sequences routed to it and not finished
    (the router's own count, ahead of the scheduler's between steps); those the scheduler does not
    run yet count as waiting."""
    core = engine.core
    kv = core.scheduler.kv_cache_manager
    running = core.last_stats.num_running_reqs
    cached = kv.get_computed_blocks(request, record_stats=False)[1] // kv.block_size  # any KV groups
    return ReplicaLoad(num_waiting=max(0, live_seqs - running), num_running=running,
                       kv_cache_usage=kv.usage, cached_blocks=cached)


def pick_replica(engines: Sequence[LLMEngine], live_seqs: Sequence[int], request: Request) -> int:
    """The index of the replica that takes ``request`` (``dp_router``'s policy)."""
    return choose_replica([replica_load(e, n, request) for e, n in zip(engines, live_seqs)])
