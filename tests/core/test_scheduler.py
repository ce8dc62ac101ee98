import pytest

from jaxserve.core import KVCacheManager, ModelRunnerOutput, RequestStatus, Scheduler, SchedulerConfig
from jaxserve.exceptions import InvalidRequestError
from tests.core.core_testing import (
    FakeRunner,
    assert_all_free,
    check_pool_invariants,
    make_request,
    make_scheduler,
    run_step,
)

ABORTED = RequestStatus.FINISHED_ABORTED


def runner_for(sched, token=5):
    return FakeRunner(sched.block_size, token if callable(token) else (lambda rid: token))


def step(sched, runner):
    so, outs = run_step(sched, runner)
    check_pool_invariants(sched)
    return so, {o.request_id: o for o in outs}


# ---------------------------------------------------------------- admission and budget

def test_add_request_preconditions_and_id_conflict():
    """Input validation is the engine's input processor's; the scheduler asserts its
    preconditions and refuses only what conflicts with its own state (a request id in use)."""
    s = make_scheduler(max_model_len=16, max_num_batched_tokens=8)
    with pytest.raises(AssertionError):
        s.add_request(make_request([]))
    with pytest.raises(AssertionError, match="max_model_len"):
        s.add_request(make_request([1] * 16))
    s.add_request(make_request([1] * 15, req_id="x"))  # chunked prefill: longer than budget is ok
    with pytest.raises(InvalidRequestError, match="^request_id: 'x' is already in use"):
        s.add_request(make_request([1], req_id="x"))
    off = make_scheduler(max_model_len=16, max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(AssertionError, match="max_num_batched_tokens"):
        off.add_request(make_request([1] * 9))
    assert s.get_num_unfinished_requests() == 1


def test_config_validation():
    for kw, field in [(dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
                      (dict(max_num_seqs=0), "max_num_seqs"), (dict(policy="lifo"), "policy"),
                      (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
                      (dict(long_prefill_token_threshold=4, enable_chunked_prefill=False),
                       "long_prefill_token_threshold"), (dict(max_model_len=1), "max_model_len")]:
        with pytest.raises(ValueError, match=field):
            SchedulerConfig(**kw)
    with pytest.raises(ValueError, match="KV blocks"):
        Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(8, 4, 64))
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(80, 4, 32))
    s = Scheduler(SchedulerConfig(max_model_len=64), num_blocks=17, block_size=4)
    assert s.kv_cache_manager.num_blocks == 17


def test_budget_shared_by_decodes_and_prefill_chunks():
    s = make_scheduler(max_num_batched_tokens=10)
    r = runner_for(s)
    a, b = make_request([1] * 4, req_id="a"), make_request([2] * 12, req_id="b")
    s.add_request(a)
    s.add_request(b)
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 4, "b": 6}  # b chunked by what a left
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a", "b"]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0 and b.num_computed_tokens == 6
    so, outs = step(s, r)
    assert so.num_scheduled_tokens == {"a": 1, "b": 6}
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [4, 6]
    assert b.num_output_tokens == 1 and outs["b"].new_token_ids == [5]
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and so.total_num_scheduled_tokens == 2


def test_partial_prefill_token_from_runner_is_ignored():
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request([1] * 6, req_id="a"))
    so = s.schedule()
    outs = s.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[9]]))
    assert outs == [] and s.requests["a"].num_output_tokens == 0


def test_chunked_prefill_off_waits_for_whole_prompt():
    s = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    r = runner_for(s)
    s.add_request(make_request([1] * 6, req_id="a"))
    s.add_request(make_request([2] * 6, req_id="b"))
    s.add_request(make_request([3] * 2, req_id="c"))
    so, _ = step(s, r)
    # b does not fit the 4 tokens left; FCFS: c waits behind it.
    assert so.num_scheduled_tokens == {"a": 6}
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 1, "b": 6, "c": 2}


def test_long_prefill_token_threshold():
    s = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=5)
    r = runner_for(s)
    s.add_request(make_request([1] * 12, req_id="a"))
    s.add_request(make_request([2] * 3, req_id="b"))
    assert step(s, r)[0].num_scheduled_tokens == {"a": 5, "b": 3}
    assert step(s, r)[0].num_scheduled_tokens == {"a": 5, "b": 1}
    assert step(s, r)[0].num_scheduled_tokens == {"a": 2, "b": 1}


