"""Chrome/Perfetto trace JSON of the engine's recent work (open it in ui.perfetto.dev or
chrome://tracing).

Process 1, "engine": a ``host`` track (each step's schedule and prepare, then its collect and
update) and a ``device`` track (each step from launch to its results). Process 2, "requests":
one track per request, a span from its receipt to its finish with its stages inside, in order
(template, tokenize, to engine, queue, prefill, decode), and an instant event per preemption.

Nesting holds by construction: on every track, two complete events are either disjoint or one
contains the other. Timestamps are microseconds from the earliest time in the trace.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from jaxserve.engine.step_records import StepRecord
from jaxserve.engine.timeline import RequestTimeline, request_span, stage_spans

ENGINE_PID, REQUESTS_PID = 1, 2
HOST_TID, DEVICE_TID = 1, 2


class _Events:
    """Collects events with times converted to microseconds since ``origin``."""

    def __init__(self, origin: float):
        self.origin = origin
        self.items: list[dict] = []

    def us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def span(self, pid: int, tid: int, name: str, start: float, end: float, args: dict | None = None) -> None:
        ts = self.us(start)
        self.items.append({"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts,
                           "dur": max(0.0, round(self.us(end) - ts, 3)), "args": args or {}})

    def instant(self, pid: int, tid: int, name: str, at: float, args: dict | None = None) -> None:
        self.items.append({"ph": "i", "s": "t", "pid": pid, "tid": tid, "name": name, "ts": self.us(at),
                           "args": args or {}})

    def name(self, pid: int, tid: int | None, name: str) -> None:
        kind = "process_name" if tid is None else "thread_name"
        event = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
        if tid is not None:
            event["tid"] = tid
        self.items.append(event)


def _step_args(r: StepRecord) -> dict:
    s = r.schedule
    return {"scheduled_requests": len(s.scheduled), "prefill_tokens": s.num_prefill_tokens,
            "decode_tokens": s.num_decode_tokens, "token_bucket": r.token_bucket,
            "padding_ratio": round(r.padding_ratio, 4), "waiting": s.num_waiting,
            "waiting_reason": s.waiting_reason, "preempted": s.preempted_ids,
            "blocks_used": s.num_blocks_used, "blocks_cached_free": s.num_blocks_cached_free,
            "blocks_free": s.num_blocks_free, "backend": r.backend, "compiled": r.compiled,
            "decode_only": r.decode_only, "idle_gap_ms": round(1e3 * r.idle_gap_s, 3),
            "lora_adapters": sorted({k.split("@")[0] for k in s.lora_adapters.values()}),
            "spec_draft_tokens": r.num_draft_tokens, "spec_auto_off": r.spec_auto_off,
            "sync_reason": r.sync_reason,
            **({} if r.expert_load is None else {"expert_load": r.expert_load})}


def _add_step(ev: _Events, r: StepRecord) -> None:
    first_half_end = max(r.dispatched, r.start)
    ev.span(ENGINE_PID, HOST_TID, f"step {r.step}: schedule+prepare", r.start, first_half_end, _step_args(r))
    ev.span(ENGINE_PID, HOST_TID, "schedule", r.start, min(r.start + r.schedule_s, first_half_end))
    ev.span(ENGINE_PID, HOST_TID, "prepare", min(r.start + r.schedule_s, first_half_end), first_half_end)
    if r.end > r.collect_start:
        ev.span(ENGINE_PID, HOST_TID, f"step {r.step}: collect+update", r.collect_start, r.end,
                {"wait_ms": round(1e3 * r.wait_s, 3), "update_ms": round(1e3 * r.update_s, 3),
                 "finished": r.finished, "spec_accepted_tokens": r.num_accepted_tokens,
                 "spec_drafts": r.spec_drafts, "spec_accepted": r.spec_accepted})
    if r.device_s > 0:
        ev.span(ENGINE_PID, DEVICE_TID, f"step {r.step}", r.device_end - r.device_s, r.device_end,
                {"tokens": r.num_tokens, "token_bucket": r.token_bucket})


def _add_request(ev: _Events, tid: int, t: RequestTimeline, preemptions: list[float], now: float) -> None:
    m = t.metrics
    start, end = request_span(m, now)
    ev.name(REQUESTS_PID, tid, f"request {t.request_id}")
    ev.span(REQUESTS_PID, tid, f"request {t.request_id}", start, end, {
        "prompt_tokens": t.num_prompt_tokens, "cached_tokens": t.num_cached_tokens,
        "output_tokens": [s.num_output_tokens for s in t.samples],
        "finish": [f"{s.finish_reason} ({s.finish_cause})" for s in t.samples if s.finish_reason],
        "preemptions": m.num_preemptions, "lora": t.lora_name})
    for stage, stage_start, stage_end in stage_spans(m, now):
        ev.span(REQUESTS_PID, tid, stage, stage_start, stage_end)
    for at in preemptions:
        if start <= at <= end:
            ev.instant(REQUESTS_PID, tid, "preempted", at)


def build_trace(steps: Iterable[StepRecord], timelines: Iterable[RequestTimeline],
                now: float | None = None) -> dict:
    """The trace of these steps and requests as a Chrome-trace JSON object."""
    steps, timelines = list(steps), list(timelines)
    now = time.monotonic() if now is None else now
    starts = [r.start for r in steps] + [request_span(t.metrics, now)[0] for t in timelines]
    ev = _Events(min(starts) if starts else now)
    ev.name(ENGINE_PID, None, "engine")
    ev.name(ENGINE_PID, HOST_TID, "host")
    ev.name(ENGINE_PID, DEVICE_TID, "device")
    ev.name(REQUESTS_PID, None, "requests")
    preempted: dict[str, list[float]] = {}
    for r in steps:
        _add_step(ev, r)
        for rid in r.preempted_ids:
            preempted.setdefault(rid, []).append(r.start)
    for tid, t in enumerate(timelines, start=1):
        # n > 1: the core ids of the samples are "<index>_<request id>".
        times = preempted.get(t.request_id, []) + [
            at for s in t.samples for at in preempted.get(f"{s.index}_{t.request_id}", [])]
        _add_request(ev, tid, t, sorted(times), now)
    return {"traceEvents": ev.items, "displayTimeUnit": "ms",
            "otherData": {"clock": "monotonic", "origin_s": ev.origin}}
