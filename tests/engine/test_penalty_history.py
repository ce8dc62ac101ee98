"""Penalties see a request's whole prompt and every output, whatever the prefix cache served and
across preemption: greedy output with penalties is the same with caching on or off, with or
without preemptions."""

from __future__ import annotations

import numpy as np

from jaxserve import LLM, SamplingParams
from tests.engine.test_engine_features import assert_pool_empty
from tests.shapes import ENGINE_TESTS_SHAPE

# 48 tokens: three full 16-token blocks, of which a second request finds the first two cached.
PROMPT = [593] + list(range(101, 148))


def greedy_tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_repetition_penalty_sees_the_prompt_a_prefix_hit_served(demo_model):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=10.0)
    uncached = LLM(demo_model, show_progress=False, **{**ENGINE_TESTS_SHAPE, "enable_prefix_caching": False})
    want = greedy_tokens(uncached, [{"prompt_token_ids": PROMPT}], params)
    cached = LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)
    greedy_tokens(cached, [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=1))
    hits = cached.stats()["prefix_cache_hits"]
    assert greedy_tokens(cached, [{"prompt_token_ids": PROMPT}], params) == want
    assert cached.stats()["prefix_cache_hits"] - hits == 32  # the second run really was served from cache
    assert PROMPT[0] not in want[0]  # the penalized first prompt token is not repeated
    assert_pool_empty(cached)


def test_penalties_survive_preemption_and_prefix_hits(demo_model):
    """A pool too small for the batch preempts and resumes requests, whose recomputation finds
    their own freed blocks in the prefix cache; outputs match a roomy engine without caching."""
    rng = np.random.default_rng(4)
    shared = rng.integers(3, 1000, 32).tolist()
    prompts = [{"prompt_token_ids": shared + rng.integers(3, 1000, int(k)).tolist()} for k in rng.integers(8, 40, 6)]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, repetition_penalty=1.8,
                             frequency_penalty=0.6, presence_penalty=0.4)] * 3
    params += [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, repetition_penalty=3.0)] * 3
    roomy = LLM(demo_model, show_progress=False, **{**ENGINE_TESTS_SHAPE, "enable_prefix_caching": False})
    want = greedy_tokens(roomy, prompts, params)
    assert roomy.stats()["num_preemptions"] == 0
    tight = LLM(demo_model, show_progress=False, **{**ENGINE_TESTS_SHAPE, "num_gpu_blocks_override": 24})
    assert greedy_tokens(tight, prompts, params) == want
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert_pool_empty(tight)
