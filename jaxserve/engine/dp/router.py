"""Which data-parallel replica takes a new request: pure Python, no engine state of its own.

The policy (vLLM's DP load balancing, plus prefix awareness):

1. the replica whose prefix cache already holds the most leading full blocks of the prompt
   (computing them again elsewhere costs a prefill; a conversation's follow-ups land where its
   earlier turns are cached);
2. then the least loaded: fewest requests waiting + running (those routed but not yet scheduled
   count too, so a burst spreads before any step ran);
3. then the lowest KV cache usage;
4. then the lowest index (deterministic).

Cached blocks are counted by the replica's own ``KVCacheManager.get_computed_blocks`` over the
request's block hash chain, so a hit here is a hit there (until evicted).

What the router reads of a replica (``replica_load``) is plain Python state of its scheduler, read
from the caller's thread. The reads race with the replica's loop thread and may be a step old;
single dict lookups and int reads are atomic under the GIL, so the worst case is a slightly stale
routing choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.core.request import Request
    from jaxserve.engine.llm_engine import LLMEngine


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it when a request arrives.

    ``num_waiting``/``num_running``: sequences (a request with ``n`` samples counts ``n``);
    ``kv_cache_usage`` in [0, 1]; ``cached_blocks``: leading full blocks of this request's prompt
    in the replica's prefix cache.
    """

    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    cached_blocks: int = 0

    @property
    def num_requests(self) -> int:
        return self.num_waiting + self.num_running


def routing_key(load: ReplicaLoad) -> tuple:
    """Smaller is better: most cached blocks, then fewest requests, then least KV usage."""
    return (-load.cached_blocks, load.num_requests, load.kv_cache_usage)


def choose_replica(loads: Sequence[ReplicaLoad]) -> int:
    """Index of the replica that takes the request (ties go to the lowest index)."""
    if not loads:
        raise ValueError("no replica to route to")
    return min(range(len(loads)), key=lambda i: (routing_key(loads[i]), i))


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
    """The index of the replica that takes ``request`` (the policy above)."""
    return choose_replica([replica_load(e, n, request) for e, n in zip(engines, live_seqs)])
