"""Mistral with a sliding window served by the engine: its one KV group frees the blocks that fall
out of the window (``HybridKVCacheManager``), and greedy outputs still equal transformers' under
chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core import HybridKVCacheManager
from jaxserve.core.kv_cache_utils import cdiv
from tests.models.test_model_vs_hf import hf_greedy
from tests.shapes import ENGINE_TESTS_SHAPE
from tests.tiny_models import build_tiny_checkpoint

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


def test_kv_sizing_counts_what_the_window_keeps(checkpoint):
    import dataclasses

    from jaxserve.config import EngineConfig
    from jaxserve.models import ModelConfig
    from jaxserve.runner.kv_cache import blocks_per_request, bytes_per_block, determine_num_blocks

    mc = ModelConfig.from_pretrained(checkpoint)
    full = dataclasses.replace(mc, sliding_window=None)
    # Window 20 with 64-token steps: cdiv(19 + 64, 16) + 1 = 7 blocks, against 16 for 256 tokens.
    assert blocks_per_request(mc, 16, 256, 64) == 7
    assert blocks_per_request(full, 16, 256, 64) == 16
    assert blocks_per_request(mc, 16, 20, 64) == 2  # a window as long as the context: full attention
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64)
    assert determine_num_blocks(mc, cfg, 256) == 4 * 7 + 1
    assert determine_num_blocks(full, cfg, 256) == 4 * 16 + 1
    # A budget of 10 blocks holds a windowed request of 256 tokens, not a full-attention one.
    small = EngineConfig(kv_cache_memory=bytes_per_block(mc, 16) * 10, max_num_batched_tokens=64)
    assert determine_num_blocks(mc, small, 256) == 10
    with pytest.raises(ValueError, match="needs 17"):
        determine_num_blocks(full, small, 256)