def test_max_num_seqs():
    s = make_scheduler(max_num_seqs=2)
    r = runner_for(s)
    for i in range(3):
        s.add_request(make_request([i] * 3, req_id=f"q{i}", max_tokens=2))
    so, _ = step(s, r)
    assert set(so.num_scheduled_tokens) == {"q0", "q1"} and len(s.running) == 2
    so, _ = step(s, r)  # q0, q1 finish here (max_tokens=2)
    assert set(so.num_scheduled_tokens) == {"q0", "q1"}
    so, _ = step(s, r)
    assert set(so.num_scheduled_tokens) == {"q2"} and so.finished_req_ids == {"q0", "q1"}


# ---------------------------------------------------------------- preemption and priority

def test_preempts_newest_and_admits_nothing_that_step():
    # 6 usable blocks of 2 tokens; three requests of 4 tokens take 2 blocks each.
    s = make_scheduler(num_blocks=7, block_size=2, max_model_len=12, enable_caching=False)
    r = runner_for(s)
    for name in "abc":
        s.add_request(make_request([1, 2, 3, 4], req_id=name, ignore_eos=True))
    so, _ = step(s, r)
    assert set(so.num_scheduled_tokens) == {"a", "b", "c"}
    s.add_request(make_request([7], req_id="d"))
    # a needs a third block for token 5: c (newest) is preempted, d is not admitted.
    so, _ = step(s, r)
    assert so.preempted_req_ids == {"c"} and so.scheduled_new_reqs == []
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    c = s.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.make_stats().num_preemptions == 1
    assert list(s.waiting)[0] is c  # back at the front
    assert s.make_stats().num_preempted_reqs == 1


def test_preempted_request_resumes_as_new_with_outputs():
    s = make_scheduler(num_blocks=5, block_size=2, max_model_len=8, enable_caching=False)
    r = runner_for(s)
    s.add_request(make_request([1, 2, 3], req_id="a", ignore_eos=True, max_tokens=5))
    s.add_request(make_request([4, 5, 6], req_id="b", ignore_eos=True, max_tokens=5))
    preempted_seen = resumed = None
    for _ in range(30):
        so, _ = step(s, r)
        if so.preempted_req_ids and preempted_seen is None:
            preempted_seen = next(iter(so.preempted_req_ids))
        for new in so.scheduled_new_reqs:
            if new.req_id == preempted_seen:
                resumed = new
        if not s.has_requests():
            break
    assert preempted_seen == "b" and resumed is not None
    assert resumed.output_token_ids and resumed.num_computed_tokens == 0
    assert not s.has_requests()
    assert_all_free(s)


def test_preemption_with_prefix_cache_rehits_own_blocks():
    s = make_scheduler(num_blocks=9, block_size=2, max_model_len=14)
    r = runner_for(s)
    s.add_request(make_request([1, 2, 3, 4, 5], req_id="a", ignore_eos=True, max_tokens=8))
    s.add_request(make_request([6, 7, 8, 9, 1], req_id="b", ignore_eos=True, max_tokens=8))
    hits = []
    while s.has_requests():
        so, _ = step(s, r)
        hits += [(n.req_id, n.num_computed_tokens) for n in so.scheduled_new_reqs
                 if n.output_token_ids]
    assert hits and hits[0][0] == "b" and hits[0][1] > 0  # its freed blocks were still cached
    assert s.requests == {} and s.kv_cache_manager.prefix_cache_stats.hits > 0
    assert_all_free(s)


def test_priority_admission_and_victim():
    s = make_scheduler(num_blocks=7, block_size=2, max_model_len=12, policy="priority",
                       enable_caching=False)
    r = runner_for(s)
    s.add_request(make_request([1, 2, 3, 4], req_id="low", priority=2, ignore_eos=True))
    s.add_request(make_request([1, 2, 3, 4], req_id="high", priority=0, ignore_eos=True))
    s.add_request(make_request([1, 2, 3, 4], req_id="mid", priority=1, ignore_eos=True))
    so, _ = step(s, r)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["high", "mid", "low"]
    so, _ = step(s, r)
    # high (first in running) needs a block: the lowest priority goes, though it is not newest.
    assert so.preempted_req_ids == {"low"} and set(so.num_scheduled_tokens) == {"high", "mid"}


