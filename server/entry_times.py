"""When each API-entry stage of the request being handled ended: read, templated, tokenized.

The handler starts the record (``start``); code deeper in the same request (the chat template,
the tokenizer) marks its stage without a parameter threaded through every call; the record goes
to the engine with the request, into its timeline (``RequestMetrics``). A context variable is
per asyncio task, so concurrent requests never see each other's record.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextvars import ContextVar

from jaxserve import EntryTimes

_current: ContextVar[EntryTimes | None] = ContextVar("jaxserve_entry_times", default=None)


TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, as vLLM forwards it


def start(headers: Mapping[str, str] | None = None) -> EntryTimes:
    """A new record for the request being handled, received now, with its trace context headers."""
    trace = {k: headers[k] for k in TRACE_HEADERS if headers is not None and k in headers}
    times = EntryTimes(received=time.monotonic(), trace_headers=trace or None)
    _current.set(times)
    return times


def mark(stage: str) -> None:
    """Stamp ``stage`` ("templated" or "tokenized") now, if a request is being handled."""
    times = _current.get()
    if times is not None:
        setattr(times, stage, time.monotonic())
