"""``StepClock``: the wall-clock phases of one engine step, timed by context managers, so the
pipelined and the unpipelined step share one skeleton and one way of timing it."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator


class StepClock:
    """``start``: when the step began; ``last``: when the latest phase ended; ``seconds``: the time
    spent in each named phase (a phase entered twice adds up)."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.last = time.monotonic()
            self.seconds[name] += self.last - began