def test_priority_victim_already_scheduled_gives_back_budget_and_cache():
    # running order: low (admitted first), high. high's growth preempts low, which was
    # scheduled earlier in the same step: its tokens are taken back and blocks withdrawn.
    s = make_scheduler(num_blocks=6, block_size=2, max_model_len=10, policy="priority")
    r = runner_for(s)
    s.add_request(make_request([1, 2, 3], req_id="low", priority=5, ignore_eos=True))
    step(s, r)
    s.add_request(make_request([4, 5, 6], req_id="high", priority=0, ignore_eos=True))
    step(s, r)
    assert [x.request_id for x in s.running] == ["low", "high"]
    for _ in range(6):
        so, _ = step(s, r)  # FakeRunner checks KV of every hit: no stale block is ever reused
        if so.preempted_req_ids:
            assert so.preempted_req_ids == {"low"}
            assert set(so.num_scheduled_tokens) == {"high"}
            assert so.scheduled_cached_reqs.req_ids == ["high"]
            break
    else:
        pytest.fail("no preemption")
    while s.has_requests():
        step(s, r)
    assert_all_free(s)


# ---------------------------------------------------------------- stop conditions

def finish_one(prompt, tokens, max_model_len=64, eos=0, **params):
    s = make_scheduler(max_model_len=max_model_len)
    it = iter(tokens)
    r = runner_for(s, lambda rid: next(it))
    req = make_request(prompt, req_id="x", eos=eos, **params)
    s.add_request(req)
    outs = []
    while s.has_unfinished_requests():
        outs.append(step(s, r)[1]["x"])
    assert_all_free(s)
    return req, outs


def test_stop_eos():
    req, outs = finish_one([1, 2], [3, 0, 4])
    assert req.output_token_ids == [3, 0] and outs[-1].finish_reason == "stop"
    assert outs[-1].stop_reason is None and req.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos():
    req, outs = finish_one([1, 2], [0, 0, 0], ignore_eos=True, max_tokens=3)
    assert req.output_token_ids == [0, 0, 0] and outs[-1].finish_reason == "length"


def test_stop_token_ids_sets_stop_reason():
    req, outs = finish_one([1, 2], [3, 7, 4], stop_token_ids=[7])
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == 7
    assert req.stop_reason == 7


def test_min_tokens_suppresses_eos_and_stop_ids():
    req, outs = finish_one([1], [0, 7, 0, 5], stop_token_ids=[7], min_tokens=3)
    assert req.output_token_ids == [0, 7, 0] and outs[-1].finish_reason == "stop"


def test_max_tokens_length_cap():
    req, outs = finish_one([1, 2], [3] * 10, max_tokens=4)
    assert req.num_output_tokens == 4 and outs[-1].finish_reason == "length"
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1, 1]
    assert all(o.finish_reason is None for o in outs[:-1])


def test_max_model_len_caps_even_with_min_tokens_and_none_max_tokens():
    req, outs = finish_one([1, 2, 3], [3] * 20, max_model_len=8, max_tokens=None)
    assert req.max_tokens == 5 and req.num_tokens == 8 and outs[-1].finish_reason == "length"
    req, _ = finish_one([1, 2, 3], [3] * 20, max_model_len=8, max_tokens=10, min_tokens=10)
    assert req.num_tokens == 8 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_finished_ids_reach_runner_once():
    s = make_scheduler()
    r = runner_for(s)
    s.add_request(make_request([1], req_id="a", max_tokens=1))
    so, outs = step(s, r)
    assert outs["a"].finished and s.has_finished_requests() and s.has_requests()
    assert not s.has_unfinished_requests()
    so, _ = step(s, r)
    assert so.finished_req_ids == {"a"} and so.is_empty
    assert s.schedule().finished_req_ids == set() and not s.has_requests()


# ---------------------------------------------------------------- abort in every state

def aborted(s, r, req_id, in_runner):
    s.finish_requests(req_id, ABORTED)
    check_pool_invariants(s)
    assert req_id not in s.requests
    so, _ = step(s, r)  # FakeRunner asserts finished ids are ones it holds
    assert (req_id in so.finished_req_ids) == in_runner
    assert req_id not in so.num_scheduled_tokens


def test_abort_waiting():
    s = make_scheduler(max_num_seqs=1)
    r = runner_for(s)
    s.add_request(make_request([1] * 3, req_id="a"))
    s.add_request(make_request([1] * 3, req_id="b"))
    step(s, r)
    req = s.requests["b"]
    aborted(s, r, "b", in_runner=False)
    assert req.status == ABORTED and req.get_finished_reason() == "abort"
    assert len(s.waiting) == 0


def test_abort_mid_chunk():
    s = make_scheduler(max_num_batched_tokens=4)
    r = runner_for(s)
    s.add_request(make_request([1] * 10, req_id="a"))
    step(s, r)
    assert s.requests["a"].num_computed_tokens == 4
    aborted(s, r, "a", in_runner=True)
    assert_all_free(s)


