"""When each API-entry stage of the request being handled ended: read, templated, tokenized.

The handler starts the record (``start``); code deeper in the same request (the chat template,
the tokenizer) marks its stage without a parameter threaded through every call; the record goes
to the engine with the request, into its timeline (``RequestMetrics``). A context variable is
per asyncio task, so concurrent requests never see each other's record.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Optional

from jaxserve import EntryTimes

_current: ContextVar[Optional[EntryTimes]] = ContextVar("jaxserve_entry_times", default=None)


def start() -> EntryTimes:
    """A new record for the request being handled, received now."""
    times = EntryTimes(received=time.monotonic())
    _current.set(times)
    return times


def mark(stage: str) -> None:
    """Stamp ``stage`` ("templated" or "tokenized") now, if a request is being handled."""
    times = _current.get()
    if times is not None:
        setattr(times, stage, time.monotonic())
