"""Checks that a Chrome-trace JSON object is well formed and its spans nest, for the engine and
server tests of ``jaxserve.engine.trace``."""

from __future__ import annotations

import json
from collections import defaultdict

# Rounding of microsecond timestamps: a child may end this much past its parent.
TOLERANCE_US = 0.01


def check_chrome_trace(trace: dict) -> dict[tuple[int, int], list[dict]]:
    """Assert the format (round-trips through JSON; every event has the fields its phase needs)
    and the nesting (on each track, complete events are disjoint or contained). Returns the
    complete events per (pid, tid), sorted by start."""
    trace = json.loads(json.dumps(trace))  # plain JSON types only
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    tracks: dict[tuple[int, int], list[dict]] = defaultdict(list)
    names: dict[tuple[int, int | None], str] = {}
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "i", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str)
            names[(e["pid"], e.get("tid"))] = e["args"]["name"]
            continue
        assert isinstance(e["tid"], int) and isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            tracks[(e["pid"], e["tid"])].append(e)
    for (pid, tid), events in tracks.items():
        assert (pid, None) in names and (pid, tid) in names, f"track {(pid, tid)} has no name"
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []  # ends of the open spans
        for e in events:
            while stack and stack[-1] <= e["ts"] + TOLERANCE_US:
                stack.pop()
            end = e["ts"] + e["dur"]
            if stack:
                assert end <= stack[-1] + TOLERANCE_US, f"{e} overlaps its enclosing span on track {(pid, tid)}"
            stack.append(end)
    return dict(tracks)
