"""The control channel: rank 0's runner calls, in order, through the coordination service's
key-value store.

Why the store and not a collective (``multihost_utils.broadcast_one_to_all``): a broadcast is a
device program every rank must enter together with the same shape, so an idle rank 0 would have
to keep broadcasting "nothing", messages would be padded to a few fixed sizes, and a follower
waiting in it could not give up after a timeout. The store takes any bytes at any time, a
follower's wait is a bounded ``blocking_key_value_get_bytes``, and no device time is spent.

Message ``n`` lives under ``{namespace}/calls/{n}``. Each follower acknowledges the last one it
read (``{namespace}/ack/{rank}``); rank 0 deletes what every follower has read, so the store
holds at most a few messages.
"""

from __future__ import annotations

import time
from typing import Any

from jaxserve.distributed.messages import RunnerCall, decode_calls, encode_calls

NAMESPACE = "jaxserve/runner"
# Rank 0 reads the followers' acknowledgements and deletes read messages this often.
PRUNE_EVERY = 64


def is_timeout(exc: BaseException) -> bool:
    """True for a store wait that ran out of time (anything else: the service is unreachable)."""
    return "DEADLINE_EXCEEDED" in str(exc)


class ControlChannel:
    """One per process; rank 0 publishes, the others receive, each message exactly once and in
    order. ``client``: the distributed runtime's client."""

    def __init__(self, client: Any, rank: int, nnodes: int, namespace: str = NAMESPACE):
        self.client = client
        self.rank = rank
        self.nnodes = nnodes
        self.namespace = namespace
        self.next_seq = 0  # the next message to publish (rank 0) or to read (the others)
        self._pruned = 0  # messages below this are deleted

    def _key(self, seq: int) -> str:
        return f"{self.namespace}/calls/{seq}"

    def publish(self, calls: list[RunnerCall]) -> None:
        self.client.key_value_set_bytes(self._key(self.next_seq), encode_calls(calls))
        self.next_seq += 1
        if self.next_seq % PRUNE_EVERY == 0:
            self._prune()

    def receive(self, timeout_s: float) -> list[RunnerCall] | None:
        """The next message, or None if it has not come within ``timeout_s``; raises when the
        coordination service (on rank 0) cannot be reached."""
        try:
            payload = self.client.blocking_key_value_get_bytes(self._key(self.next_seq), int(timeout_s * 1000))
        except Exception as exc:
            if is_timeout(exc):
                return None
            raise
        self.client.key_value_set(f"{self.namespace}/ack/{self.rank}", str(self.next_seq), allow_overwrite=True)
        self.next_seq += 1
        return decode_calls(payload)

    def wait_read(self, timeout_s: float) -> bool:
        """Wait until every follower has read every published message; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._read_by_all() < self.next_seq:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _read_by_all(self) -> int:
        """How many messages every follower has read."""
        acks = self.client.key_value_dir_get(f"{self.namespace}/ack/")
        if len(acks) < self.nnodes - 1:
            return 0
        return min(int(value) for _, value in acks) + 1

    def _prune(self) -> None:
        """Delete the messages every follower has acknowledged."""
        read = self._read_by_all()
        for seq in range(self._pruned, read):
            self.client.key_value_delete(self._key(seq))
        self._pruned = max(self._pruned, read)
