"""The runner calls rank 0 makes, as messages the other ranks replay in the same order.

A step on rank 0 is ``prepare(scheduler_output)``, ``launch(prepared, bitmask)`` and later
``collect(step)``; with async scheduling step N+1 is prepared and launched before step N is
collected. Launches and collects both go oldest first, so a follower needs no ids: it keeps
its prepared steps and its launched ones in two queues.

Encoding is pickle, since ``SchedulerOutput`` is a tree of plain dataclasses; decoding admits only
the classes below (the core's data, a few containers), so a message cannot name any other
callable to run. The structured-output bitmask travels as raw int32 bytes.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Union

import numpy as np

from jaxserve.core.sched_output import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class Prepare:
    """``runner.prepare(scheduler_output)``: apply it to the request states, build the inputs."""

    scheduler_output: SchedulerOutput


@dataclasses.dataclass(frozen=True)
class Launch:
    """``runner.launch`` of the oldest prepared step, with its bitmask (None: no constrained row)."""

    bitmask: bytes | None = None
    bitmask_shape: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, bitmask: np.ndarray | None) -> Launch:
        if bitmask is None:
            return cls()
        array = np.ascontiguousarray(bitmask, dtype=np.int32)
        rows, width = array.shape
        return cls(array.tobytes(), (rows, width))

    def bitmask_array(self) -> np.ndarray | None:
        if self.bitmask is None:
            return None
        return np.frombuffer(self.bitmask, np.int32).reshape(self.bitmask_shape).copy()


@dataclasses.dataclass(frozen=True)
class Collect:
    """``runner.collect`` of the oldest launched step (its tokens update the host-side rows)."""


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """Rank 0 is stopping: the follower leaves its loop."""


RunnerCall = Union[Prepare, Launch, Collect, Shutdown]

# Module -> names a message may reference when decoded.
_ALLOWED = {
    "builtins": {"set", "frozenset", "dict", "list", "tuple"},
    "copyreg": {"_reconstructor"},
    "jaxserve.distributed.messages": {"Prepare", "Launch", "Collect", "Shutdown"},
    "jaxserve.core.sched_output": {"SchedulerOutput", "NewRequestData", "CachedRequestData"},
    "jaxserve.core.sampling_params": {"SamplingParams", "SamplingType"},
    "jaxserve.core.structured_outputs": {"StructuredOutputsParams"},
}


class _MessageUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name not in _ALLOWED.get(module, ()):
            raise pickle.UnpicklingError(f"a control message may not reference {module}.{name}")
        return super().find_class(module, name)


def encode_calls(calls: list[RunnerCall]) -> bytes:
    return pickle.dumps(list(calls), protocol=pickle.HIGHEST_PROTOCOL)


def decode_calls(payload: bytes) -> list[RunnerCall]:
    calls = _MessageUnpickler(io.BytesIO(payload)).load()
    if not isinstance(calls, list) or not all(isinstance(c, (Prepare, Launch, Collect, Shutdown)) for c in calls):
        raise ValueError("a control message must be a list of runner calls")
    return calls
