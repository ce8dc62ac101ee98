"""Mistral with a sliding window served by the engine: its one KV group frees the blocks that fall
out of the window (``HybridKVCacheManager``), and greedy outputs still equal transformers' under
chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core import HybridKVCacheManager
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.testing import build_tiny_checkpoint
from tests.models.test_model_vs_hf import hf_greedy
from tests.shapes import ENGINE_TESTS_SHAPE

WINDOW = 20  # over one 16-token block, not a multiple of it
MAX_TOKENS = 10
LENGTHS = (40, 230, 120, 9, 200, 100)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral_swa") / "ckpt"
    return str(build_tiny_checkpoint(folder, "MistralForCausalLM", seed=5, sliding_window=WINDOW))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 500, 48).tolist()  # three blocks shared by half the prompts
    return [(shared if i % 2 else []) + rng.integers(3, 500, n).tolist()[:n - (48 if i % 2 else 0)]
            for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def hf_outputs(checkpoint, prompts):
    return [hf_greedy(checkpoint, p, MAX_TOKENS) for p in prompts]


def generate(checkpoint, prompts, **engine_args):
    llm = LLM(checkpoint, show_progress=False, **{**ENGINE_TESTS_SHAPE, **engine_args})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm


def test_window_frees_blocks_and_matches_hf(checkpoint, prompts, hf_outputs):
    # 13 usable blocks: with full attention the 230-token request alone needs 16 and could never
    # run; the window needs at most 7 at once, so all finish, with preemptions along the way.
    ours, llm = generate(checkpoint, prompts, num_gpu_blocks_override=14)
    kv = llm.llm_engines[0].core.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    assert cdiv(max(LENGTHS) + MAX_TOKENS, kv.block_size) > kv.num_blocks - 1
    assert llm.stats()["num_preemptions"] > 0
    assert ours == hf_outputs
    # Again: the prefix cache serves the windows' blocks (still cached after they were freed).
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == hf_outputs
    assert llm.stats()["prefix_cache_hits"] > 0
