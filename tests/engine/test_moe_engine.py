"""A mixture-of-experts model (Qwen3-MoE, tiny) served by the engine: greedy outputs equal
transformers' under chunked prefill and prefix caching, and no block leaks."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.models.test_model_vs_hf import hf_greedy
from tests.shapes import BACKEND_COMPARISON_SHAPE
from tests.tiny_models import build_tiny_checkpoint

MAX_TOKENS = 8


@pytest.mark.slow  # about a minute on the loaded 2-core machine (its own compiles)
def test_moe_engine_matches_hf_chunked_and_prefix_cached(tmp_path):
    folder = str(build_tiny_checkpoint(tmp_path / "qwen3moe", "Qwen3MoeForCausalLM", seed=4,
                                       initializer_range=0.2))
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 500, 40).tolist()  # over two 16-token blocks shared
    prompts = [shared + rng.integers(3, 500, n).tolist() for n in (30, 5, 70)]
    want = [hf_greedy(folder, p, MAX_TOKENS) for p in prompts]
    # 32-token steps: the 110-token prompt is prefilled in four chunks.
    llm = LLM(folder, show_progress=False, **{**BACKEND_COMPARISON_SHAPE, "enable_prefix_caching": True})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second round reads the prompts' blocks from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1, "blocks leaked"
