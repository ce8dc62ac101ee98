"""``ReplicaSet``: M data-parallel engine replicas as one, for ``LLM`` and ``DPAsyncLLM`` alike.

It routes a tokenized request to a replica (the router's policy over each replica's load and
prefix cache, with its own count of the sequences it sent each replica and that have not
finished), and merges what the replicas record (step records, timelines, metrics, stats) into one
view. The front ends keep what differs between them: ``LLM`` steps the engines itself, one thread
each; ``DPAsyncLLM`` streams from one ``AsyncLLM`` per replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxserve.engine.dp.metrics import merge_stats, merged_snapshot, render_merged
from jaxserve.engine.dp.router import hash_for_routing, pick_replica
from jaxserve.engine.step_records import StepRecord, merged_records
from jaxserve.engine.timeline import RequestTimeline, merged_timelines
from jaxserve.engine.trace import build_trace

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.metrics import Metric
    from jaxserve.engine.processor import ProcessedRequest


class ReplicaSet:
    """``engines[i]`` is replica ``i``; ``live_seqs[i]`` the sequences routed to it and not yet
    released. Touched from one thread (the caller's event loop, or ``LLM``'s caller)."""

    def __init__(self, engines: Sequence[LLMEngine]):
        if not engines:
            raise ValueError("a replica set needs at least one engine")
        self.engines = list(engines)
        self.live_seqs = [0] * len(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    # ---- routing -------------------------------------------------------------------------------

    def prepare(self, processed: ProcessedRequest) -> None:
        """With several replicas and prefix caching, hash the prompt's full blocks for the router
        (the scheduler reuses them). Touches no state of the set: an input thread may call it."""
        if len(self.engines) > 1:
            hash_for_routing(processed.core_requests[0], self.engines[0].config)

    def route(self, processed: ProcessedRequest) -> int:
        """The replica that takes ``processed`` (after ``prepare``): the only one, or the router's
        choice."""
        if len(self.engines) == 1:
            return 0
        return pick_replica(self.engines, self.live_seqs, processed.core_requests[0])

    def admit(self, index: int, processed: ProcessedRequest) -> int:
        """Count ``processed``'s sequences on replica ``index``; returns how many."""
        num_seqs = len(processed.core_requests)
        self.live_seqs[index] += num_seqs
        return num_seqs

    def release(self, index: int, num_seqs: int) -> None:
        self.live_seqs[index] -= num_seqs

    def reset_load(self) -> None:
        """Forget the counts (every routed request has finished)."""
        self.live_seqs = [0] * len(self.engines)

    # ---- one view of all replicas --------------------------------------------------------------

    def get_step_records(self, limit: int | None = None) -> list[StepRecord]:
        """The newest ``limit`` step records of all replicas, oldest first (by start)."""
        return merged_records((e.get_step_records(limit) for e in self.engines), limit)

    def get_request_timeline(self, request_id: str) -> RequestTimeline | None:
        return next((t for e in self.engines if (t := e.get_request_timeline(request_id)) is not None), None)

    def recent_request_timelines(self, limit: int = 100) -> list[RequestTimeline]:
        """The newest ``limit`` over all replicas, by arrival."""
        return merged_timelines((e.recent_request_timelines(limit) for e in self.engines), limit)

    def build_trace(self, num_steps: int | None = None, num_requests: int = 100) -> dict:
        """A Chrome/Perfetto trace of the newest steps (all replicas) and requests."""
        return build_trace(self.get_step_records(num_steps), self.recent_request_timelines(num_requests))

    def render_metrics(self) -> bytes:
        """Every replica's samples (label ``engine``) and their totals (``engine="total"``)."""
        return render_merged([e.metrics.registry for e in self.engines])

    def metrics_snapshot(self) -> list[Metric]:
        return merged_snapshot([e.metrics.snapshot() for e in self.engines])

    def merged_stats(self) -> dict:
        """Totals over the replicas, and each replica's own under ``engines``."""
        return merge_stats([e.stats() for e in self.engines])
