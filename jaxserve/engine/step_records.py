"""Per-step records: the scheduler's decisions plus the runner's side of the same step.

A ``StepRecord`` is opened right after ``schedule()`` (the queues and blocks as the scheduler left
them) and closed once the step's tokens are back and applied. With async scheduling step N is
closed during the engine call that dispatches N+1, so records can overlap in time; the device
interval of a step starts no earlier than the previous step's results arrived.

Times are ``time.monotonic()`` seconds (the clock of request timelines too).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable

from jaxserve.core.schedule_record import ScheduleRecord


@dataclasses.dataclass(slots=True)
class StepRecord:
    """One engine step. Invariants: ``start <= dispatched <= collect_start <= device_end <= end``;
    ``seconds == schedule_s + prepare_s + wait_s + update_s`` (the host's engine work for it)."""

    step: int
    schedule: ScheduleRecord
    token_bucket: int  # padded token count of the compiled program (0: nothing ran)
    decode_only: bool  # the decode-only program variant ran
    backend: str  # attention backend
    compiled: bool  # False under enforce_eager
    start: float  # schedule() began
    idle_gap_s: float  # since the previous engine step returned (output processing, waiting for work)
    schedule_s: float
    prepare_s: float = 0.0  # the runner's input building and launch (dispatch)
    dispatched: float = 0.0  # when the launch returned
    collect_start: float = 0.0  # the host began waiting for this step's results
    wait_s: float = 0.0  # the host blocked on this step's results
    device_s: float = 0.0  # from launch (or the previous step's results) to this step's results
    device_end: float = 0.0
    update_s: float = 0.0  # update_from_output
    end: float = 0.0
    sampled: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    finished: dict[str, str] = dataclasses.field(default_factory=dict)  # request id -> finish reason
    engine_index: int = 0  # the data-parallel replica that ran it (vLLM's ``engine`` label)
    encoder_images: int = 0  # images the vision encoder ran on before this step (in prepare_s)
    encoder_s: float = 0.0  # their encoder time, part of prepare_s
    # A MoE model: routed (token, expert) pairs per expert, summed over the layers (real tokens only).
    expert_load: list[int] | None = None
    # Speculative decoding: draft tokens scheduled for verification and accepted, per request id.
    spec_drafts: dict[str, int] = dataclasses.field(default_factory=dict)
    spec_accepted: dict[str, int] = dataclasses.field(default_factory=dict)
    spec_auto_off: str = ""  # the auto-off rule's decision for this step and why ("" without the rule)
    # Async scheduling with speculation: why the step before was collected before this one was
    # scheduled ("verify": it verified drafts; "drafts": this step speculates); "": overlapped.
    sync_reason: str = ""

    # Shortcuts to the scheduler's side, as notebooks read them.
    @property
    def scheduled(self) -> dict[str, int]:
        return self.schedule.scheduled

    @property
    def new_request_ids(self) -> list[str]:
        return self.schedule.new_request_ids

    @property
    def preempted_ids(self) -> list[str]:
        return self.schedule.preempted_ids

    @property
    def waiting_ids(self) -> list[str]:
        return self.schedule.waiting_ids

    @property
    def num_tokens(self) -> int:
        return self.schedule.num_scheduled_tokens

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.num_tokens / self.token_bucket if self.token_bucket else 0.0

    @property
    def kv_cache_usage(self) -> float:
        s = self.schedule
        return s.num_blocks_used / s.num_blocks_total if s.num_blocks_total else 0.0

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.spec_drafts.values())

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.spec_accepted.values())

    @property
    def seconds(self) -> float:
        return self.schedule_s + self.prepare_s + self.wait_s + self.update_s

    def as_dict(self) -> dict:
        s = self.schedule
        return {
            "step": self.step, "engine_index": self.engine_index, "start": self.start, "end": self.end,
            "scheduled": s.scheduled, "prefill_ids": s.prefill_ids, "new_request_ids": s.new_request_ids,
            "num_prefill_tokens": s.num_prefill_tokens, "num_decode_tokens": s.num_decode_tokens,
            "waiting_ids": s.waiting_ids, "num_waiting": s.num_waiting, "waiting_reason": s.waiting_reason,
            "preempted_ids": s.preempted_ids, "lora_adapters": s.lora_adapters,
            "blocks": {"total": s.num_blocks_total, "used": s.num_blocks_used,
                       "cached_free": s.num_blocks_cached_free, "free": s.num_blocks_free},
            "num_tokens": self.num_tokens, "token_bucket": self.token_bucket, "padding_ratio": self.padding_ratio,
            "decode_only": self.decode_only, "backend": self.backend, "compiled": self.compiled,
            "idle_gap_s": self.idle_gap_s, "schedule_s": self.schedule_s, "prepare_s": self.prepare_s,
            "wait_s": self.wait_s, "device_s": self.device_s, "update_s": self.update_s, "seconds": self.seconds,
            "sampled": self.sampled, "finished": self.finished, "expert_load": self.expert_load,
            "encoder_images": self.encoder_images, "encoder_s": self.encoder_s,
            "spec_decode": {"num_draft_tokens": self.num_draft_tokens,
                            "num_accepted_tokens": self.num_accepted_tokens,
                            "drafts": self.spec_drafts, "accepted": self.spec_accepted,
                            "auto_off": self.spec_auto_off, "sync_reason": self.sync_reason},
        }


def last_records(records, limit: int | None) -> list[StepRecord]:
    """The newest ``limit`` records of a ring (all with None), oldest first; safe to call from
    another thread than the one appending (copying a deque holds the GIL throughout)."""
    items = list(records)
    return items if limit is None else items[-limit:] if limit > 0 else []


def merged_records(sources: Iterable[list[StepRecord]], limit: int | None) -> list[StepRecord]:
    """Several engines' records (each oldest first) as one list by start time, then the newest
    ``limit`` as :func:`last_records` takes them."""
    return last_records(heapq.merge(*sources, key=lambda r: r.start), limit)
