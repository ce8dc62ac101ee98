"""What the speculative-decoding engine tests share: random token prompts, the generated ids and
logprobs against the plain engine's, the scheduler's spec-decode counters and their metrics, and
the target's pool back to empty."""

from __future__ import annotations

import numpy as np

from jaxserve import LLM, SamplingParams


def prompts(n: int, seed: int, lo: int = 5, hi: int = 60) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 1000, int(rng.integers(lo, hi))).tolist()} for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_same_logprobs(want, got, ranks: bool = True) -> None:
    """Each sampled position's top logprobs: the same token ids, values within 1e-4 (and, with
    ``ranks``, the same ranks)."""
    for w, g in zip(want, got):
        for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and (not ranks or a[t].rank == b[t].rank) for t in a)


def assert_metrics_count_the_drafts(llm: LLM, k: int) -> None:
    """A greedy batch drafts K tokens a time (the scheduler cuts a request's last drafts at
    max_tokens), and the engine's spec-decode metrics equal the scheduler's counters."""
    s = stats_of(llm)
    before = (s.num_drafts, s.num_draft_tokens)
    llm.generate(prompts(4, seed=4), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    drafts, draft_tokens = s.num_drafts - before[0], s.num_draft_tokens - before[1]
    assert drafts > 0 and (k - 1) * drafts < draft_tokens <= k * drafts
    metrics = {(m.name, (m.labels or {}).get("position")): m.value for m in llm.get_metrics()
               if m.name.startswith("jaxserve:spec_decode") and (m.labels or {}).get("engine") != "total"}
    assert metrics[("jaxserve:spec_decode_num_drafts_total", None)] == s.num_drafts
    assert metrics[("jaxserve:spec_decode_num_draft_tokens_total", None)] == s.num_draft_tokens
    assert metrics[("jaxserve:spec_decode_num_accepted_tokens_total", None)] == s.num_accepted_tokens


def stats_of(llm: LLM):
    return llm.llm_engine.core.scheduler.spec_decoding_stats


def assert_target_pool_empty(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1
