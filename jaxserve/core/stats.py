"""Counters the core exposes for logging, /metrics and notebooks (cumulative unless noted)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since start (or the last ``reset_prefix_cache``).

    ``queries`` counts tokens looked up (a request's ``num_tokens`` at lookup), ``hits`` the tokens
    found cached; hit rate = hits / queries.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    num_resets: int = 0

    def record(self, num_tokens: int, num_hits: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SchedulerStats:
    """Snapshot after a ``schedule()`` call. ``num_scheduled_tokens``/``num_preempted_reqs`` are
    for that step only; the rest are current values or running totals."""

    step: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_scheduled_tokens: int = 0
    num_scheduled_reqs: int = 0
    num_preempted_reqs: int = 0
    num_preemptions: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    prefix_cache_requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_finished_reqs: int = 0
    # Speculative decoding's running totals (None: off); a copy, so a kept snapshot stays as it was.
    spec_decoding: SpecDecodingStats | None = None
    # LoRA (max_loras > 0): requests per adapter name, running and waiting (vLLM's LoRAStats).
    max_loras: int = 0
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)


@dataclass
class SpecDecodingStats:
    """Speculative decoding since start, as vLLM's ``spec_decode_*`` counters: a draft is one
    request's drafts verified in one step; ``num_accepted_tokens_per_pos[i]`` counts accepted
    drafts at position i. Mean accepted length = 1 + accepted / drafts."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_accepted_tokens:
            per_pos.extend([0] * (num_accepted_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    def copy(self) -> SpecDecodingStats:
        return dataclasses.replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
