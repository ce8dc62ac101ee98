"""Stop strings over streamed text: find a match anywhere in the new text, and hold back a tail
that might still grow into one, so a client never sees half of a stop string."""

from __future__ import annotations


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string starting at or after ``search_from``; ``(index, stop)`` or None."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, search_from))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def find_new_stop(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in ``text[new_from:]``: each stop is searched from where it
    could first straddle ``new_from``, so text before it is never matched on its own."""
    hits = [hit for stop in stops if (hit := find_stop(text, [stop], new_from - len(stop) + 1)) is not None]
    return min(hits, key=lambda hit: hit[0], default=None)


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
