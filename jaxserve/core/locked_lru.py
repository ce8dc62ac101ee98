"""``LockedLRU``: a bounded dict shared between threads, the least recently used entry dropped first
(the grammar caches, the finished requests' timelines)."""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LockedLRU(Generic[K, V]):
    """At most ``capacity`` entries (none when it is 0 or less); every call holds one lock."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The entry, now the most recently used; None when absent."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def peek(self, key: K) -> V | None:
        """The entry without refreshing it; None when absent."""
        with self._lock:
            return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > max(0, self.capacity):
                self._items.popitem(last=False)

    def values(self) -> list[V]:
        """Every entry, least recently used first."""
        with self._lock:
            return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)
