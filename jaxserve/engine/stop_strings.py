"""Stop strings over streamed text: find a match anywhere in the new text, and hold back a tail
that might still grow into one, so a client never sees half of a stop string.

``StopMatcher`` does both for one sequence in time that grows with the new text, not with the
number and length of the stop strings: a match must end in the new text, so only the stops whose
last character is a new character are compared (in C, by ``str.startswith``); the held-back tail
is tracked as the set of positions whose suffix still starts some stop, a set that only loses
members as text arrives, each checked by one bisection over the sorted stops. ``find_stop`` and
``partial_stop_len`` are the plain definitions it must agree with.
"""

from __future__ import annotations

import bisect


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string starting at or after ``search_from``; ``(index, stop)`` or None."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, search_from))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class StopMatcher:
    """The stop strings of one sequence whose text only grows (``text`` passed to each call
    extends the one before; a shorter one starts over).

    Invariant: ``_live`` holds, ascending, every position ``i < _scanned`` of the text such that
    ``text[i:_scanned]`` is a proper prefix of some stop string.
    """

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self._by_last: dict[str, list[str]] = {}
        for stop in dict.fromkeys(self.stops):
            self._by_last.setdefault(stop[-1], []).append(stop)
        self._sorted = sorted(set(self.stops))
        self._first_chars = frozenset(stop[0] for stop in self.stops)
        self._live: list[int] = []
        self._scanned = 0

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """Earliest-starting stop string that ends in ``text[new_from:]``: text before
        ``new_from`` was searched already and is never matched on its own."""
        best: tuple[int, str] | None = None
        by_last = self._by_last
        for end in range(max(0, new_from), len(text)):
            for stop in by_last.get(text[end], ()):
                start = end + 1 - len(stop)
                if start >= 0 and (best is None or start < best[0]) and text.startswith(stop, start):
                    best = (start, stop)
        return best

    def partial_len(self, text: str) -> int:
        """``partial_stop_len(text, stops)``, updated from the text added since the last call."""
        if len(text) < self._scanned:
            self._live, self._scanned = [], 0
        first_chars = self._first_chars
        candidates = self._live + [i for i in range(self._scanned, len(text)) if text[i] in first_chars]
        self._live = [i for i in candidates if self._starts_a_longer_stop(text[i:])]
        self._scanned = len(text)
        return len(text) - self._live[0] if self._live else 0

    def _starts_a_longer_stop(self, tail: str) -> bool:
        # Stops that start with ``tail`` and are longer sort right after it.
        j = bisect.bisect_right(self._sorted, tail)
        return j < len(self._sorted) and self._sorted[j].startswith(tail)
