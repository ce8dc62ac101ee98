"""Noticing a lost host within a bounded time, on rank 0, without help from the lost host.

Every follower sets its own key in the store (``{namespace}/alive/{rank}``) to a new count every
:data:`HEARTBEAT_INTERVAL_S`, from a thread of its own; rank 0 reads all of them at most every
:data:`CHECK_INTERVAL_S` and declares lost a follower whose count has not changed for
``timeout_s``. A killed host and a hung one (stopped, swapped out) both stop counting.

Beside the count, a follower's key carries its step progress: how many of rank 0's control
messages it has applied. A follower whose heartbeat thread runs while its main thread is stuck
outside a collective (a deadlock, a call that never returns) counts on but makes no progress:
rank 0 declares it lost when it is behind the messages rank 0 published and its progress has not
moved for ``timeout_s`` (the step-progress watchdog).

Why not the coordination service's own detection: by default it terminates every process when
one stops (rank 0 would take the API server down with it), and with recoverability on, its
``get_live_nodes`` is a barrier that only returns once every live process calls it, which a
follower stuck in a step never does.

Rank 0 waits for a step's tokens by polling the array (:meth:`NodeMonitor.wait_ready`), so a
collective stuck on a lost peer never blocks it for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from jaxserve.distributed.channel import NAMESPACE
from jaxserve.exceptions import NodeLostError

HEARTBEAT_INTERVAL_S = 0.5
CHECK_INTERVAL_S = 0.25
# Polling a step's output: the first waits are short (a decode step takes milliseconds).
_FIRST_POLL_S = 20e-6
_LONGEST_POLL_S = 1e-3


class Heartbeat:
    """A follower's proof of life: a daemon thread bumping its key until the store is gone."""

    def __init__(self, client: Any, rank: int, interval_s: float = HEARTBEAT_INTERVAL_S,
                 namespace: str = NAMESPACE, progress: Callable[[], int] | None = None):
        """``progress``: the control messages this follower has applied (read by the beat thread;
        may be set once the follower exists)."""
        self.client = client
        self.progress = progress
        self.key = f"{namespace}/alive/{rank}"
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxserve-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        count = 0
        while not self._stop.is_set():
            try:
                progress = 0 if self.progress is None else self.progress()
                self.client.key_value_set(self.key, f"{count}/{progress}", allow_overwrite=True)
            except Exception:  # noqa: BLE001 - rank 0's service is gone: the main loop notices and says so
                return
            count += 1
            self._stop.wait(self.interval_s)


class NodeMonitor:
    """Rank 0's view of the followers' heartbeats. ``check`` raises :class:`NodeLostError` naming
    the first follower whose count has not moved for ``timeout_s``; every follower counts as
    seen when the monitor starts."""

    def __init__(self, client: Any, nnodes: int, timeout_s: float, namespace: str = NAMESPACE,
                 clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.nnodes = nnodes
        self.timeout_s = timeout_s
        self.prefix = f"{namespace}/alive/"
        self.clock = clock
        now = clock()
        self._last_value: dict[int, str] = {}
        self._last_seen = {rank: now for rank in range(1, nnodes)}
        self.published = 0  # control messages rank 0 has published (note_published)
        self._progress = {rank: 0 for rank in range(1, nnodes)}
        self._progress_seen = {rank: now for rank in range(1, nnodes)}  # last moved, or last caught up
        self._next_check = now
        self.lost: NodeLostError | None = None

    def check(self, force: bool = False) -> None:
        """Raise :class:`NodeLostError` if a follower is lost (or was, once: the loss is final).
        Reads the store at most every :data:`CHECK_INTERVAL_S` unless ``force``."""
        if self.lost is not None:
            raise self.lost
        now = self.clock()
        if not force and now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        try:
            values = dict(self.client.key_value_dir_get(self.prefix))
        except Exception as exc:  # the service runs in this very process: should never happen
            self.lost = NodeLostError(f"the coordination service stopped answering: {exc}")
            raise self.lost from exc
        for rank in self._last_seen:
            value = values.get(self.prefix + str(rank))
            if value is not None and value != self._last_value.get(rank):
                self._last_value[rank] = value
                self._last_seen[rank] = now
            elif now - self._last_seen[rank] > self.timeout_s:
                self.lost = NodeLostError(
                    f"node {rank} of {self.nnodes} sent no heartbeat for {now - self._last_seen[rank]:.1f} s "
                    f"(the limit is {self.timeout_s:g} s): it died or hangs; restart every node")
                raise self.lost
            self._check_progress(rank, value, now)

    def note_published(self) -> None:
        """Rank 0 published one more control message: every follower must apply it."""
        self.published += 1

    def _check_progress(self, rank: int, value: str | None, now: float) -> None:
        progress = int(value.partition("/")[2] or 0) if value is not None else 0
        if progress != self._progress[rank] or progress >= self.published:
            self._progress[rank] = progress
            self._progress_seen[rank] = now
        elif now - self._progress_seen[rank] > self.timeout_s:
            self.lost = NodeLostError(
                f"node {rank} of {self.nnodes} beats but applied no control message for "
                f"{now - self._progress_seen[rank]:.1f} s (at message {progress} of {self.published}; the limit "
                f"is {self.timeout_s:g} s): it is stuck outside a collective; restart every node")
            raise self.lost

    def wait_ready(self, array: Any) -> None:
        """Return once ``array`` (a step's output) is computed; raise :class:`NodeLostError` if a
        follower is lost meanwhile."""
        delay = _FIRST_POLL_S
        while not array.is_ready():
            self.check()
            time.sleep(delay)
            delay = min(2 * delay, _LONGEST_POLL_S)

    def explain(self, exc: BaseException) -> NodeLostError | None:
        """After a step failed with ``exc`` (a collective whose peer went away), wait up to
        ``timeout_s`` for a follower to count as lost; that loss, or None if all still beat."""
        deadline = self.clock() + self.timeout_s + CHECK_INTERVAL_S
        while True:
            try:
                self.check(force=True)
            except NodeLostError as lost:
                return lost
            if self.clock() >= deadline:
                return None
            time.sleep(CHECK_INTERVAL_S)
