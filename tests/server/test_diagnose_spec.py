"""``jaxserve diagnose``'s ``spec_not_paying`` rule on the step records of a real speculating
engine (the demo model): drafts that are mostly rejected are flagged, copy prompts whose drafts are
accepted are not, and the evidence counts the scheduler's drafts."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve_server.diagnose import SPEC_MIN_ACCEPTANCE, analyse, spec_not_paying
from tests.engine.test_spec_decode_engine import NGRAM, repetitive_prompts
from tests.shapes import ENGINE_TESTS_SHAPE


@pytest.fixture(scope="module")
def spec(demo_model):
    return LLM(demo_model, show_progress=False, speculative_config=NGRAM, **ENGINE_TESTS_SHAPE)


def window(llm: LLM, prompts, params) -> list[dict]:
    """The step records (as the debug endpoint serves them) of one generate call."""
    last = llm.get_step_records(1)[0].step if llm.get_step_records(1) else -1
    llm.generate(prompts, params, use_tqdm=False)
    return [r.as_dict() for r in llm.get_step_records() if r.step > last]


def test_rejected_drafts_are_flagged(spec):
    # Prompts over 30 tokens, sampled hot among the same 30: every step finds a draft, few match.
    rng = np.random.default_rng(0)
    vocab = list(range(100, 130))
    prompts = [{"prompt_token_ids": rng.choice(vocab, 120).tolist()} for _ in range(6)]
    stats = spec.llm_engine.core.scheduler.spec_decoding_stats
    before = stats.copy()
    steps = window(spec, prompts, SamplingParams(temperature=3.0, seed=1, max_tokens=30, ignore_eos=True,
                                                 allowed_token_ids=vocab))
    evidence, finding = spec_not_paying(steps)
    assert evidence["draft_tokens"] == stats.num_draft_tokens - before.num_draft_tokens
    assert evidence["accepted_tokens"] == stats.num_accepted_tokens - before.num_accepted_tokens
    assert evidence["acceptance"] < SPEC_MIN_ACCEPTANCE and evidence["speculating_decode_steps"] > 0
    assert finding is not None and finding.id == "spec_not_paying"
    assert "--speculative-auto-off" in finding.try_
    assert "spec_not_paying" in [f.id for f in analyse(steps, [])[1]]


def test_accepted_copy_drafts_are_not_flagged(spec):
    steps = window(spec, repetitive_prompts(6, seed=2),
                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    evidence, finding = spec_not_paying(steps)
    assert evidence["acceptance"] > 0.5 and evidence["speculating_decode_steps"] > 0
    assert finding is None
