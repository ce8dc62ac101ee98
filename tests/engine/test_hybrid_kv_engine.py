"""Models whose layers mix sliding-window and full attention, served by the engine: a Qwen3 whose
layers alternate (two KV cache groups of two layers), Gemma 3 (five local layers per global
one: six groups of one) and gpt-oss (alternating, with attention sinks and experts). A block
table per group in the runner, each layer reading its own group's. Greedy tokens and their
logprobs equal transformers' over prompts several windows long, batched, chunked, prefix-cached
and preempted, and no block leaks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.core import HybridKVCacheManager
from jaxserve.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from jaxserve.models import ModelConfig
from tests.shapes import ENGINE_TESTS_SHAPE
from tests.tiny_models import build_tiny_checkpoint

WINDOW = 20  # over one 16-token block, not a multiple of it
MAX_TOKENS = 6
LENGTHS = (40, 230, 120, 9, 200)
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2


# name -> (architecture, checkpoint overrides, layers, usable blocks: fewer than the batch needs)
MODELS = {
    # the 230-token request alone holds 15 blocks in the full group and up to 7 in the window's
    "alternating": ("Qwen3ForCausalLM", dict(num_hidden_layers=4, sliding_window=WINDOW, use_sliding_window=True,
                                             layer_types=LAYER_TYPES, max_window_layers=0), 4, 31),
    # 15 + 5 x 7 for the same request (each local layer is its own group)
    "gemma3": ("Gemma3ForCausalLM", dict(sliding_window=WINDOW), 6, 61),
    # gpt-oss's alternation with attention sinks and its experts (auto: the cpu kernel, or xla)
    "gpt_oss": ("GptOssForCausalLM", dict(num_hidden_layers=4, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                                          initializer_range=0.2), 4, 31),
}


# Gemma 3's case compiles a 6-layer unrolled model with six groups, gpt-oss's runs 8 experts densely:
# about a minute each on the loaded machine.
@pytest.fixture(scope="module", params=[
    "alternating", pytest.param("gemma3", marks=pytest.mark.slow),
    pytest.param("gpt_oss", marks=pytest.mark.slow)])
def model_case(request, tmp_path_factory):
    arch, overrides, layers, blocks = MODELS[request.param]
    folder = tmp_path_factory.mktemp(request.param) / "ckpt"
    return str(build_tiny_checkpoint(folder, arch, seed=6, **overrides)), layers, blocks


@pytest.fixture(scope="module")
def checkpoint(model_case):
    return model_case[0]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 500, 48).tolist()  # three blocks shared by some prompts
    return [(shared if i % 2 else []) + rng.integers(3, 500, n).tolist()[:n - (48 if i % 2 else 0)]
            for i, n in enumerate(LENGTHS)]


def hf_greedy_with_logprobs(folder: str, ids: list[int], n: int, **overrides) -> tuple[list[int], list[float]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **overrides).eval()
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    tokens = out[0].tolist()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0], dim=-1).numpy()
    new = tokens[len(ids):]
    return new, [float(logprobs[len(ids) - 1 + i, t]) for i, t in enumerate(new)]


@pytest.fixture(scope="module")
def hf_outputs(checkpoint, prompts):
    return [hf_greedy_with_logprobs(checkpoint, p, MAX_TOKENS) for p in prompts]


def run(llm: LLM, prompts) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, toks)] for o, toks in zip(outs, tokens)]
    return tokens, logprobs


def test_config_and_groups(tmp_path):
    arch, overrides, _, _ = MODELS["alternating"]
    mc = ModelConfig.from_pretrained(build_tiny_checkpoint(tmp_path / "alt", arch, seed=6, **overrides))
    assert mc.layer_windows == (WINDOW, None, WINDOW, None)
    from jaxserve.runner.kv_cache import kv_cache_groups, num_kv_slots
    groups = kv_cache_groups(mc, 16, 256)
    assert [g.layer_names for g in groups] == [(0, 2), (1, 3)]
    assert isinstance(groups[0].kv_cache_spec, SlidingWindowSpec)
    assert isinstance(groups[1].kv_cache_spec, FullAttentionSpec)
    assert num_kv_slots(groups) == 2  # a block id is one page in each of 2 slots, not 4 layers
    # Sizing: a block costs 2 layers' pages; a 256-token request holds 16 full-group blocks and at
    # most 7 in the window's group (cdiv(19 + 64, 16) + 1), on a 64-token step budget.
    from jaxserve.config import EngineConfig
    from jaxserve.runner.kv_cache import blocks_per_request, bytes_per_block, determine_num_blocks
    assert bytes_per_block(mc, 16, num_slots=2) * 2 == bytes_per_block(mc, 16)
    assert blocks_per_request(mc, 16, 256, 64) == 16 + 7
    assert determine_num_blocks(mc, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64), 256) == 4 * 23 + 1


def test_hybrid_groups_match_transformers(model_case, prompts, hf_outputs):
    checkpoint, layers, blocks = model_case
    # The batch cannot all run at once in this pool: requests are preempted.
    llm = LLM(checkpoint, show_progress=False, enable_prefix_caching=True,
              **{**ENGINE_TESTS_SHAPE, "num_gpu_blocks_override": blocks})
    core = llm.llm_engines[0].core
    assert isinstance(core.scheduler.kv_cache_manager, HybridKVCacheManager)
    slots = 2 if layers == 4 else 1  # a slot per layer of a group
    assert core.runner.num_kv_slots == slots and core.runner.kv_cache[0].shape[0] == slots
    assert len(core.runner.kv_cache_groups) == layers // slots
    want_tokens = [t for t, _ in hf_outputs]
    want_logprobs = [lp for _, lp in hf_outputs]
    for round_ in range(2):  # the second round resumes from the prefix cache
        tokens, logprobs = run(llm, prompts)
        assert tokens == want_tokens, f"round {round_}"
        np.testing.assert_allclose(np.concatenate(logprobs), np.concatenate(want_logprobs), atol=2e-4)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1, "blocks leaked"


def test_the_window_matters(model_case, prompts, hf_outputs):
    """Transformers with full attention everywhere gives other tokens on these prompts."""
    checkpoint, layers, _ = model_case
    full = hf_greedy_with_logprobs(checkpoint, prompts[1], MAX_TOKENS, layer_types=["full_attention"] * layers)
    assert full[0] != hf_outputs[1][0]


def test_pooling_refuses_several_groups(tmp_path):
    from jaxserve.exceptions import ConfigError

    arch, overrides, _, _ = MODELS["alternating"]
    folder = build_tiny_checkpoint(tmp_path / "alt", arch, seed=6, **overrides)
    with pytest.raises(ConfigError, match="several KV cache groups"):
        LLM(str(folder), convert="embed", max_model_len=64)
