"""The rows of a hand-built step after which the EAGLE head catches up, shared by the tests of its
catch-up from device outputs (``tests/runner/test_head_catch_up.py``) and of its device proposal
(``tests/runner/test_eagle_on_device.py``). A row is a dict: ``kind`` "verify" (``d`` drafts,
``a`` of them accepted), "final" (a prompt's last chunk from ``start``) or "chunk" (``n`` tokens
from ``start``, not sampling), ``known`` its tokens before the step."""

from __future__ import annotations

import numpy as np


def step_row(q: dict, rng: np.random.Generator) -> tuple[int, int, list[int], list[int], list[int], int]:
    """(first position, token count, drafts, known tokens after the step, tokens the step emits,
    the token after a non-sampling chunk, else 0) for row ``q``."""
    known = q["known"]
    if q["kind"] == "verify":
        d = [int(t) for t in rng.integers(1, 1000, q["d"])]
        out = d[:q["a"]] + [int(rng.integers(1, 1000))]
        while q["a"] < q["d"] and out[-1] == d[q["a"]]:  # a rejection emits another token
            out[-1] = int(rng.integers(1, 1000))
        return len(known) - 1, 1 + q["d"], d, known + out, out, 0
    if q["kind"] == "final":
        out = [int(rng.integers(1, 1000))]
        return q["start"], len(known) - q["start"], [], known + out, out, 0
    start, n = q["start"], q["n"]
    return start, n, [], known, [], known[start + n]
