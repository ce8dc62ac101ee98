"""Speculative decoding with a draft model (``method: draft_model``) on the demo model: greedy
tokens and logprobs equal the plain engine's whether the draft is the target itself (nearly every
draft accepted) or a different, smaller random model with the same tokenizer (few accepted),
also under preemption, chunked prefill and prefix hits; seeded random rows draw the plain
engine's tokens; both KV pools end empty; no compile after warm-up; metrics count the drafts."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.exceptions import ConfigError
from tests.shapes import ENGINE_TESTS_SHAPE
from tests.spec_helpers import (
    assert_metrics_count_the_drafts,
    assert_same_logprobs,
    assert_target_pool_empty,
    prompts,
    stats_of,
    token_ids,
)

K = 3
# The different draft is a third engine (about 15-25 s to build and compile on a loaded 2-core machine).
BOTH_DRAFTS = ["self_draft", pytest.param("low_draft", marks=pytest.mark.slow)]
# The speculating engines get a smaller pool (the same buckets): requests are preempted sooner.
SPEC_SHAPE = {**ENGINE_TESTS_SHAPE, "num_gpu_blocks_override": 80}


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A 2-layer random Llama with the demo model's tokenizer (seed 0, 1024 tokens)."""
    from jaxserve.models.demo import build_checkpoint
    from tests.tiny_models import TINY_CONFIGS

    folder = tmp_path_factory.mktemp("draft") / "llama"
    return str(build_checkpoint(folder, "LlamaForCausalLM", TINY_CONFIGS["LlamaForCausalLM"], seed=0,
                                vocab_size=1024, max_position_embeddings=2048))


@pytest.fixture(scope="module")
def plain(demo_model):
    return LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)


@pytest.fixture(scope="module")
def self_draft(demo_model):
    return LLM(demo_model, show_progress=False, **SPEC_SHAPE,
               speculative_config={"method": "draft_model", "model": demo_model, "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def low_draft(demo_model, other_draft):
    # vLLM's older form: no method, a model.
    return LLM(demo_model, show_progress=False, **SPEC_SHAPE,
               speculative_config={"model": other_draft, "num_speculative_tokens": K})


def assert_pools_empty(llm: LLM) -> None:
    assert_target_pool_empty(llm)
    drafter = llm.llm_engine.core.runner.drafter
    assert drafter.seqs == {} and drafter.num_free_blocks == drafter.num_blocks - 1
    assert drafter.unexpected_compiles == 0


@pytest.mark.parametrize("which", BOTH_DRAFTS)
def test_greedy_tokens_and_logprobs_equal_plain(which, plain, request):
    llm = request.getfixturevalue(which)
    compiles = llm.stats()["compile_num_compiles"]
    before = (stats_of(llm).num_draft_tokens, stats_of(llm).num_accepted_tokens)
    ps = prompts(6, seed=0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    want, got = plain.generate(ps, params, use_tqdm=False), llm.generate(ps, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert_same_logprobs(want, got)
    drafted = stats_of(llm).num_draft_tokens - before[0]
    accepted = stats_of(llm).num_accepted_tokens - before[1]
    assert drafted > 0
    if which == "self_draft":  # the target drafting for itself: its greedy tokens, nearly all kept
        assert accepted >= 0.9 * drafted
    else:  # a different random model: few of its drafts survive
        assert accepted <= 0.5 * drafted
    assert llm.stats()["compile_num_compiles"] == compiles
    assert llm.stats()["compile_unexpected_compiles"] == 0
    assert_pools_empty(llm)


def test_seeded_random_rows_draw_the_plain_tokens(plain, self_draft):
    ps = prompts(3, seed=1)
    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=20, ignore_eos=True) for i in range(3)]
    assert token_ids(self_draft.generate(ps, params, use_tqdm=False)) == \
        token_ids(plain.generate(ps, params, use_tqdm=False))
    assert_pools_empty(self_draft)


def test_penalised_rows_take_the_drafts_with_the_plain_tokens(plain, self_draft):
    """The self-draft proposes the unpenalised greedy tokens: a penalised row accepts those its
    penalties leave first and rejects the rest, and emits the plain engine's tokens."""
    ps = prompts(4, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **kw)
              for kw in (dict(repetition_penalty=1.2), dict(frequency_penalty=0.1), dict(presence_penalty=0.5),
                         dict(frequency_penalty=0.05, presence_penalty=0.1))]
    stats = stats_of(self_draft)
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    assert token_ids(self_draft.generate(ps, params, use_tqdm=False)) == \
        token_ids(plain.generate(ps, params, use_tqdm=False))
    assert 0 < stats.num_accepted_tokens - accepted < stats.num_draft_tokens - drafted
    assert_pools_empty(self_draft)


@pytest.mark.parametrize("which", BOTH_DRAFTS)
def test_chunked_prefill_and_preemption(which, plain, request):
    # Prompts of 90-110 tokens are chunked by the 64-token budget; 16 of them overflow the
    # 80-block pool, so requests are preempted, then recomputed by both models.
    llm = request.getfixturevalue(which)
    ps = prompts(16, seed=2, lo=90, hi=110)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    want = token_ids(plain.generate(ps, params, use_tqdm=False))
    scheduler = llm.llm_engine.core.scheduler
    preemptions = scheduler.num_preemptions
    assert token_ids(llm.generate(ps, params, use_tqdm=False)) == want
    assert scheduler.num_preemptions > preemptions
    assert_pools_empty(llm)


def test_prefix_hits(plain, self_draft):
    ps = prompts(3, seed=3, lo=60, hi=90)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = token_ids(plain.generate(ps, params, use_tqdm=False))
    assert token_ids(self_draft.generate(ps, params, use_tqdm=False)) == want
    again = self_draft.generate(ps, params, use_tqdm=False)  # the target's prefix cache hits
    assert all(o.num_cached_tokens >= 48 for o in again)
    assert token_ids(again) == want
    assert_pools_empty(self_draft)


def test_metrics_count_the_drafts(self_draft):
    assert_metrics_count_the_drafts(self_draft, K)


def test_a_draft_with_another_vocabulary_is_refused_by_name(demo_model, qwen3_checkpoint):
    with pytest.raises(ConfigError, match=r"speculative_config\.model.*vocabulary"):
        LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE,
            speculative_config={"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=r"speculative_config\.model"):
        LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE,
            speculative_config={"method": "draft_model", "model": "/no/such/folder", "num_speculative_tokens": 2})


def test_aborted_requests_free_the_draft_blocks(plain, self_draft):
    """Requests aborted mid-generation return their blocks to both pools; the others finish
    with the plain engine's tokens."""
    engine = self_draft.llm_engine
    ps = prompts(4, seed=6, lo=30, hi=60)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = token_ids(plain.generate(ps[2:], params, use_tqdm=False))
    for i, p in enumerate(ps):
        engine.add_request(f"abort-{i}", p, params)
    drafter = engine.core.runner.drafter
    while not drafter.seqs:  # until the draft holds KV for some requests
        engine.step()
    engine.abort_request(["abort-0", "abort-1"])
    done = {}
    while engine.has_unfinished_requests():
        for _, out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done["abort-2"], done["abort-3"]] == want
    engine.step()  # the last finished ids reach the runner with the next step
    assert_pools_empty(self_draft)
