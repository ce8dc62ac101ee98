"""What one ``Scheduler.schedule()`` decided, as plain data: who runs with how many tokens (and
whether those are a prefill chunk or a decode), who waits and why, who was preempted, and the
state of the KV blocks right after.

``record_schedule`` reads the scheduler right after ``schedule()`` returned; the engine adds the
runner's side (bucket, timings) in its own step record.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.sched_output import SchedulerOutput

# Why waiting requests were not admitted in a step (the first one that did not fit decides: the
# queue is served in order, so every request behind it waits for the same reason).
WAIT_TOKEN_BUDGET = "token_budget"  # the step's max_num_batched_tokens were used up
WAIT_MAX_NUM_SEQS = "max_num_seqs"  # the running set is full
WAIT_KV_BLOCKS = "kv_blocks"  # not enough free KV blocks for the next prompt (chunk)
WAIT_PREEMPTION = "preemption"  # this step preempted: it admits no one
WAIT_GRAMMAR = "grammar"  # structured outputs: the grammar is still compiling (WAITING_FOR_FSM)
WAIT_ENCODER_BUDGET = "encoder_budget"  # images: the step's encoder budget (or cache) cannot take its next image
WAIT_LORA_SLOTS = "lora_slots"  # LoRA: max_loras other adapters are in use by the running requests
WAIT_REASONS = (WAIT_TOKEN_BUDGET, WAIT_MAX_NUM_SEQS, WAIT_KV_BLOCKS, WAIT_PREEMPTION, WAIT_GRAMMAR,
                WAIT_ENCODER_BUDGET, WAIT_LORA_SLOTS)
# Waiting ids kept per record (the head of the queue): a long queue would make every record, and
# the ring of them, as long as the queue.
MAX_WAITING_IDS = 256


@dataclass(slots=True)
class ScheduleRecord:
    """Invariants: ``sum(scheduled.values()) == num_scheduled_tokens``; ``prefill_ids`` is a subset
    of ``scheduled``; ``waiting_reason`` is None exactly when ``waiting_ids`` is empty; blocks:
    ``used + free == total`` (the null block excluded) and ``cached_free <= free``;
    ``waiting_ids`` is the head (``MAX_WAITING_IDS`` at most) of ``num_waiting`` waiting requests."""

    step: int
    scheduled: dict[str, int]  # request id -> tokens this step
    prefill_ids: list[str]  # scheduled requests whose tokens are a prefill chunk; the rest decode
    new_request_ids: list[str]  # admitted this step (first time, or resumed after preemption)
    waiting_ids: list[str]  # still waiting after this step was scheduled, in queue order
    num_waiting: int
    waiting_reason: str | None  # one of WAIT_REASONS
    preempted_ids: list[str]
    num_scheduled_tokens: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_cached_free: int  # free, but still holding a prefix-cache hash
    num_blocks_free: int  # includes the cached-free ones
    # LoRA: each scheduled request's adapter key (name@sha256); requests on the base model are absent.
    lora_adapters: dict[str, str] = field(default_factory=dict)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.scheduled[r] for r in self.prefill_ids)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_prefill_tokens


def is_prefill(num_computed_before: int, num_tokens: int, num_prompt_tokens: int) -> bool:
    """A step's tokens are a prefill chunk unless they are one token past the prompt (a decode);
    recomputing a preempted request's outputs counts as prefill."""
    return num_tokens > 1 or num_computed_before < num_prompt_tokens


def record_schedule(scheduler: Any, so: SchedulerOutput) -> ScheduleRecord:
    """Describe the ``schedule()`` call of ``scheduler`` (a ``Scheduler``; not imported here, as
    it imports this module) that returned ``so``; call it before anything else changes the
    scheduler (``update_from_output``, aborts)."""
    requests = scheduler.requests
    prefill = []
    for req_id, n in so.num_scheduled_tokens.items():
        request = requests[req_id]
        # schedule() already booked this step's tokens into num_computed_tokens.
        if is_prefill(request.num_computed_tokens - n, n, request.num_prompt_tokens):
            prefill.append(req_id)
    pool = scheduler.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1
    free = pool.get_num_free_blocks()
    return ScheduleRecord(
        step=scheduler.step_counter, scheduled=dict(so.num_scheduled_tokens), prefill_ids=prefill,
        new_request_ids=[r.req_id for r in so.scheduled_new_reqs],
        waiting_ids=[r.request_id for r in itertools.islice(scheduler.waiting, MAX_WAITING_IDS)],
        num_waiting=len(scheduler.waiting), waiting_reason=scheduler.waiting_reason,
        preempted_ids=sorted(so.preempted_req_ids), num_scheduled_tokens=so.total_num_scheduled_tokens,
        num_blocks_total=total, num_blocks_used=total - free,
        num_blocks_cached_free=pool.num_cached_free_blocks, num_blocks_free=free,
        lora_adapters={r: requests[r].lora_name for r in so.num_scheduled_tokens if requests[r].lora_name})