def test_abort_decoding_and_unknown_and_finished():
    s = make_scheduler()
    r = runner_for(s)
    s.add_request(make_request([1] * 3, req_id="a", max_tokens=1))
    s.add_request(make_request([1] * 3, req_id="b"))
    step(s, r)  # a just finished, b decoding
    s.finish_requests(["a", "nope"], ABORTED)  # no-ops
    aborted(s, r, "b", in_runner=True)
    assert_all_free(s)


def test_abort_preempted():
    s = make_scheduler(num_blocks=7, block_size=2, max_model_len=12, enable_caching=False)
    r = runner_for(s)
    for name in "abc":
        s.add_request(make_request([1, 2, 3, 4], req_id=name, ignore_eos=True))
    step(s, r)
    so, _ = step(s, r)
    assert so.preempted_req_ids == {"c"}
    aborted(s, r, "c", in_runner=False)
    s.finish_requests(["a", "b"], ABORTED)
    step(s, r)
    assert_all_free(s) and not s.has_requests()


def test_finish_requests_needs_finished_status():
    s = make_scheduler()
    with pytest.raises(ValueError):
        s.finish_requests("a", RequestStatus.RUNNING)


# ---------------------------------------------------------------- stats and cached tokens

def test_num_cached_tokens_and_stats_history():
    s = make_scheduler(block_size=4, history_size=8)
    r = runner_for(s)
    s.add_request(make_request(list(range(9)), req_id="a", max_tokens=1))
    step(s, r)
    s.add_request(make_request(list(range(9)) + [1, 2], req_id="b", max_tokens=1))
    so, outs = step(s, r)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"b": 3}
    assert outs["b"].num_cached_tokens == 8
    st = s.make_stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits, st.prefix_cache_requests) == (20, 8, 2)
    assert st.step == 2 and st.num_running_reqs == 0 and st.num_finished_reqs == 2
    assert [h.num_scheduled_tokens for h in s.history] == [9, 3]
    assert s.history[0].kv_cache_usage > 0.0
    assert s.reset_prefix_cache()


def test_lookups_that_skip_the_cache_are_not_prefix_queries():
    off = make_scheduler(block_size=4, enable_caching=False)
    on = make_scheduler(block_size=4)
    for s in (off, on):
        r = runner_for(s)
        s.add_request(make_request(list(range(9)), max_tokens=1))
        s.add_request(make_request(list(range(9)), max_tokens=1, prompt_logprobs=1))  # bypasses the cache
        step(s, r)
    assert (off.make_stats().prefix_cache_requests, off.make_stats().prefix_cache_queries) == (0, 0)
    assert (on.make_stats().prefix_cache_requests, on.make_stats().prefix_cache_queries) == (1, 9)


def test_logprobs_and_prompt_logprobs_pass_through():
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request([1] * 6, req_id="a", prompt_logprobs=1, logprobs=1))
    so = s.schedule()
    outs = s.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[]], logprobs=["LP"],
                                                      prompt_logprobs_dict={"a": "PLP0"}))
    assert len(outs) == 1 and outs[0].new_token_ids == [] and outs[0].new_prompt_logprobs == "PLP0"
    assert outs[0].new_logprobs is None
    so = s.schedule()
    outs = s.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[3]], logprobs=["LP"],
                                                      prompt_logprobs_dict={"a": "PLP1"}))
    assert outs[0].new_token_ids == [3] and outs[0].new_logprobs == "LP"
    assert outs[0].num_cached_tokens == 0


def test_victim_scheduled_same_step_does_not_leave_stale_cached_blocks():
    # low's prefill chunk of this step publishes block 4 (tokens 8-9); high then preempts low
    # before the step runs, so block 4's KV is never written. It must leave the prefix cache, or
    # low's own re-lookup would hit it (the FakeRunner reads every hit slot and would fail).
    s = make_scheduler(num_blocks=8, block_size=2, max_model_len=12, policy="priority",
                       max_num_batched_tokens=6, long_prefill_token_threshold=4)
    r = runner_for(s)
    s.add_request(make_request(list(range(11)), req_id="low", priority=5))
    step(s, r)
    s.add_request(make_request([7, 7], req_id="high", priority=0, max_tokens=2))
    step(s, r)
    so, _ = step(s, r)
    assert so.preempted_req_ids == {"low"} and so.num_scheduled_tokens == {"high": 1}
    so, _ = step(s, r)
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "low" and new.num_computed_tokens == 8  # blocks 0-3 only
    while s.has_requests():
        step(s, r)
    assert_all_free(s)


