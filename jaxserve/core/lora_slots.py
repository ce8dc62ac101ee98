"""Which adapters sit in the ``max_loras`` device slots (pure Python).

The runner asks :meth:`LoRASlotAssigner.admit` for each adapter of a step: an adapter already in
a slot keeps it; otherwise a free slot is taken, or the least recently used slot whose adapter
no request of the current step uses is reclaimed (``pending_writes`` then names the slot to
load). The scheduler admits at most ``max_loras`` distinct adapters among the running requests
(reason ``lora_slots`` in the step record), so a step never finds every slot taken; ``admit``
still answers None if it did.
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlotAssigner:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._slots: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, least recent first
        self._step: set[str] = set()  # the adapters this step uses
        self.pending_writes: list[tuple[int, str]] = []  # (slot, key) the runner must load before the step

    def begin_step(self) -> None:
        self._step.clear()

    def admit(self, key: str) -> int | None:
        """The slot of adapter ``key`` for this step, or None when it must wait."""
        if key in self._slots:
            self._slots.move_to_end(key)
            self._step.add(key)
            return self._slots[key]
        if len(self._slots) < self.max_loras:
            slot = min(set(range(self.max_loras)) - set(self._slots.values()))
        else:
            victim = next((k for k in self._slots if k not in self._step), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
        self._slots[key] = slot
        self._step.add(key)
        self.pending_writes.append((slot, key))
        return slot

    def slot_of(self, key: str) -> int | None:
        return self._slots.get(key)

    def forget(self, key: str) -> None:
        """An unloaded adapter frees its slot (a reload under the same name has another key)."""
        self._slots.pop(key, None)
        self._step.discard(key)
