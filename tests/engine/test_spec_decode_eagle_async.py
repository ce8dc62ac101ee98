"""EAGLE and EAGLE-3 under async scheduling (the default): every step overlaps with the next,
speculating or not (the next is scheduled with placeholders for the drafts the head proposes on
the device and corrected there by the accepted count). The head catches up on a step's hidden
states right after the step is launched, so the catch-ups run in the steps' launch order, each
once, and a request that left while its step ran (aborted, finished, preempted) still has the
head's KV written for that step's positions: its blocks stay in the prefix cache.

The rule here is scripted (which steps speculate is the test's choice, not a measurement). Every
draft the head proposes equals the dense computation over its context (tests/eagle_reference.py):
a catch-up lost, doubled, run out of order or fed another step's hidden states leaves the head's
KV stale and changes drafts. Greedy tokens equal the plain engine's, nothing compiles after
warm-up, the pools end empty."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.outputs import RequestOutputKind
from jaxserve.spec_decode.auto_off import AutoOffDecision, SpecAutoOff
from tests.eagle_checks import (
    assert_drafts_equal_the_reference,
    assert_pools_empty,
    recorded_proposals,
    sequences_of,
    write_both_heads,
)
from tests.shapes import ENGINE_TESTS_SHAPE
from tests.spec_helpers import prompts, stats_of

K = 3
SPEC_SHAPE = {**ENGINE_TESTS_SHAPE, "num_gpu_blocks_override": 80}


class ScriptedRule(SpecAutoOff):
    """Speculates on the steps ``pattern`` marks "1" (cycled), measuring nothing: the test picks
    which steps overlap."""

    def __init__(self, pattern: str) -> None:
        super().__init__(K)
        self.pattern, self.calls = pattern, 0

    def decide(self, batch_size: int) -> AutoOffDecision:
        on = self.pattern[self.calls % len(self.pattern)] == "1"
        self.calls += 1
        return AutoOffDecision(on, 1.0, "script")


@pytest.fixture(scope="module")
def heads(demo_model, tmp_path_factory) -> dict[str, str]:
    return write_both_heads(tmp_path_factory.mktemp("heads"), demo_model)


@pytest.fixture(scope="module")
def plain(demo_model):
    return LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def spec(request, demo_model, heads):
    llm = LLM(demo_model, show_progress=False, **SPEC_SHAPE, speculative_auto_off=True,
              speculative_config={"method": request.param, "model": heads[request.param],
                                  "num_speculative_tokens": K})
    assert llm.llm_engine.core.scheduler.scheduler_config.async_scheduling
    return request.param, llm


def new_records(llm: LLM, run):
    last = llm.get_step_records(1)[0].step if llm.get_step_records(1) else -1
    result = run()
    return result, [r for r in llm.get_step_records() if r.step > last]


def test_a_request_gone_while_its_step_runs_leaves_the_heads_kv(spec, heads, demo_model, monkeypatch):
    """A prompt's first chunk is in flight (a plain step) when its request is aborted: its full
    blocks stay cached, and the same prompt again hits them (one block short). The head's KV
    there comes from the aborted request's catch-up, which runs when the chunk is collected,
    after the request left: the drafts after the hit are the dense computation's."""
    which, llm = spec
    engine, core = llm.llm_engine, llm.llm_engine.core
    core.spec_auto_off = rule = ScriptedRule("0")
    ps = prompts(1, seed=11, lo=70, hi=71)
    engine.add_request("gone", ps[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       output_kind=RequestOutputKind.DELTA)
    engine.step()  # the first 64 tokens dispatched, not collected
    assert core._in_flight is not None
    engine.abort_request(["gone"])
    while engine.has_unfinished_requests():
        engine.step()
    rule.pattern = "1"
    seen = recorded_proposals(llm, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    again = llm.generate(ps, params, use_tqdm=False)
    assert again[0].num_cached_tokens == 48
    assert_drafts_equal_the_reference(llm, which, heads[which], demo_model, sequences_of(ps, again), seen,
                                      min_proposals=4)
    assert_pools_empty(llm)


def test_greedy_output_with_overlapped_plain_steps(spec, plain, heads, demo_model, monkeypatch):
    """Speculation switched off and back on (two plain steps, two speculating ones, a plain one,
    over and over): every step overlaps with the next, speculating or not. Under chunked prefill
    and preemption (10 prompts of 90-110 tokens in 80 blocks), with n=2 seeded children, prefix
    hits (the prompts again) and requests aborted while their steps may be in flight, the tokens
    are the plain engine's and every draft is the dense computation's."""
    which, llm = spec
    engine, core = llm.llm_engine, llm.llm_engine.core
    compiles = llm.stats()["compile_num_compiles"]
    ps = prompts(10, seed=2, lo=90, hi=110)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in ps]
    params[1] = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=40, ignore_eos=True)
    want = plain.generate(ps, params, use_tqdm=False)
    core.spec_auto_off = ScriptedRule("00110")
    preemptions, accepted = core.scheduler.num_preemptions, stats_of(llm).num_accepted_tokens
    seen = recorded_proposals(llm, monkeypatch)
    got, records = new_records(llm, lambda: llm.generate(ps, params, use_tqdm=False))
    again = llm.generate(ps[-4:], params[-4:], use_tqdm=False)  # prefix hits (the last freed, last evicted)
    for i in (2, 3, 4):  # greedy ones, aborted while their steps may be in flight
        engine.add_request(f"gone-{i}", ps[i], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           output_kind=RequestOutputKind.DELTA)
    for _ in range(5):
        engine.step()
    engine.abort_request([f"gone-{i}" for i in (2, 3, 4)])
    while engine.has_unfinished_requests():
        engine.step()
    completions = [[c.token_ids for c in o.outputs] for o in want]
    assert [[c.token_ids for c in o.outputs] for o in got] == completions
    assert [[c.token_ids for c in o.outputs] for o in again] == completions[-4:]
    assert all(o.num_cached_tokens > 0 for o in again)
    assert core.scheduler.num_preemptions > preemptions
    ran = [r for r in records if r.token_bucket]
    overlapped = [r for r in ran if not r.sync_reason and r.spec_auto_off.startswith("off")]
    assert len(overlapped) > 5 and all(r.num_draft_tokens == 0 for r in overlapped)
    assert all(r.sync_reason in ("", "preempted") for r in ran)
    assert any(not r.sync_reason and r.num_draft_tokens > 0 for r in ran)  # speculating steps overlapped
    if which == "eagle":  # the near pass-through head's drafts are sometimes right
        assert stats_of(llm).num_accepted_tokens > accepted
    assert_drafts_equal_the_reference(llm, which, heads[which], demo_model, sequences_of(ps, want), seen,
                                      min_proposals=50)
    assert llm.stats()["compile_num_compiles"] == compiles
    assert_pools_empty(llm)
