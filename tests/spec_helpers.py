"""What the speculative-decoding engine tests share: random token prompts, the generated ids, the
scheduler's spec-decode counters, and the target's pool back to empty."""

from __future__ import annotations

import numpy as np

from jaxserve import LLM


def prompts(n: int, seed: int, lo: int = 5, hi: int = 60) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 1000, int(rng.integers(lo, hi))).tolist()} for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def stats_of(llm: LLM):
    return llm.llm_engine.core.scheduler.spec_decoding_stats


def assert_target_pool_empty(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1
