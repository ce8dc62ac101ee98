from jaxserve.core import RequestStatus
from jaxserve.core.kv_cache_utils import hash_request_tokens
from tests.core.core_testing import make_request


def test_status_helpers():
    assert not RequestStatus.is_finished(RequestStatus.WAITING)
    assert not RequestStatus.is_finished(RequestStatus.RUNNING)
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    reasons = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED:
               "length", RequestStatus.FINISHED_ABORTED: "abort",
               RequestStatus.FINISHED_IGNORED: "length"}
    for status, reason in reasons.items():
        assert RequestStatus.is_finished(status)
        assert RequestStatus.get_finished_reason(status) == reason
    assert RequestStatus.get_finished_reason(RequestStatus.RUNNING) is None


def test_status_prints_its_name():
    assert [str(s) for s in (RequestStatus.WAITING, RequestStatus.FINISHED_ABORTED)] == ["WAITING", "FINISHED_ABORTED"]
    assert f"{RequestStatus.RUNNING}" == "RUNNING"


def test_token_bookkeeping():
    r = make_request([1, 2, 3])
    assert r.status == RequestStatus.WAITING and not r.is_finished()
    assert (r.num_prompt_tokens, r.num_tokens, r.num_output_tokens) == (3, 3, 0)
    assert r.num_computed_tokens == 0 and r.num_cached_tokens == -1 and r.num_preemptions == 0
    r.append_output_token_ids(7)
    r.append_output_token_ids([8, 9])
    assert r.output_token_ids == [7, 8, 9] and r.all_token_ids == [1, 2, 3, 7, 8, 9]
    assert r.num_tokens == 6 and r.num_output_tokens == 3
    r.status = RequestStatus.FINISHED_ABORTED
    assert r.is_finished() and r.get_finished_reason() == "abort"


def test_incremental_block_hashes_match_from_scratch():
    r = make_request([1, 2, 3, 4, 5], block_size=2, lora_name="l", cache_salt="s")
    assert len(r.block_hashes) == 2
    for t in range(6, 14):
        r.append_output_token_ids(t)
        assert len(r.block_hashes) == r.num_tokens // 2
    assert r.block_hashes == hash_request_tokens(2, r)


def test_priority_order_is_total():
    a = make_request([1], priority=1, arrival_time=5.0, req_id="a")
    b = make_request([1], priority=0, arrival_time=9.0, req_id="b")
    c = make_request([1], priority=0, arrival_time=9.0, req_id="c")
    assert sorted([a, c, b]) == [b, c, a]
