"""Randomised whole-core checks: a hypothesis state machine over tiny pools, and a liveness run."""

import os
import random

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from jaxserve.core import RequestStatus
from jaxserve.core.kv_cache_utils import cdiv
from tests.core.core_testing import FakeRunner, assert_all_free, check_pool_invariants, make_request, make_scheduler

VOCAB = 3          # tiny, so prompts share prefixes and blocks hit
EOS = 0
SHARED_PREFIXES = ([1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2],
                   [2, 2, 1, 1, 2, 2, 1, 1, 2, 2, 1, 1, 2, 2, 1, 1])
ABORT_STATES = ("waiting", "mid_chunk", "decoding", "preempted", "just_finished")
ABORTED_IN: set = set()
# Examples are derandomized, so a failure reproduces as is; shrinking one can take minutes, so it
# is opt-in: JAXSERVE_HYPOTHESIS_SHRINK=1.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + (
    [Phase.shrink] if os.environ.get("JAXSERVE_HYPOTHESIS_SHRINK") else [])


def request_state(req) -> str:
    if req.status == RequestStatus.WAITING:
        return "waiting"
    if req.status == RequestStatus.PREEMPTED:
        return "preempted"
    # After a step a decoding request has all but its newest (sampled) token computed.
    if req.num_output_tokens and req.num_computed_tokens == req.num_tokens - 1:
        return "decoding"
    return "mid_chunk"


def check_stop(req, out, max_model_len):
    """The finish reason agrees with the request's tokens and parameters."""
    p = req.sampling_params
    last = req.output_token_ids[-1] if req.output_token_ids else None
    capped = req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len
    stop_tok = req.num_output_tokens >= p.min_tokens and (
        (last == req.eos_token_id and not p.ignore_eos) or last in p.stop_token_ids)
    if out.finish_reason == "stop":
        assert stop_tok and (out.stop_reason == last if last in p.stop_token_ids and
                             last != req.eos_token_id else True)
    elif out.finish_reason == "length":
        assert capped and not stop_tok
    else:
        assert out.finish_reason is None and not capped and not stop_tok


def drain_bound(sched, num_reqs: int) -> int:
    """Steps to finish ``num_reqs`` requests. The first running request is never preempted while
    another runs and gets >= 1 token a step, so it finishes within max_model_len steps; a step with
    nothing running admits the waiting head."""
    return num_reqs * (sched.max_model_len + 1) + 1


