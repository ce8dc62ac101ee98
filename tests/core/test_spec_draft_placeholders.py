"""The scheduler's draft placeholders (``SchedulerConfig.draft_placeholders``): a speculating
step N+1 is scheduled while step N's drafts are unverified, its bonus token and drafts booked as
placeholders that the runner fills on the device; when N's output comes, the rejected drafts roll
back. A fake runner plays the device's part (it knows its own tokens and corrects the positions
by the rejected count); greedy output must be plain decoding's under preemption, chunking,
priorities, prefix hits and aborts, with every block back at the end."""

from __future__ import annotations

import pytest

from jaxserve.core import ModelRunnerOutput, RequestStatus, SchedulerOutput
from jaxserve.core.scheduler import DRAFT_PLACEHOLDER
from tests.core.core_testing import assert_all_free, check_pool_invariants, make_request, make_scheduler
from tests.core.test_spec_decode_scheduling import EOS, SpecFakeRunner, prompts_for, run


class DeviceDraftRunner(SpecFakeRunner):
    """Fills placeholder drafts with its own proposals after the request's last step (as the
    device would), and checks the scheduler's ``num_computed_tokens`` is its own plus the drafts
    the step in flight rejected, which the scheduler has not seen yet."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.proposed: dict[str, list[int]] = {}
        self.rejected: dict[str, int] = {}  # each request's rejected drafts in the last step
        self.num_placeholder_rows = 0

    def execute(self, so: SchedulerOutput, previous_seen: bool = True) -> ModelRunnerOutput:
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            late = 0 if previous_seen else self.rejected.get(rid, 0)
            cached.num_computed_tokens[i] -= late  # the device's correction
        spec = dict(so.scheduled_spec_decode_tokens)
        for rid, drafts in spec.items():
            if drafts[0] == DRAFT_PLACEHOLDER:
                assert set(drafts) == {DRAFT_PLACEHOLDER} and not previous_seen
                assert len(self.proposed.get(rid, [])) >= len(drafts), rid  # proposed after its last step
                so.scheduled_spec_decode_tokens[rid] = self.proposed[rid][:len(drafts)]
                self.num_placeholder_rows += 1
        try:
            out = super().execute(so)
        finally:
            so.scheduled_spec_decode_tokens.clear()  # the scheduler reads back what it scheduled
            so.scheduled_spec_decode_tokens.update(spec)
        self.rejected = {}
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids):
            verified = len(so.scheduled_spec_decode_tokens.get(rid, []))
            if tokens:
                self.rejected[rid] = verified - (len(tokens) - 1)
        assert out.spec_token_ids is not None
        self.proposed = {rid: d for rid, d in zip(out.req_ids, out.spec_token_ids) if d}
        return out


def run_overlapped(k, quality, prompts, *, abort_at=None, seed=0, speculate=lambda step: True,
                   max_steps=2000, **sched_kw):
    """The engine's loop with draft placeholders: step N+1 is scheduled and run before step N's
    output is applied, always; ``speculate(step)`` is the auto-off rule's decision per step."""
    sched_kw.setdefault("num_blocks", 40)
    sched = make_scheduler(num_speculative_tokens=k, async_scheduling=True, draft_placeholders=True, **sched_kw)
    runner = DeviceDraftRunner(sched.block_size, k, quality, seed)
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for i, (prompt, kw) in enumerate(prompts):
        sched.add_request(make_request(prompt, req_id=f"q{i}", eos=EOS, **kw))
    in_flight = None
    step = 0
    while sched.has_requests() or in_flight is not None:
        if abort_at and step in abort_at:
            sched.finish_requests(abort_at[step], RequestStatus.FINISHED_ABORTED)
        sched.speculate = speculate(step)
        so = sched.schedule()
        if speculate(step + 1):
            sched.expect_drafts(so)
        mro = runner.execute(so, previous_seen=in_flight is None)
        if not speculate(step + 1):
            mro.spec_token_ids = None
            runner.proposed = {}
        if in_flight is not None:
            for o in sched.update_from_output(*in_flight):
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason:
                    reasons[o.request_id] = o.finish_reason
        in_flight = (so, mro) if so.total_num_scheduled_tokens else None
        check_pool_invariants(sched, slack=2 * k + 2)
        step += 1
        assert step < max_steps
    assert_all_free(sched)
    return outs, reasons, sched, runner


