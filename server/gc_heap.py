"""Keep the garbage collector's full passes short in a process that serves for its whole life."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move every object alive now out of the collector's reach.

    After start-up the heap holds hundreds of thousands of long-lived objects (JAX, transformers,
    the engine), and each full collection walks them all, landing on whichever step triggers
    it. Frozen, they are skipped, and a full pass scans only what serving allocates; vLLM's
    engine process does the same after start-up. Only for a process that keeps its engine to
    the end (``serve``): a frozen object that later becomes cyclic garbage is never collected.
    """
    gc.collect()
    gc.freeze()
