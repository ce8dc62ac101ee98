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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


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

