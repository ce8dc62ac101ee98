"""An engine on int8 weights and an fp8 KV cache (cpu attention kernel): close to the float
model, its memory reported, prefix caching unchanged."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from scipy.special import log_softmax

from jaxserve import LLM, SamplingParams
from jaxserve.models.loader import load_model
from jaxserve.runner.kv_cache import bytes_per_block
from tests.models.paged_sequence import PagedSequence, prompt


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints["LlamaForCausalLM"]


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(llama, quantization="int8", kv_cache_dtype="fp8", max_num_seqs=2, max_model_len=64,
               max_num_batched_tokens=32, show_progress=False)


def test_prompt_logprobs_close_to_float_model(llm, llama):
    ids = prompt(40, seed=5)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    got = np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    logits = PagedSequence(load_model(llama, "float32", scan_layers=False)).feed(ids)
    ref = log_softmax(logits, -1)[np.arange(len(ids) - 1), ids[1:]]
    delta = np.abs(got - ref)
    assert delta.max() < 0.1 and delta.mean() < 0.03
    assert delta.max() > 0  # int8 weights and an fp8 cache do change the numbers


def test_memory_is_counted_in_its_formats(llm, llama):
    stats = llm.stats()
    float_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(load_model(llama, "float32"))))
    mc = llm.llm_engine.core.model_config
    assert stats["quantization"] == "int8" and stats["kv_cache_dtype"] == "float8_e4m3fn"
    assert stats["kv_cache_bytes"] == stats["num_gpu_blocks"] * bytes_per_block(mc, 16, 1, "fp8")
    assert stats["weight_bytes"] < float_bytes
    samples = {(m.labels["kind"], m.labels["format"]): m.value for m in llm.get_metrics()
               if m.name == "jaxserve:memory_bytes" and m.labels.get("engine") == "0"}
    assert samples == {("weights", "int8"): stats["weight_bytes"],
                       ("kv_cache", "float8_e4m3fn"): stats["kv_cache_bytes"]}


def test_prefix_cache_hit_gives_the_same_tokens(llm):
    ids = prompt(48, seed=9)
    params = SamplingParams(max_tokens=6, temperature=0)
    first = llm.generate([ids], params)[0]
    again = llm.generate([ids], params)[0]
    assert again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