class SchedulerMachine(RuleBasedStateMachine):

    # sampled_from rather than integers(): hypothesis skews integers towards their bounds.
    @initialize(block_size=st.sampled_from([2, 3, 4]), max_model_len=st.sampled_from(range(8, 17)),
                extra_blocks=st.sampled_from([0, 0, 1, 2]), budget=st.sampled_from(range(2, 17)),
                max_num_seqs=st.sampled_from([2, 3, 4]),
                chunked=st.sampled_from([True, True, False]),
                threshold=st.sampled_from([0, 2, 3]), policy=st.sampled_from(["fcfs", "priority"]),
                caching=st.sampled_from([True, True, True, False]), seed=st.integers(0, 2**16))
    def setup(self, block_size, max_model_len, extra_blocks, budget, max_num_seqs, chunked,
              threshold, policy, caching, seed):
        num_blocks = cdiv(max_model_len, block_size) + 1 + extra_blocks
        self.s = make_scheduler(
            num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
            enable_caching=caching, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold if chunked else 0, policy=policy)
        self.rng = random.Random(seed)
        # EOS now and then, so most requests live long enough to contend for blocks.
        self.runner = FakeRunner(
            block_size,
            lambda rid: EOS if self.rng.random() < 0.1 else self.rng.randrange(1, VOCAB))
        self.just_finished: list[str] = []
        self.all_reqs = {}
        self.n = 0

    # ------------------------------------------------------------ the one rule
    # A single dispatching rule rather than one rule per action: hypothesis' swarm testing would
    # otherwise switch whole actions off per example (all adds, no steps), starving the mix.

    @rule(op=st.sampled_from(["add"] * 3 + ["step"] * 4 + ["abort"] * 2 + ["reset"]),
          data=st.data())
    def act(self, op, data):
        getattr(self, "_" + op)(data)

    def _add(self, data):
        s, rng = self.s, self.rng
        for _ in range(data.draw(st.sampled_from([1, 1, 2, 3]), label="burst")):
            kind = rng.choice(["shared", "shared", "random", "empty", "too_long"])
            length = {"empty": 0, "too_long": s.max_model_len}.get(
                kind, rng.randint(1, s.max_model_len - 1))
            prompt = [rng.randrange(VOCAB) for _ in range(length)]
            if kind == "shared":  # a shared head, so blocks hit
                head = rng.choice(SHARED_PREFIXES)[:rng.randint(0, length)]
                prompt[:len(head)] = head
            max_tokens = rng.choice([None, None, 16, 8, 3, 1])
            req = make_request(
                prompt, req_id=f"q{self.n}", eos=rng.choice([EOS, None]),
                priority=rng.randrange(3), max_tokens=max_tokens,
                min_tokens=min(rng.choice([0, 0, 2]), max_tokens or 2),
                ignore_eos=rng.random() < 0.3, stop_token_ids=rng.choice([[], [], [1]]),
                prompt_logprobs=1 if rng.random() < 0.15 else None)
            self.n += 1
            too_long = (not prompt or len(prompt) >= s.max_model_len or
                        (not s.scheduler_config.enable_chunked_prefill
                         and len(prompt) > s.max_num_batched_tokens))
            if too_long:  # the engine's input processor refuses these before the scheduler
                with pytest.raises(AssertionError):
                    s.add_request(req)
            else:
                s.add_request(req)
                self.all_reqs[req.request_id] = req

    def _step(self, data):
        for _ in range(data.draw(st.sampled_from([1, 1, 2, 4]), label="num_steps")):
            self.just_finished = self._engine_step()
            if self.rng.random() < 0.3:
                # Preempted requests and partial chunks rarely survive to the next rule:
                # sometimes abort straight after the step.
                self._abort(data)

    def _candidates(self, state: str) -> list[str]:
        if state == "just_finished":
            return self.just_finished
        return sorted(rid for rid, r in self.s.requests.items() if request_state(r) == state)

    def _abort(self, data):
        # Choose among the states present, so rare ones (preempted, mid-chunk) get their turn.
        states = [st_ for st_ in ABORT_STATES if self._candidates(st_)]
        if not states:
            return
        state = data.draw(st.sampled_from(states), label="abort_state")
        rid = data.draw(st.sampled_from(self._candidates(state)), label="abort_id")
        ABORTED_IN.add(state)
        s = self.s
        req = s.requests.get(rid)
        s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        assert rid not in s.requests
        if req is not None:
            assert req.status == RequestStatus.FINISHED_ABORTED
        else:
            self.just_finished.remove(rid)  # aborting a finished request is a no-op

    def _reset(self, data):
        kv = self.s.kv_cache_manager
        all_free = kv.num_free_blocks == kv.num_blocks - 1
        assert self.s.reset_prefix_cache() == all_free

    # ------------------------------------------------------------ one engine step, with checks

    def _engine_step(self) -> list[str]:
        s = self.s
        bs = s.block_size
        lookups = {}
        for req in s.waiting:
            lookups[req.request_id] = req.num_tokens
        so = s.schedule()
        assert so.total_num_scheduled_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        if so.preempted_req_ids:
            assert not so.scheduled_new_reqs, "admitted work in a step that preempted"
        threshold = s.scheduler_config.long_prefill_token_threshold
        if threshold:
            assert all(n <= threshold for n in so.num_scheduled_tokens.values())
        for new in so.scheduled_new_reqs:
            # Prefix hits are whole blocks and never cover the last known token.
            hit = new.num_computed_tokens
            assert hit % bs == 0 and hit < lookups[new.req_id]
            if (new.sampling_params.prompt_logprobs is not None
                    or not s.kv_cache_manager.enable_caching):
                assert hit == 0
            req = s.requests[new.req_id]
            if req.num_preemptions == 0:
                assert req.num_cached_tokens == hit
            if not s.scheduler_config.enable_chunked_prefill and lookups[new.req_id] - hit <= \
                    s.max_num_batched_tokens:
                assert so.num_scheduled_tokens[new.req_id] == lookups[new.req_id] - hit
        mro = self.runner.execute(so)
        assert set(self.runner.reqs) == {r.request_id for r in s.running}
        outs = s.update_from_output(so, mro)
        finished = []
        for out in outs:
            check_stop(self.all_reqs[out.request_id], out, s.max_model_len)
            if out.finished:
                finished.append(out.request_id)
                assert out.request_id not in s.requests  # released at once
        for r in s.running:
            st_ = self.runner.reqs[r.request_id]
            assert st_.tokens == r.all_token_ids
            assert st_.block_ids == s.kv_cache_manager.get_block_ids(r.request_id)
        return finished

    # ------------------------------------------------------------ invariants after every rule

    @invariant()
    def pool_consistent(self):
        check_pool_invariants(self.s)
        s = self.s
        assert s.get_num_unfinished_requests() == len(s.requests)
        for req in s.requests.values():
            assert not req.is_finished() and req.num_tokens < s.max_model_len

    def teardown(self):
        if not hasattr(self, "s"):
            return
        s = self.s
        bound = drain_bound(s, s.get_num_unfinished_requests())
        steps = 0
        while s.has_requests():
            self._engine_step()
            check_pool_invariants(s)
            steps += 1
            assert steps <= bound, f"not drained after {steps} steps"
        assert not self.runner.reqs
        assert_all_free(s)