PRESSURE = [dict(num_blocks=14 + seed, block_size=4, max_model_len=48, max_num_batched_tokens=6 + 3 * seed,
                 max_num_seqs=4 + seed % 3, policy="priority" if seed % 2 else "fcfs") for seed in range(4)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k,quality", [(1, 0.5), (3, 0.8), (4, 1.0), (2, 0.0)])
def test_overlapped_speculation_keeps_greedy_identity(seed, k, quality):
    """Tight pools (preemption), small budgets (chunking, drafts cut), priorities, shared prefixes."""
    prompts = prompts_for(seed + 40)
    ref, ref_reasons, _ = run(0, 0.0, prompts, **PRESSURE[seed])
    got, reasons, sched, runner = run_overlapped(k, quality, prompts, seed=seed, **PRESSURE[seed])
    assert got == ref and reasons == ref_reasons
    stats = sched.spec_decoding_stats
    assert stats is not None and stats.num_drafts > 0 and runner.num_placeholder_rows > 0
    if quality == 1.0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if k == 3:  # the pressure is real: these runs preempt and hit the prefix cache
        assert sched.num_preemptions > 0 and sched.kv_cache_manager.prefix_cache_stats.hits > 0


@pytest.mark.parametrize("seed", range(3))
def test_auto_off_steps_and_aborts_mid_flight(seed):
    """Speculation on and off by turns (a plain step after a speculating one, and back), requests
    aborted while their placeholder steps are in flight: the others' output is plain decoding's."""
    prompts = prompts_for(seed + 50)
    kw = dict(num_blocks=16, block_size=4, max_model_len=48, max_num_batched_tokens=12)
    ref, ref_reasons, _ = run(0, 0.0, prompts, **kw)
    aborts = {4: ["q1", "q4"], 9: ["q6"]}
    got, reasons, sched, runner = run_overlapped(3, 0.8, prompts, seed=seed, speculate=lambda s: (s // 3) % 2 == 0,
                                                 abort_at=aborts, **kw)
    assert runner.num_placeholder_rows > 0
    aborted = {rid for ids in aborts.values() for rid in ids}
    for rid, toks in ref.items():
        if rid in aborted:  # a prefix of the reference, whatever was in flight
            assert got.get(rid, []) == toks[:len(got.get(rid, []))]
        else:
            assert got[rid] == toks and reasons[rid] == ref_reasons[rid]


def test_one_stream_overlaps_every_speculating_step():
    """A steady decode of one request: after its first sampled token, every step schedules the
    drafts proposed after the step still in flight (no wait for a verification)."""
    prompts = [([1, 2, 3, 4, 1, 2], dict(max_tokens=40, ignore_eos=True))]
    got, _, sched, runner = run_overlapped(3, 0.7, prompts, seed=3)
    ref, _, _ = run(0, 0.0, prompts)
    assert got == ref
    stats = sched.spec_decoding_stats
    assert stats is not None
    assert runner.num_placeholder_rows >= stats.num_drafts - 2  # all but the first speculating steps


def test_booking_and_rollback_arithmetic():
    """One request, K=3: the placeholders count the bonus token and the drafts; a rejection rolls
    back both, and the next step (already scheduled) continues from the corrected count."""
    s = make_scheduler(num_speculative_tokens=3, async_scheduling=True, draft_placeholders=True, block_size=4)
    req = make_request([1, 2, 3], req_id="r", max_tokens=20, eos=None)
    s.add_request(req)
    so1 = s.schedule()  # the prompt
    s.expect_drafts(so1)
    assert req.num_output_placeholders == 1 and req.spec_token_ids == [DRAFT_PLACEHOLDER] * 3
    so2 = s.schedule()  # the in-flight token and three placeholder drafts
    assert so2.num_scheduled_tokens == {"r": 4} and so2.scheduled_spec_decode_tokens == {"r": [-1, -1, -1]}
    assert req.num_computed_tokens == 7 and req.num_output_placeholders == 5
    s.expect_drafts(so2)
    out1 = ModelRunnerOutput(["r"], {"r": 0}, [[9]], spec_token_ids=[[5, 6, 7]])
    s.update_from_output(so1, out1)
    assert req.output_token_ids == [9] and req.num_output_placeholders == 4
    assert req.spec_token_ids == [DRAFT_PLACEHOLDER] * 3  # for the step after so2, still in flight
    so3 = s.schedule()  # before so2's verification
    assert so3.num_scheduled_tokens == {"r": 4} and req.num_computed_tokens == 11
    out2 = ModelRunnerOutput(["r"], {"r": 0}, [[5, 8]], spec_token_ids=[[1, 1, 1]])  # 1 of 3 accepted
    s.update_from_output(so2, out2)
    assert req.output_token_ids == [9, 5, 8]
    assert req.num_computed_tokens == 9 and req.num_output_placeholders == 4  # so3's token and drafts
    assert req.num_computed_tokens == req.num_tokens - 1 + req.num_output_placeholders


def test_drafts_trimmed_as_if_every_placeholder_came():
    """max_tokens=6, K=3: the step after the prompt books its token and three drafts (up to 4
    outputs); the next, scheduled before any of them is known, could keep only one more token,
    so it gets no drafts."""
    s = make_scheduler(num_speculative_tokens=3, async_scheduling=True, draft_placeholders=True, block_size=4)
    req = make_request([1, 2, 3], req_id="r", max_tokens=6, eos=None)
    s.add_request(req)
    s.expect_drafts(s.schedule())
    so2 = s.schedule()
    assert so2.scheduled_spec_decode_tokens == {"r": [DRAFT_PLACEHOLDER] * 3}
    s.expect_drafts(so2)
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {"r": 1} and so3.scheduled_spec_decode_tokens == {}
    assert req.num_output_placeholders == 6  # all it may still produce: no further step
    assert s.schedule().num_scheduled_tokens == {}


def test_config_needs_async_scheduling_and_drafts():
    from jaxserve.core import SchedulerConfig

    with pytest.raises(ValueError, match="draft_placeholders"):
        SchedulerConfig(num_speculative_tokens=2, draft_placeholders=True)
    with pytest.raises(ValueError, match="draft_placeholders"):
        SchedulerConfig(async_scheduling=True, draft_placeholders=True)
