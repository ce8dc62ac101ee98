"""Greedy ``LLM.generate`` equals transformers' greedy ``generate``, token for token, under every
scheduling regime: prefix caching on/off, chunked prefill on/off, and preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from tests.shapes import ENGINE_TESTS_SHAPE

MAX_TOKENS = 24


def make_prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 1000, 40).tolist()  # a 40-token prefix shared by half the prompts
    lengths = [1, 2, 5, 9, 16, 17, 31, 33, 47, 64, 65, 80, 96, 100, 120, 7, 3, 50]
    prompts = []
    for i, n in enumerate(lengths):
        own = rng.integers(3, 1000, n).tolist()
        prompts.append(shared + own if i % 2 else own)
    return prompts


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def hf_outputs(demo_model, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        gen = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    assert all(len(o) == MAX_TOKENS for o in outs)
    return outs


def run(checkpoint: str, prompts, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(checkpoint, show_progress=False, **{**ENGINE_TESTS_SHAPE, **engine_args})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"] - 1, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_chunked_prefill_matches_hf(demo_model, prompts, hf_outputs, caching):
    # A 64-token budget splits every long prompt into several chunks.
    ours, llm = run(demo_model, prompts, max_num_batched_tokens=64, enable_prefix_caching=caching)
    assert ours == hf_outputs
    stats = llm.stats()
    if caching:
        assert stats["prefix_cache_hits"] > 0
    else:
        assert stats["prefix_cache_hits"] == 0
    assert stats["compile_unexpected_compiles"] == 0


def test_whole_prefill_matches_hf(demo_model, prompts, hf_outputs):
    ours, _ = run(demo_model, prompts, max_num_batched_tokens=256, enable_chunked_prefill=False)
    assert ours == hf_outputs


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_both_layer_layouts_match_hf(demo_model, prompts, hf_outputs, scan_layers):
    # The demo model is shallow enough to be unrolled by default; both layouts must agree.
    ours, llm = run(demo_model, prompts, max_num_batched_tokens=64, scan_layers=scan_layers)
    assert ours == hf_outputs
    assert llm.stats()["scan_layers"] is scan_layers
    assert llm.stats()["compile_unexpected_compiles"] == 0


def test_preemption_matches_hf(demo_model, prompts, hf_outputs):
    # 24 usable blocks (384 tokens) cannot hold 18 requests of up to 184 tokens at once.
    ours, llm = run(demo_model, prompts, max_num_batched_tokens=64, num_gpu_blocks_override=25)
    assert llm.stats()["num_preemptions"] > 0
    assert ours == hf_outputs


@pytest.mark.parametrize("blocks", [160, 25], ids=["roomy", "preempting"])
def test_sync_scheduling_matches_hf(demo_model, prompts, hf_outputs, blocks):
    # The other tests run the default, async scheduling (step N+1 scheduled while step N runs,
    # decode inputs from the device); this one schedules each step after the last one finished.
    ours, llm = run(demo_model, prompts, max_num_batched_tokens=64, num_gpu_blocks_override=blocks,
                    async_scheduling=False)
    assert ours == hf_outputs
    stats = llm.stats()
    assert stats["compile_unexpected_compiles"] == 0
    assert (stats["num_preemptions"] > 0) == (blocks == 25)