def test_scheduler_state_machine():
    ABORTED_IN.clear()
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(max_examples=100, stateful_step_count=60, deadline=None,
                          derandomize=True, suppress_health_check=list(HealthCheck),
                          phases=PHASES))
    missing = set(ABORT_STATES) - ABORTED_IN
    assert not missing, f"abort never exercised in {missing}"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked", [True, False])
def test_liveness_under_preemption_pressure(policy, chunked):
    """Random request sets that fit max_model_len and the pool all finish within a bound."""
    total_preemptions = 0
    for seed in range(100):
        rng = random.Random(seed)
        bs = rng.choice([2, 3, 4])
        max_model_len = rng.randint(8, 20)
        budget = rng.randint(max_model_len if not chunked else 2, 24)
        s = make_scheduler(num_blocks=cdiv(max_model_len, bs) + 1 + rng.randint(0, 2),
                           block_size=bs, max_model_len=max_model_len,
                           max_num_batched_tokens=budget, max_num_seqs=rng.randint(2, 8),
                           enable_chunked_prefill=chunked, policy=policy,
                           enable_caching=rng.random() < 0.7)
        runner = FakeRunner(bs, lambda rid, rng=rng: rng.randrange(1, VOCAB))  # no EOS: run long
        num = rng.randint(3, 12)
        for i in range(num):
            plen = rng.randint(1, max_model_len - 1)
            s.add_request(make_request([rng.randrange(VOCAB) for _ in range(plen)],
                                       req_id=f"l{i}", eos=EOS, priority=rng.randint(0, 3),
                                       max_tokens=rng.choice([None, rng.randint(1, 12)])))
        bound = drain_bound(s, num)
        steps = 0
        while s.has_requests():
            so = s.schedule()
            s.update_from_output(so, runner.execute(so))
            steps += 1
            assert steps <= bound, f"seed {seed}: not finished after {steps} steps"
        # Each preemption happens in a step, at most max_num_seqs per step.
        assert s.num_preemptions <= steps * s.max_num_seqs
        assert s.num_finished_reqs == num
        total_preemptions += s.num_preemptions
        assert_all_free(s)
    assert total_preemptions > 0, "no preemption pressure: the test lost its point"
