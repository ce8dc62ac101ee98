"""The scheduler's budget and policy (vLLM's ``SchedulerConfig``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from jaxserve.config.base import SubConfig

if TYPE_CHECKING:
    from jaxserve.core.scheduler import SchedulerConfig as CoreSchedulerConfig


@dataclasses.dataclass
class SchedulerConfig(SubConfig):
    max_num_seqs: int = 256
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step, shared by prefill chunks and decodes."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps to fit the token budget."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill chunk per step (0 = no cap)."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """Order of admission and of preemption victims."""
    async_scheduling: bool = True
    """Schedule and prepare step N+1 while the device runs step N (outputs arrive one step later;
    the same tokens)."""

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise self.bad("max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise self.bad("max_num_batched_tokens", "must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every scheduled request advances by at least one token, so this caps concurrency.
            self.max_num_seqs = self.max_num_batched_tokens
        if self.long_prefill_token_threshold < 0:
            raise self.bad("long_prefill_token_threshold", "must be >= 0")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise self.bad("scheduling_policy", "must be 'fcfs' or 'priority'")

    def for_scheduler(self, max_model_len: int) -> CoreSchedulerConfig:
        """The core scheduler's settings, once the model has fixed ``max_model_len``."""
        from jaxserve.core.scheduler import SchedulerConfig as CoreSchedulerConfig

        return CoreSchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold, policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling)