def test_chunking_off_resumed_request_longer_than_budget_is_chunked():
    # Without chunked prefill a prompt must fit one step, but a preempted request that has since
    # grown past max_num_batched_tokens could then never resume: it is recomputed in chunks.
    s = make_scheduler(num_blocks=9, block_size=2, max_model_len=16, enable_caching=False,
                       max_num_batched_tokens=8, enable_chunked_prefill=False)
    r = runner_for(s)
    s.add_request(make_request([1] * 2, req_id="a", ignore_eos=True, max_tokens=9))
    s.add_request(make_request([2] * 7, req_id="b", ignore_eos=True, max_tokens=8))
    resumed = None
    while s.has_requests():
        so, _ = step(s, r)
        for new in so.scheduled_new_reqs:
            if new.output_token_ids:
                resumed = (new, so.num_scheduled_tokens[new.req_id])
    new, n = resumed
    assert new.req_id == "b" and n == 8
    assert len(new.prompt_token_ids) + len(new.output_token_ids) > 8
    assert_all_free(s)


# ---------------------------------------------------------------- async scheduling

def _tokens(so, **sampled):
    """A runner output giving each named request its token (others sample nothing)."""
    ids = list(so.num_scheduled_tokens)
    tokens = [[sampled[r]] if r in sampled else [] for r in ids]
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, tokens)


def test_async_schedules_the_next_decode_before_the_output_arrives():
    s = make_scheduler(async_scheduling=True, max_num_batched_tokens=16)
    a = make_request([1, 2, 3, 4], req_id="a", max_tokens=3, ignore_eos=True)
    s.add_request(a)
    so1 = s.schedule()
    assert so1.num_scheduled_tokens == {"a": 4} and a.num_output_placeholders == 1
    so2 = s.schedule()  # step 1 still running: a decodes its in-flight token
    assert so2.num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 2
    assert so2.scheduled_cached_reqs.num_computed_tokens == [4]
    s.update_from_output(so1, _tokens(so1, a=7))
    assert a.output_token_ids == [7] and a.num_output_placeholders == 1
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {"a": 1}
    # 1 known + 2 in flight = max_tokens: scheduling a again would compute a token nobody wants.
    assert s.schedule().total_num_scheduled_tokens == 0
    s.update_from_output(so2, _tokens(so2, a=8))
    outs = s.update_from_output(so3, _tokens(so3, a=9))
    assert a.output_token_ids == [7, 8, 9] and outs[0].finish_reason == "length"
    assert a.num_output_placeholders == 0 and not s.has_unfinished_requests()
    assert_all_free(s)


def test_async_output_of_a_request_that_finished_meanwhile_is_dropped():
    s = make_scheduler(async_scheduling=True)
    s.add_request(make_request([1, 2, 3], req_id="a", eos=2))
    so1, so2 = s.schedule(), s.schedule()
    outs = s.update_from_output(so1, _tokens(so1, a=2))  # EOS: a finishes, its blocks are freed
    assert [o.finish_reason for o in outs] == ["stop"]
    assert s.update_from_output(so2, _tokens(so2, a=5)) == []  # the step already in flight
    assert s.schedule().finished_req_ids == {"a"}
    assert_all_free(s)


def test_async_preempted_request_keeps_its_in_flight_token():
    # 6 usable blocks of 2 tokens; three 4-token prompts take 2 blocks each.
    s = make_scheduler(num_blocks=7, block_size=2, max_model_len=12, enable_caching=False,
                       async_scheduling=True)
    for name in "abc":
        s.add_request(make_request([1, 2, 3, 4], req_id=name, ignore_eos=True, max_tokens=4))
    so1 = s.schedule()
    so2 = s.schedule()  # a needs a third block for its in-flight token: c is preempted
    assert so2.preempted_req_ids == {"c"}
    c = s.requests["c"]
    outs = {o.request_id: o for o in s.update_from_output(so1, _tokens(so1, a=5, b=6, c=7))}
    assert outs["c"].new_token_ids == [7] and not outs["c"].finished
    assert c.output_token_ids == [7] and c.num_output_placeholders == 0 and c.status == RequestStatus.PREEMPTED
    s.update_from_output(so2, _tokens(so2, a=5, b=6))
    resumed = None
    for _ in range(40):
        so = s.schedule()
        resumed = resumed or next((n for n in so.scheduled_new_reqs if n.req_id == "c"), None)
        s.update_from_output(so, _tokens(so, **{r: 1 for r in so.num_scheduled_tokens}))
        if not s.has_requests():
            break
    assert resumed is not None and resumed.output_token_ids[0] == 7
    assert not s.has_requests()
    assert_all_free(s)
