"""LoRA in the core: slot assignment per step, and the adapter's weights digest in the block hashes."""

from __future__ import annotations

import pytest

from jaxserve.core.kv_cache_utils import hash_request_tokens
from jaxserve.core.lora_request import LoRARequest, lora_cache_key
from jaxserve.core.lora_slots import LoRASlotAssigner
from jaxserve.core.request import RequestStatus


def test_at_most_max_loras_adapters_per_step_and_lru_reuse():
    s = LoRASlotAssigner(max_loras=2)
    s.begin_step()
    assert s.admit("a@1") == 0 and s.admit("b@1") == 1 and s.admit("a@1") == 0
    assert s.admit("c@1") is None  # both slots are used by this step
    assert s.pending_writes == [(0, "a@1"), (1, "b@1")]
    s.begin_step()
    s.admit("b@1")
    assert s.admit("c@1") == 0  # a is the least recently used and idle this step
    assert s.slot_of("a@1") is None and s.pending_writes[-1] == (0, "c@1")
    s.forget("b@1")
    assert s.admit("d@1") == 1


class _Req:
    def __init__(self, tokens, lora_name=None):
        self.all_token_ids, self.block_size, self.block_hashes = tokens, 4, []
        self.lora_name, self.cache_salt, self.mm_features = lora_name, None, []


def test_a_reload_under_the_same_name_gets_other_block_hashes():
    tokens = list(range(12))
    old, new = lora_cache_key("sql", "aa" * 32), lora_cache_key("sql", "bb" * 32)
    h_old, h_new = hash_request_tokens(4, _Req(tokens, old)), hash_request_tokens(4, _Req(tokens, new))
    assert len(h_old) == 3 and not set(h_old) & set(h_new)
    assert h_old == hash_request_tokens(4, _Req(tokens, old))
    assert not set(h_old) & set(hash_request_tokens(4, _Req(tokens)))


def test_lora_request_fields():
    r = LoRARequest("sql", 1, "/adapters/sql")
    assert (r.name, r.int_id, r.path) == ("sql", 1, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("sql", 0, "/x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")


def test_scheduler_admits_at_most_max_loras_adapters_and_the_others_wait():
    from jaxserve.core.schedule_record import WAIT_LORA_SLOTS
    from tests.core.core_testing import make_request, make_scheduler

    sched = make_scheduler(max_loras=1, max_num_batched_tokens=64)
    reqs = [make_request([1, 2, 3], req_id="a", lora_name="x@1"), make_request([4, 5], req_id="b", lora_name="y@1"),
            make_request([6, 7], req_id="c"), make_request([8, 9], req_id="d", lora_name="x@1")]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "c", "d"}  # b's adapter waits; the ones behind it go on
    assert [r.request_id for r in sched.waiting] == ["b"] and sched.waiting_reason == WAIT_LORA_SLOTS
    assert {r.lora_name for r in out.scheduled_new_reqs} == {"x@1", None}
    sched.finish_requests(["a", "d"], RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"] and not sched.waiting  # x's slot is free now
