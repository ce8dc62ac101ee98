"""Speculative decoding (n-gram) end to end on the demo model: greedy output and logprobs equal
the plain engine's, also under preemption, prefix hits and chunked prefill; seeded random rows
draw the plain engine's tokens; no compile after warm-up; no KV block leaks."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.shapes import ENGINE_TESTS_SHAPE

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def plain(demo_model):
    return LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)


@pytest.fixture(scope="module")
def spec(demo_model):
    return LLM(demo_model, show_progress=False, speculative_config=NGRAM, **ENGINE_TESTS_SHAPE)


def repetitive_prompts(n: int, seed: int, period: int = 7, repeats: int = 3, alphabet: int = 1000) -> list[dict]:
    """Copy-heavy prompts (a random phrase said again), so the proposer finds drafts; a small
    ``alphabet`` repeats tokens inside the phrase (and so inside one step's drafts)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = rng.integers(3, 3 + alphabet, period).tolist()
        out.append({"prompt_token_ids": phrase * repeats + phrase[: int(rng.integers(1, period))]})
    return out


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_empty(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1


def spec_stats(llm: LLM):
    return llm.llm_engine.core.scheduler.spec_decoding_stats


def test_greedy_and_logprobs_equal_plain_without_recompiles(plain, spec):
    compiles = spec.stats()["compile_num_compiles"]
    assert compiles == len(spec.stats()["token_buckets"])
    assert spec.llm_engine.core.scheduler.scheduler_config.async_scheduling  # combined with speculation
    before = spec_stats(spec).num_accepted_tokens
    prompts = repetitive_prompts(6, seed=0)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    want, got = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    for w, g in zip(want, got):
        wl, gl = w.outputs[0].logprobs, g.outputs[0].logprobs
        assert len(gl) == len(wl) == 30
        for a, b in zip(wl, gl):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)
        assert abs(w.outputs[0].cumulative_logprob - g.outputs[0].cumulative_logprob) < 1e-3
    stats = spec_stats(spec)
    assert stats.num_accepted_tokens - before > 30  # drafts were accepted: fewer steps than tokens
    assert stats.num_accepted_tokens_per_pos[0] >= max(stats.num_accepted_tokens_per_pos)
    assert spec.stats()["compile_num_compiles"] == compiles
    assert spec.stats()["compile_unexpected_compiles"] == 0
    assert_pool_empty(spec)


def test_mixed_batch_seeded_random_and_penalties(plain, spec):
    """Seeded random rows draw each token with the plain step's key; a penalised row among them
    speculates too (its penalties count the drafts before each position)."""
    prompts = repetitive_prompts(4, seed=1)
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=25, ignore_eos=True) for i in range(3)]
    params.append(SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=25, ignore_eos=True))
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == \
        token_ids(plain.generate(prompts, params, use_tqdm=False))
    assert_pool_empty(spec)


PENALTIES = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7), dict(presence_penalty=0.9),
             dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2),
             dict(frequency_penalty=0.2), dict(presence_penalty=0.3), dict(frequency_penalty=0.05),
             dict(repetition_penalty=1.05, frequency_penalty=0.1)]


def assert_same_logprobs(want, got) -> None:
    for w, g in zip(want, got):
        wl, gl = w.outputs[0].logprobs, g.outputs[0].logprobs
        assert len(gl) == len(wl)
        for a, b in zip(wl, gl):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


def test_penalised_rows_speculate_with_the_plain_tokens_and_logprobs(plain, spec):
    """Repetition, frequency and presence penalties at each verified position count the drafts
    before it: greedy tokens and logprobs equal the plain engine's while penalised rows get
    drafts, some accepted and some rejected (a rejected draft must not stay counted, an accepted
    one must), with no new compiled program."""
    stats, compiles = spec_stats(spec), spec.stats()["compile_num_compiles"]
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    prompts = repetitive_prompts(len(PENALTIES), seed=11, period=6, repeats=4, alphabet=3)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, **kw) for kw in PENALTIES]
    want, got = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert_same_logprobs(want, got)
    num_accepted = stats.num_accepted_tokens - accepted
    assert 0 < num_accepted < stats.num_draft_tokens - drafted
    assert spec.stats()["compile_num_compiles"] == compiles  # no new step variant
    assert spec.stats()["compile_unexpected_compiles"] == 0
    assert_pool_empty(spec)


