"""``LockedLRU``: bounded, least recently used dropped first, reads that refresh or not."""

from __future__ import annotations

import threading

from jaxserve.core.locked_lru import LockedLRU


def test_the_least_recently_used_entry_goes_first():
    lru: LockedLRU[str, int] = LockedLRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now newer than b
    lru.put("c", 3)
    assert (lru.peek("b"), lru.values()) == (None, [1, 3])
    assert lru.peek("a") == 1 and lru.values() == [1, 3]  # peek leaves the order alone
    lru.put("a", 4)
    assert lru.values() == [3, 4] and len(lru) == 2


def test_falsy_values_are_entries_and_capacity_zero_holds_none():
    lru: LockedLRU[str, str] = LockedLRU(1)
    lru.put("ok", "")
    assert lru.get("ok") == "" and lru.get("missing") is None
    empty: LockedLRU[str, int] = LockedLRU(0)
    empty.put("a", 1)
    assert len(empty) == 0 and empty.get("a") is None


def test_threads_never_exceed_the_capacity():
    lru: LockedLRU[int, int] = LockedLRU(8)

    def fill(base: int) -> None:
        for i in range(500):
            lru.put(base + i, i)
            lru.get(base + i // 2)

    threads = [threading.Thread(target=fill, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(lru) == 8
