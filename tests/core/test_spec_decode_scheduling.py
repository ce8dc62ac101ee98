"""Speculative decoding in the scheduler: drafts are scheduled tokens within the one budget,
rejection rolls back ``num_computed_tokens``, drafts never enter the prefix cache, and greedy
output is that of plain decoding under preemption, chunking, priorities, prefix hits and aborts.

A fake runner plays a deterministic greedy "target" (next token = a function of the context) and
a proposer whose drafts are right with a given probability; its fake KV cache checks every read.
"""

from __future__ import annotations

import random

import pytest

from jaxserve.core import ModelRunnerOutput, RequestStatus, SchedulerConfig, SchedulerOutput
from jaxserve.core.kv_cache_utils import cdiv
from tests.core.core_testing import assert_all_free, check_pool_invariants, make_request, make_scheduler

VOCAB = 5
EOS = 0


def target(context) -> int:
    """The greedy target: a fixed function of the last three tokens (EOS is rare)."""
    a, b, c = (list(context[-3:]) + [0, 0, 0])[:3]
    return 1 + (7 * a + 3 * b + c + len(context) // 9) % (VOCAB - 1) if (a + b + c) % 11 else EOS


class _State:
    def __init__(self, tokens, block_ids, num_computed):
        self.tokens, self.block_ids, self.num_computed = tokens, block_ids, num_computed


class SpecFakeRunner:
    """Verifies drafts greedily against ``target`` and proposes ``k`` drafts per request, each
    right with probability ``quality``. Checks the runner contract and the KV of every read."""

    def __init__(self, block_size: int, k: int, quality: float, seed: int = 0):
        self.bs, self.k, self.quality = block_size, k, quality
        self.rng = random.Random(seed)
        self.reqs: dict[str, _State] = {}
        self.kv: dict[tuple[int, int], tuple] = {}

    def propose(self, tokens: list[int]) -> list[int]:
        drafts: list[int] = []
        ctx = list(tokens)
        for _ in range(self.k):
            t = target(ctx) if self.rng.random() < self.quality else self.rng.randrange(VOCAB)
            drafts.append(t)
            ctx.append(t)
        return drafts

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.bs
        for rid in so.finished_req_ids | so.preempted_req_ids:
            del self.reqs[rid]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in so.scheduled_spec_decode_tokens  # nothing to verify yet
            self.reqs[new.req_id] = _State(list(new.prompt_token_ids) + list(new.output_token_ids),
                                           list(new.block_ids), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for rid, new_ids, nc in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            st = self.reqs[rid]
            assert st.num_computed == nc, (rid, st.num_computed, nc)
            st.block_ids.extend(new_ids)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        seqs = {}
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            assert len(drafts) <= self.k
            seq = st.tokens + drafts
            if drafts:  # drafts are the tail of the scheduled range, right after the last token
                assert st.num_computed + n == len(seq)
            assert st.num_computed + n <= len(seq)
            assert len(st.block_ids) >= cdiv(st.num_computed + n, bs)
            for p in range(st.num_computed, st.num_computed + n):
                self.kv[(st.block_ids[p // bs], p % bs)] = tuple(seq[:p + 1])
            seqs[rid] = seq
        req_ids, sampled, proposed = [], [], []
        for rid, n in so.num_scheduled_tokens.items():
            st, seq = self.reqs[rid], seqs[rid]
            end = st.num_computed + n
            for p in range(end):
                assert self.kv.get((st.block_ids[p // bs], p % bs)) == tuple(seq[:p + 1]), (rid, p)
            out: list[int] = []
            if end >= len(st.tokens):
                drafts = seq[len(st.tokens):]
                for i in range(len(drafts) + 1):  # greedy verification: K+1 positions
                    tok = target(seq[:len(st.tokens) + i])
                    out.append(tok)
                    if i == len(drafts) or tok != drafts[i]:
                        break
                st.num_computed = end - (len(drafts) + 1 - len(out))
                st.tokens.extend(out)
                assert st.num_computed == len(st.tokens) - 1
            else:
                st.num_computed = end
            req_ids.append(rid)
            sampled.append(out)
            proposed.append(self.propose(st.tokens) if out else [])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled,
                                 spec_token_ids=proposed)


def run(k, quality, prompts, *, abort_at=None, seed=0, max_steps=2000, pipelined=False, verify_first=True,
        **sched_kw):
    """``pipelined``: async scheduling as the engine core runs it: step N+1 is scheduled and run
    before step N's output reaches the scheduler (the runner knows its own tokens), except when
    N verified drafts or N+1 speculates, then N's output is applied first. Speculation is on
    two steps, off two (an auto-off rule's decisions), and drafts are proposed only for a step
    that speculates. ``verify_first=False``: N+1 is scheduled even while N's drafts are unverified
    (the scheduler alone then keeps those requests out of N+1)."""
    sched_kw.setdefault("num_blocks", 40)
    sched = make_scheduler(num_speculative_tokens=k, async_scheduling=pipelined, **sched_kw)
    runner = SpecFakeRunner(sched.block_size, k, quality, seed)
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for i, (prompt, kw) in enumerate(prompts):
        sched.add_request(make_request(prompt, req_id=f"q{i}", eos=EOS, **kw))
    step = 0
    in_flight = None

    def apply(so, mro):
        for o in sched.update_from_output(so, mro):
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason

    while sched.has_requests() or in_flight is not None:
        if abort_at and step in abort_at:
            sched.finish_requests(abort_at[step], RequestStatus.FINISHED_ABORTED)
        if pipelined:
            sched.speculate = (step // 2) % 2 == 0
            verify = verify_first and in_flight is not None and in_flight[0].scheduled_spec_decode_tokens
            if in_flight is not None and (sched.speculate or verify):
                apply(*in_flight)
                in_flight = None
        so = sched.schedule()
        if pipelined:
            for rid in so.scheduled_spec_decode_tokens:  # drafts follow the request's last token
                assert sched.requests[rid].num_output_placeholders == 1  # this step's
            for rid in so.num_scheduled_tokens:  # drafts are verified before their request runs again
                assert in_flight is None or rid not in in_flight[0].scheduled_spec_decode_tokens
            mro = runner.execute(so)
            if not ((step + 1) // 2) % 2 == 0:  # the next step will not speculate: no proposals
                mro.spec_token_ids = None
            if in_flight is not None:
                apply(*in_flight)
            in_flight = (so, mro) if so.total_num_scheduled_tokens else None
            check_pool_invariants(sched, slack=k + 1)
            step += 1
            assert step < max_steps
            continue
        assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        for rid in so.scheduled_spec_decode_tokens:
            req = sched.requests[rid]
            # Drafts are scheduled but never known tokens: never hashed, never cached.
            num_known_blocks = len(req.all_token_ids) // sched.block_size
            assert len(req.block_hashes) == num_known_blocks
            assert sched.kv_cache_manager.num_cached_block.get(rid, 0) <= num_known_blocks
        apply(so, runner.execute(so))
        check_pool_invariants(sched, slack=k)
        step += 1
        assert step < max_steps
    assert_all_free(sched)
    return outs, reasons, sched


def prompts_for(seed, n=8):
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]
    out = []
    for i in range(n):
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))]
        prompt = (shared if i % 2 else []) + tail
        out.append((prompt, dict(max_tokens=rng.randrange(1, 30), priority=rng.randrange(3),
                                 ignore_eos=bool(i % 3))))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k,quality", [(1, 0.5), (3, 0.8), (4, 1.0), (5, 0.0)])
def test_greedy_identity_under_pressure(seed, k, quality):
    """Tight pools (preemption), small budgets (chunking, drafts cut), priorities, shared prefixes."""
    prompts = prompts_for(seed)
    kw = dict(num_blocks=14 + seed, block_size=4, max_model_len=48,
              max_num_batched_tokens=6 + 3 * seed, max_num_seqs=4 + seed % 3,
              policy="priority" if seed % 2 else "fcfs")
    ref, ref_reasons, _ = run(0, 0.0, prompts, **kw)
    got, reasons, sched = run(k, quality, prompts, seed=seed, **kw)
    assert got == ref and reasons == ref_reasons
    stats = sched.spec_decoding_stats
    assert stats is not None and stats.num_drafts > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    if k == 3:  # the pressure is real: these runs preempt and hit the prefix cache
        assert sched.num_preemptions > 0
        assert sched.kv_cache_manager.prefix_cache_stats.hits > 0
    if quality == 1.0:  # perfect drafts: everything scheduled is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if quality == 0.0:
        assert stats.acceptance_rate < 0.5


@pytest.mark.parametrize("verify_first", [True, False])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k,quality", [(2, 0.7), (4, 1.0)])
def test_pipelined_async_scheduling_keeps_greedy_identity(seed, k, quality, verify_first):
    """Async scheduling with drafts: the next step is scheduled before the drafts' verification
    is known; under preemption, chunking and priorities the output is plain decoding's, a
    request waits for its drafts' verification, and every block comes back."""
    prompts = prompts_for(seed + 20)
    kw = dict(num_blocks=14 + seed, block_size=4, max_model_len=48,
              max_num_batched_tokens=6 + 3 * seed, max_num_seqs=4 + seed % 3,
              policy="priority" if seed % 2 else "fcfs")
    ref, ref_reasons, _ = run(0, 0.0, prompts, **kw)
    got, reasons, sched = run(k, quality, prompts, seed=seed, pipelined=True, verify_first=verify_first, **kw)
    assert got == ref and reasons == ref_reasons
    stats = sched.spec_decoding_stats
    assert stats is not None and stats.num_drafts > 0
    if quality == 1.0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize("verify_first", [True, False])
def test_pipelined_aborts_and_preemption_with_drafts_in_flight(verify_first):
    prompts = prompts_for(11)
    kw = dict(num_blocks=14, block_size=4, max_model_len=48, max_num_batched_tokens=10)
    ref, _, _ = run(0, 0.0, prompts, **kw)
    got, reasons, sched = run(3, 0.9, prompts, abort_at={3: ["q1", "q4"], 6: ["q6", "q0"]}, pipelined=True,
                              verify_first=verify_first, **kw)
    assert sched.num_preemptions > 0
    for rid, toks in got.items():
        assert toks == ref[rid][:len(toks)]
        if reasons.get(rid) != "abort":
            assert toks == ref[rid]


def test_aborts_keep_outputs_and_free_blocks():
    prompts = prompts_for(11)
    kw = dict(num_blocks=18, block_size=4, max_model_len=48, max_num_batched_tokens=10)
    ref, _, _ = run(0, 0.0, prompts, **kw)
    got, reasons, _ = run(3, 0.7, prompts, abort_at={3: ["q1", "q4"], 6: ["q6", "q0"]}, **kw)
    for rid, toks in got.items():
        assert toks == ref[rid][:len(toks)]  # aborted ones: a prefix of the reference
        if reasons.get(rid) != "abort":
            assert toks == ref[rid]


def test_budget_takes_a_prefix_of_drafts_and_trims_to_max_tokens():
    sched = make_scheduler(num_speculative_tokens=4, max_num_batched_tokens=3, block_size=4)
    req = make_request([1, 2, 3], max_tokens=4, eos=None)
    sched.add_request(req)
    runner = SpecFakeRunner(4, 4, 1.0)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    assert req.num_output_tokens == 1 and len(req.spec_token_ids) == 4
    drafts = list(req.spec_token_ids)
    so = sched.schedule()
    # max_tokens=4 with one output: three drafts at most could be kept; budget 3 takes two.
    assert so.num_scheduled_tokens[req.request_id] == 3
    assert so.scheduled_spec_decode_tokens[req.request_id] == drafts[:2]
    assert req.spec_token_ids == []  # handed to the runner; the next come back with its output
    sched.update_from_output(so, runner.execute(so))
    assert req.num_output_tokens == 4 and req.is_finished()


def test_drafts_trimmed_to_max_tokens():
    sched = make_scheduler(num_speculative_tokens=4, block_size=4)
    req = make_request([1, 2, 3], max_tokens=3, eos=None)
    sched.add_request(req)
    runner = SpecFakeRunner(4, 4, 0.0)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()
    assert len(so.scheduled_spec_decode_tokens[req.request_id]) == 1  # 2 outputs left


def test_rejection_rolls_back_without_freeing():
    sched = make_scheduler(num_speculative_tokens=5, block_size=4, max_num_batched_tokens=64)
    req = make_request([1, 2, 3, 4], max_tokens=20, eos=None)
    sched.add_request(req)
    runner = SpecFakeRunner(4, 5, 0.0, seed=3)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    free_before = sched.kv_cache_manager.num_free_blocks
    so = sched.schedule()
    drafts = so.scheduled_spec_decode_tokens[req.request_id]
    assert len(drafts) == 5 and so.num_scheduled_tokens[req.request_id] == 6
    assert req.num_computed_tokens == 10  # booked at schedule time, drafts included
    mro = runner.execute(so)
    accepted = len(mro.sampled_token_ids[0]) - 1
    sched.update_from_output(so, mro)
    assert req.num_computed_tokens == req.num_tokens - 1 == 5 + accepted
    assert sched.kv_cache_manager.num_free_blocks == free_before - 2  # 10 slots: 3 blocks, none freed
    assert len(req.block_hashes) == req.num_tokens // 4


def test_lookahead_slots_are_allocated_not_cached():
    sched = make_scheduler(num_speculative_tokens=2, num_lookahead_tokens=4, block_size=4)
    req = make_request([1, 2, 3, 4, 1, 2, 3], max_tokens=5)
    sched.add_request(req)
    sched.schedule()
    assert len(sched.kv_cache_manager.req_to_blocks[req.request_id]) == cdiv(7 + 4, 4)
    assert len(req.block_hashes) == 1


def test_config_refuses_negative_spec_tokens():
    assert SchedulerConfig(num_speculative_tokens=2, async_scheduling=True).async_scheduling  # combined
    with pytest.raises(ValueError, match="non-negative"):
        SchedulerConfig(num_speculative_tokens=-1)


class PrefixGrammar:
    """Hooks whose grammar allows only tokens below ``limit``: drafts are cut at the first other."""

    def __init__(self, limit: int):
        self.limit = limit
        self.validated: list[list[int]] = []

    def grammar_status(self, request_id):
        return "ready"

    def accept_tokens(self, request_id, token_ids):
        return False

    def release(self, request_id):
        pass

    def validate_tokens(self, request_id, token_ids):
        self.validated.append(list(token_ids))
        n = 0
        while n < len(token_ids) and token_ids[n] < self.limit:
            n += 1
        return n


def test_the_grammar_cuts_drafts_at_the_first_invalid_one():
    from jaxserve.core.structured_outputs import StructuredOutputsParams

    sched = make_scheduler(num_speculative_tokens=4, block_size=4)
    sched.structured_outputs = hooks = PrefixGrammar(limit=3)
    free = make_request([1, 2, 3], max_tokens=10, eos=None)
    constrained = make_request([1, 2, 3], max_tokens=10, eos=None,
                               structured_outputs=StructuredOutputsParams(regex="x+"))
    sched.add_request(free)
    sched.add_request(constrained)
    so = sched.schedule()
    out = ModelRunnerOutput([free.request_id, constrained.request_id],
                            {free.request_id: 0, constrained.request_id: 1}, [[1], [1]],
                            spec_token_ids=[[1, 2, 4, 1], [1, 2, 4, 1]])
    sched.update_from_output(so, out)
    assert free.spec_token_ids == [1, 2, 4, 1]         # no grammar: every draft
    assert constrained.spec_token_ids == [1, 2]        # cut before the 4
    assert hooks.validated == [[1, 2, 4, 1]]
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {free.request_id: [1, 2, 4, 1],
                                               constrained.request_id: [1, 2]}


def _output(so, tokens, drafts=None):
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [tokens.get(r, []) for r in ids],
                             spec_token_ids=[(drafts or {}).get(r, []) for r in ids])


def test_async_preempted_with_drafts_in_flight_keeps_all_accepted_tokens():
    """c verifies two drafts in step 2; step 3, scheduled before that output, preempts c for a's
    block. c's accepted drafts and bonus token all count, and it resumes after them."""
    s = make_scheduler(num_blocks=6, block_size=2, max_model_len=10, enable_caching=False,
                       async_scheduling=True, num_speculative_tokens=2)
    a = make_request([1, 2, 3], req_id="a", ignore_eos=True, max_tokens=6)
    c = make_request([1, 2, 3], req_id="c", ignore_eos=True, max_tokens=6)
    s.add_request(a)
    s.add_request(c)
    so1 = s.schedule()
    s.update_from_output(so1, _output(so1, {"a": [5], "c": [6]}, {"c": [7, 8]}))
    so2 = s.schedule()
    assert so2.scheduled_spec_decode_tokens == {"c": [7, 8]} and c.num_output_placeholders == 1
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {"a": 1} and so3.preempted_req_ids == {"c"}
    outs = {o.request_id: o for o in s.update_from_output(so2, _output(so2, {"a": [9], "c": [7, 8, 4]}))}
    assert outs["c"].new_token_ids == [7, 8, 4] and c.output_token_ids == [6, 7, 8, 4]
    assert c.status == RequestStatus.PREEMPTED and c.num_output_placeholders == 0
    assert s.spec_decoding_stats is not None and s.spec_decoding_stats.num_accepted_tokens == 2
    s.update_from_output(so3, _output(so3, {"a": [9]}))
    while s.has_requests():
        so = s.schedule()
        resumed = next((n for n in so.scheduled_new_reqs if n.req_id == "c"), None)
        if resumed is not None:
            assert resumed.output_token_ids == [6, 7, 8, 4]
        s.update_from_output(so, _output(so, {r: [1] for r in so.num_scheduled_tokens}))
    assert c.output_token_ids == [6, 7, 8, 4, 1, 1] and a.num_output_tokens == 6
    assert_all_free(s)


def test_speculate_rows_limits_the_requests_with_drafts():
    sched = make_scheduler(num_speculative_tokens=2, block_size=4)
    runner = SpecFakeRunner(4, 2, 1.0)
    reqs = [make_request([1, 2, 3, i + 1], req_id=f"s{i}", max_tokens=10, eos=None) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    assert all(len(r.spec_token_ids) == 2 for r in reqs)
    sched.speculate_rows = 2
    so = sched.schedule()
    assert set(so.scheduled_spec_decode_tokens) == {"s0", "s1"}  # the oldest two
    assert [so.num_scheduled_tokens[r.request_id] for r in reqs] == [3, 3, 1, 1]
    assert reqs[2].spec_token_ids == [] and reqs[3].spec_token_ids == []  # dropped, proposed again
    sched.update_from_output(so, runner.execute(so))
    sched.speculate_rows = 0
    so = sched.schedule()
    assert len(so.scheduled_spec_decode_tokens) == 4
