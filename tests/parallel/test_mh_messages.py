"""Rank 0's runner calls as bytes: the same dataclasses come back, and nothing else can."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.core.structured_outputs import StructuredOutputsParams
from jaxserve.distributed.messages import Collect, Launch, Prepare, Shutdown, decode_calls, encode_calls


def scheduler_output() -> SchedulerOutput:
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=["x"], logit_bias={4: -1.5},
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    new = NewRequestData("a", [1, 2, 3], params, [5, 6], 0, [])
    cached = CachedRequestData(["b"], [[7]], [40])
    return SchedulerOutput([new], cached, {"a": 3, "b": 1}, 4, {"gone"}, {"preempted"})


def test_calls_come_back_equal_and_in_order():
    bitmask = np.arange(6, dtype=np.int32).reshape(2, 3) - 3
    calls = [Collect(), Prepare(scheduler_output()), Launch.of(bitmask), Launch.of(None), Shutdown()]
    back = decode_calls(encode_calls(calls))
    assert back == calls
    assert back[1].scheduler_output.scheduled_new_reqs[0].sampling_params.logit_bias == {4: -1.5}
    np.testing.assert_array_equal(back[2].bitmask_array(), bitmask)
    assert back[3].bitmask_array() is None


def test_a_message_naming_any_other_callable_is_refused():
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="may not reference"):
        decode_calls(pickle.dumps([Evil()]))
    with pytest.raises(ValueError, match="list of runner calls"):
        decode_calls(pickle.dumps({"not": "calls"}))
