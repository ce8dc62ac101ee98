"""Per-request timelines: every stage a request went through, and why it ended.

A ``RequestTimeline`` is read from the output processor's state of a request (live or finished),
never kept up to date step by step: the times are in its ``RequestMetrics`` (filled as outputs
arrive), the rest is built on demand. ``TimelineStore`` keeps the newest finished requests so a
finished one can still be looked up by id.

Finish causes refine vLLM's finish reasons: ``stop`` is ``eos``, ``stop_token`` or
``stop_string``; ``length`` is ``length``; ``abort`` is ``abort`` (asked for),
``client_disconnect`` (the caller stopped reading the stream) or ``error`` (the engine failed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from jaxserve.core.locked_lru import LockedLRU
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.outputs import RequestMetrics

EOS, STOP_TOKEN, STOP_STRING, LENGTH = "eos", "stop_token", "stop_string", "length"
ABORT, CLIENT_DISCONNECT, ERROR = "abort", "client_disconnect", "error"
FINISH_CAUSES = (EOS, STOP_TOKEN, STOP_STRING, LENGTH, ABORT, CLIENT_DISCONNECT, ERROR)


@dataclasses.dataclass
class EntryTimes:
    """What a server measured before the engine saw a request (``time.monotonic()`` seconds):
    when it read the request, rendered the chat template, and had the prompt's token ids."""

    received: float
    templated: float | None = None
    tokenized: float | None = None
    # The request's W3C trace context (``traceparent``, ``tracestate``): its span continues that trace.
    trace_headers: dict[str, str] | None = None


def finish_cause(finish_reason: str | None, stop_reason: Any) -> str | None:
    """The cause behind a finish reason the core or the stop-string check reported."""
    if finish_reason is None:
        return None
    if finish_reason == "stop":
        if stop_reason is None:
            return EOS
        return STOP_STRING if isinstance(stop_reason, str) else STOP_TOKEN
    if finish_reason == "error":  # the core failed this request alone (a fault of its own)
        return ERROR
    return LENGTH if finish_reason == "length" else ABORT


# A request's stages in order: (name, the RequestMetrics field that ends it). Each starts where
# the one before it ended; the first starts at the receipt (or, offline, the arrival).
STAGES = (("template", "templated_time"), ("tokenize", "tokenized_time"), ("to engine", "queued_time"),
          ("queue", "first_scheduled_time"), ("prefill", "first_token_time"), ("decode", "finished_time"))


def request_span(m: RequestMetrics, now: float) -> tuple[float, float]:
    """(start, end) of a request: its receipt (or arrival) to its finish (or ``now``)."""
    start = m.received_time if m.received_time is not None else m.arrival_time
    return start, (m.finished_time if m.finished_time is not None else now)


def stage_spans(m: RequestMetrics, now: float) -> list[tuple[str, float, float]]:
    """The stages a request went through, as consecutive (name, start, end) inside its span.
    Times read in different threads may be out of order by a hair: they are clamped in order."""
    start, end = request_span(m, now)
    spans, cursor = [], start
    for name, field in STAGES:
        at = getattr(m, field)
        if at is None:
            continue
        at = min(max(at, cursor), end)
        if at > cursor:
            spans.append((name, cursor, at))
        cursor = at
    return spans


@dataclasses.dataclass
class SampleTimeline:
    """One sample (``n`` of them per request)."""

    index: int
    num_output_tokens: int
    finish_reason: str | None
    finish_cause: str | None
    stop_reason: Any
    output_token_ids: list[int] | None = None  # only with record_token_ids


@dataclasses.dataclass
class RequestTimeline:
    """A request's stages, cache hit, preemptions, effective sampling parameters and finish.

    ``sampling_params`` are those the engine ran: after defaults and validation, with the model's
    extra EOS ids among the stop ids and ``max_tokens`` resolved against ``max_model_len``.
    ``num_cached_tokens`` counts prompt tokens served by the prefix cache (full blocks only).
    ``lora_name`` is the LoRA adapter it ran with (None: the base model); ``lora_key`` the
    adapter's prefix-cache key (``name@sha256`` of the weights it was served with).
    """

    request_id: str
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics
    sampling_params: SamplingParams
    max_tokens: int | None
    samples: list[SampleTimeline]
    prompt_token_ids: list[int] | None = None  # only with record_token_ids
    lora_name: str | None = None
    lora_key: str | None = None

    def as_dict(self) -> dict:
        params = {k: v for k, v in dataclasses.asdict(self.sampling_params).items() if not k.startswith("_")}
        params["max_tokens"] = self.max_tokens
        return {
            "request_id": self.request_id, "finished": self.finished,
            "num_prompt_tokens": self.num_prompt_tokens, "num_cached_tokens": self.num_cached_tokens,
            "metrics": self.metrics.as_dict(), "sampling_params": params,
            "samples": [dataclasses.asdict(s) for s in self.samples],
            "prompt_token_ids": self.prompt_token_ids, "lora_name": self.lora_name, "lora_key": self.lora_key,
        }


class TimelineStore:
    """The newest ``capacity`` finished requests' states, by request id (oldest dropped first).

    It holds whatever the output processor finished with (built into a ``RequestTimeline`` on
    read); the engine thread adds, any thread reads.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: LockedLRU[str, Any] = LockedLRU(capacity)

    def add(self, request_id: str, state: Any) -> None:
        self._items.put(request_id, state)

    def get(self, request_id: str) -> Any:
        return self._items.peek(request_id)  # a read does not make a request newer

    def recent(self, limit: int) -> list[Any]:
        """The newest ``limit`` states, oldest first."""
        items = self._items.values()
        return items[-limit:] if limit > 0 else []


def merged_timelines(sources: Iterable[list[RequestTimeline]], limit: int) -> list[RequestTimeline]:
    """Several engines' recent timelines as one list by arrival, the newest ``limit`` of them."""
    timelines = sorted((t for timelines in sources for t in timelines), key=lambda t: t.metrics.arrival_time)
    return timelines[-limit:] if limit else []
