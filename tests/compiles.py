"""Counting XLA's backend compiles while a block of a test runs: the ground truth behind "no
compile after warm-up" (the runner's own counters could miss a program compiled outside them)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextmanager
def backend_compiles() -> Iterator[list[float]]:
    """A list that gets each backend compile's seconds while the block runs."""
    compiles: list[float] = []

    def count(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