def test_penalised_seeded_random_rows_speculate(plain, spec):
    """Seeded random rows with penalties draw the plain engine's tokens, all together and one
    alone (the draws and the counts are per position, whatever shares the step). A low
    temperature, so the random demo model's draws match some drafts."""
    stats = spec_stats(spec)
    accepted = stats.num_accepted_tokens
    prompts = repetitive_prompts(len(PENALTIES), seed=11, period=6, repeats=4, alphabet=3)
    params = [SamplingParams(temperature=0.05, seed=20 + i, max_tokens=30, ignore_eos=True, **kw)
              for i, kw in enumerate(PENALTIES)]
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == want
    assert token_ids(spec.generate(prompts[:1], params[:1], use_tqdm=False)) == want[:1]
    assert stats.num_accepted_tokens > accepted
    assert_pool_empty(spec)


def test_min_tokens_parallel_sampling_and_a_grammar(plain, spec):
    """min_tokens masks each scored position by its own count; n=2 children speculate apart; a
    constrained request follows its grammar as in the plain engine."""
    from jaxserve import StructuredOutputsParams

    prompts = repetitive_prompts(3, seed=5)
    eos = plain.llm_engine.tokenizer.eos_token_id
    params = [SamplingParams(temperature=0, min_tokens=12, max_tokens=30, stop_token_ids=[eos]),
              SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[a-z]{4}"))]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert len(got[0].outputs[0].token_ids) >= 12
    assert len(got[2].outputs[0].text) == 8 and got[2].outputs[0].text[3] == "-"
    assert_pool_empty(spec)


def test_constrained_rows_speculate_within_their_grammar(plain, spec):
    """A constrained row gets drafts cut at the first token its grammar refuses, and each verified
    position is masked by the grammar after the drafts before it: greedy tokens and logprobs equal
    the plain engine's, with drafts accepted; every output matches its regex."""
    import re

    from jaxserve import StructuredOutputsParams

    regexes = ["(ab ){6,9}", "[a-c]{2}( [a-c]{2}){5,8}", "(12-){4}[0-9]{4}"]
    prompts = repetitive_prompts(len(regexes), seed=13, period=5, repeats=3)
    params = [SamplingParams(temperature=0, max_tokens=40, logprobs=2,
                             structured_outputs=StructuredOutputsParams(regex=r)) for r in regexes]
    stats = spec_stats(spec)
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    want, got = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert_same_logprobs(want, got)
    assert all(re.fullmatch(r, o.outputs[0].text) for r, o in zip(regexes, got)), [o.outputs[0].text for o in got]
    assert stats.num_accepted_tokens - accepted > 0 and stats.num_draft_tokens > drafted
    assert spec.stats()["compile_unexpected_compiles"] == 0
    assert_pool_empty(spec)


def test_chunked_prefill_and_preemption(plain, spec):
    # Prompts longer than the 64-token budget are chunked; 16 of them at up to ~200 tokens each
    # overflow the 160-block pool, so requests are preempted and recomputed.
    prompts = repetitive_prompts(16, seed=2, period=20, repeats=4)
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    core = spec.llm_engine.core
    preemptions = core.scheduler.num_preemptions
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == want
    assert core.scheduler.num_preemptions > preemptions
    assert_pool_empty(spec)


def test_prefix_hits(plain, spec):
    prompts = repetitive_prompts(3, seed=3, period=16, repeats=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == want
    again = spec.generate(prompts, params, use_tqdm=False)  # the prompts' blocks come from the cache
    assert all(o.num_cached_tokens >= 48 for o in again)
    assert token_ids(again) == want
    assert_pool_empty(spec)


def test_metrics(spec):
    spec.generate(repetitive_prompts(4, seed=4), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                  use_tqdm=False)
    stats = spec_stats(spec)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    metrics = {(m.name, (m.labels or {}).get("position")): m.value for m in spec.get_metrics()
               if m.name.startswith("jaxserve:spec_decode") and (m.labels or {}).get("engine") != "total"}
    assert metrics[("jaxserve:spec_decode_num_drafts_total", None)] == stats.num_drafts
    assert metrics[("jaxserve:spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert metrics[("jaxserve:spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens
    per_pos = [metrics[("jaxserve:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(3)]
    padded = stats.num_accepted_tokens_per_pos + [0] * (3 - len(stats.num_accepted_tokens_per_pos))
    assert per_pos == padded and sum(per_pos) == stats.num_accepted_tokens
    text = spec.llm_engine.metrics.render().decode()
    assert 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{engine="0"' in text


def test_async_llm_streams_several_tokens_a_step(plain, spec):
    """The serving path (AsyncLLM over the same engine): a step may bring the accepted drafts and
    one token at once; the stream ends with the plain engine's tokens and logprobs."""
    import asyncio

    from jaxserve import AsyncLLM

    prompt = repetitive_prompts(1, seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    async_llm = AsyncLLM(spec.llm_engine)
    deltas: list[list[int]] = []
    logprobs: list = []

    async def main():  # AsyncLLM streams deltas, as the server does
        async for out in async_llm.generate(prompt, params, "stream-1"):
            deltas.append(list(out.outputs[0].token_ids))
            logprobs.extend(out.outputs[0].logprobs)

    try:
        asyncio.run(main())
    finally:
        async_llm.shutdown()
    assert [t for d in deltas for t in d] == want.token_ids
    assert [sorted(lp) for lp in logprobs] == [sorted(lp) for lp in want.logprobs]
    assert max(map(len, deltas)) > 1  # some update carried several tokens


def test_step_records_and_trace_count_drafts(spec):
    """Each step's record holds its scheduled and accepted drafts per request; their sums equal
    the scheduler's counters over the same steps, and the trace's step args carry them."""
    last = spec.get_step_records(1)[0].step if spec.get_step_records(1) else -1
    before = spec_stats(spec).copy()
    spec.generate(repetitive_prompts(3, seed=5), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                  use_tqdm=False)
    stats = spec_stats(spec)
    records = [r for r in spec.get_step_records() if r.step > last]
    drafts = sum(r.num_draft_tokens for r in records)
    accepted = sum(r.num_accepted_tokens for r in records)
    assert drafts == stats.num_draft_tokens - before.num_draft_tokens > 0
    assert accepted == stats.num_accepted_tokens - before.num_accepted_tokens > 0
    for r in records:
        assert set(r.spec_accepted) <= set(r.spec_drafts) <= set(r.scheduled)
        assert all(0 <= r.spec_accepted[i] <= n for i, n in r.spec_drafts.items() if i in r.spec_accepted)
        assert all(len(r.sampled[i]) == r.spec_accepted[i] + 1 for i in r.spec_accepted)
        d = r.as_dict()["spec_decode"]
        assert (d["num_draft_tokens"], d["num_accepted_tokens"]) == (r.num_draft_tokens, r.num_accepted_tokens)
    trace = spec.llm_engine.build_trace(num_steps=len(records))
    steps = {e["name"]: e["args"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("step ")}
    assert sum(a["spec_draft_tokens"] for n, a in steps.items() if n.endswith("schedule+prepare")) == drafts
    assert sum(a["spec_accepted_tokens"] for n, a in steps.items() if n.endswith("collect+update")) == accepted


@pytest.fixture(scope="module")
def auto(demo_model):
    return LLM(demo_model, show_progress=False, speculative_config=NGRAM, speculative_auto_off=True,
               **ENGINE_TESTS_SHAPE)


def new_records(llm: LLM, run):
    last = llm.get_step_records(1)[0].step if llm.get_step_records(1) else -1
    result = run()
    return result, [r for r in llm.get_step_records() if r.step > last]


def test_auto_off_rule_keeps_greedy_output_and_records_its_decisions(plain, auto):
    prompts = repetitive_prompts(4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got, records = new_records(auto, lambda: auto.generate(prompts, params, use_tqdm=False))
    assert token_ids(got) == token_ids(plain.generate(prompts, params, use_tqdm=False))
    decided = [r for r in records if r.spec_auto_off]
    assert decided and all(r.spec_auto_off.startswith(("on (", "off (")) for r in decided)
    # An "off" step verifies no draft; the first steps measure both step sizes.
    assert all(r.num_draft_tokens == 0 for r in decided if r.spec_auto_off.startswith("off"))
    assert any(r.num_draft_tokens for r in decided)
    assert_pool_empty(auto)


def test_auto_off_skips_drafts_when_speculation_does_not_pay_and_switches_back(plain, auto):
    """A rule that has measured steep per-token cost and no acceptance turns drafts off; once
    acceptance is measured high it turns them on again. Greedy output is the plain engine's."""
    from jaxserve.spec_decode.auto_off import SpecAutoOff

    def measured(a: float, b: float) -> None:  # many steps: the real ones barely move the fit
        rule.steps.clear()
        for _ in range(200):
            rule.observe_step(1, a + b)
            rule.observe_step(64, a + 64 * b)

    rule = SpecAutoOff(3, probe_every=10**6, prior_alpha=0.0)
    measured(0.0, 0.001)  # compute-bound: only accepted drafts could pay
    core = auto.llm_engine.core
    core.spec_auto_off = rule
    prompts = repetitive_prompts(3, seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    try:
        got, records = new_records(auto, lambda: auto.generate(prompts, params, use_tqdm=False))
        assert token_ids(got) == want
        decided = [r for r in records if r.spec_auto_off]
        assert decided and all(r.spec_auto_off.startswith("off (gain") for r in decided)
        assert sum(r.num_draft_tokens for r in records) == 0
        for _ in range(100):
            rule.observe_acceptance(10, 10)
        measured(1.0, 0.001)  # a large fixed cost per step: speculation pays
        got, records = new_records(auto, lambda: auto.generate(prompts, params, use_tqdm=False))
        assert token_ids(got) == want
        decided = [r for r in records if r.spec_auto_off]
        assert decided and all(r.spec_auto_off.startswith("on (gain") for r in decided)
        assert sum(r.num_accepted_tokens for r in records) > 0
    finally:
        core.spec_auto_off = SpecAutoOff(3)
    assert_pool_empty(auto)


def test_async_scheduling_overlaps_plain_steps_and_waits_for_verification(plain, auto):
    """A rule that finds speculation too dear and probes it every fourth step: the plain steps
    after a plain one overlap with the step in flight, a step after verified drafts is scheduled
    once their accepted count is in, and a probing step once the step before's tokens are.
    Under preemption and chunked prefill, with n=2 seeded children and aborted requests, the
    tokens are the plain engine's, no program compiles and every block comes back."""
    from jaxserve.engine.outputs import RequestOutputKind
    from jaxserve.spec_decode.auto_off import SpecAutoOff

    core = auto.llm_engine.core
    assert core.scheduler.scheduler_config.async_scheduling
    compiles = auto.stats()["compile_num_compiles"]
    prompts = repetitive_prompts(16, seed=2, period=20, repeats=4)  # chunked; the 160-block pool preempts
    params = [SamplingParams(temperature=0, max_tokens=120, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=120, ignore_eos=True)
    want = plain.generate(prompts, params, use_tqdm=False)
    rule = SpecAutoOff(3, probe_every=4, prior_alpha=0.0)
    for _ in range(200):  # compute-bound steps: only accepted drafts could pay
        rule.observe_step(1, 0.001)
        rule.observe_step(64, 0.064)
    core.spec_auto_off = rule
    preemptions = core.scheduler.num_preemptions
    try:
        got, records = new_records(auto, lambda: auto.generate(prompts, params, use_tqdm=False))
        engine = auto.llm_engine
        for i in range(3):  # aborted while their drafts may be in flight
            engine.add_request(f"gone-{i}", prompts[i], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                               output_kind=RequestOutputKind.DELTA)
        for _ in range(6):
            engine.step()
        engine.abort_request([f"gone-{i}" for i in range(3)])
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        core.spec_auto_off = SpecAutoOff(3)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert core.scheduler.num_preemptions > preemptions
    ran = [r for r in records if r.token_bucket]
    overlapped = [r for r in ran if not r.sync_reason and r.spec_auto_off.startswith("off")]
    assert len(overlapped) > 5 and all(r.num_draft_tokens == 0 for r in overlapped)
    assert any(r.sync_reason == "verify" for r in ran) and any(r.sync_reason == "drafts" for r in ran)
    assert all(r.sync_reason in ("", "verify", "drafts") for r in ran)
    assert sum(r.num_accepted_tokens for r in ran) > 0
    assert auto.stats()["compile_num_compiles"] == compiles
    assert_pool_empty(auto)
