"""An engine on an int8 KV cache (--kv-cache-dtype int8, the CPU backends): close to the float32
cache on the tiny models (a scale written wrong is not), its blocks counted in the smaller rows,
prefix caching and preemption unchanged, and refused where no backend reads it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.reference
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.exceptions import ConfigError
from jaxserve.runner.kv_cache import bytes_per_block
from jaxserve.runner.model_runner import resolve_attention_backend
from pallas_kernels.int8_kv import SCALE_BYTES, quantize_rows
from tests.models.paged_sequence import prompt

ENGINE = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32, show_progress=False)
PROMPTS = [prompt(n, seed=n) for n in (5, 23, 61)]
# Measured on these prompts: int8 moves a prompt logprob by at most 0.007-0.009 (mean 0.0016-0.0026)
# on either backend; scales written twice too large move one by 0.49 (mean 0.13).
MAX_DLOGPROB, MEAN_DLOGPROB = 0.05, 0.01


def _prompt_logprobs(llm) -> np.ndarray:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    return np.concatenate([[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs])


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    return {arch: _prompt_logprobs(LLM(tiny_checkpoints[arch], dtype="float32", **ENGINE))
            for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")}


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_prompt_logprobs_close_to_the_float32_cache(tiny_checkpoints, reference, arch, backend):
    llm = LLM(tiny_checkpoints[arch], dtype="float32", kv_cache_dtype="int8", attention_backend=backend, **ENGINE)
    stats = llm.stats()
    assert stats["kv_cache_dtype"] == "int8" and stats["attention_backend"] == backend
    delta = np.abs(_prompt_logprobs(llm) - reference[arch])
    assert 0 < delta.max() < MAX_DLOGPROB and delta.mean() < MEAN_DLOGPROB, (delta.max(), delta.mean())


def test_a_wrong_scale_breaks_the_bound(tiny_checkpoints, reference, monkeypatch):
    """The bound above is one a scale written wrong (here twice too large) cannot meet."""
    def doubled(x):
        rows = quantize_rows(x)
        scale = jax.lax.bitcast_convert_type(rows[..., -SCALE_BYTES:], jnp.float32) * 2
        return rows.at[..., -SCALE_BYTES:].set(jax.lax.bitcast_convert_type(scale, jnp.int8))

    monkeypatch.setattr(pallas_kernels.reference, "quantize_rows", doubled)
    llm = LLM(tiny_checkpoints["LlamaForCausalLM"], dtype="float32", kv_cache_dtype="int8", **ENGINE)
    delta = np.abs(_prompt_logprobs(llm) - reference["LlamaForCausalLM"])
    assert delta.max() > 2 * MAX_DLOGPROB


def test_engine_counts_its_blocks_in_the_smaller_rows(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["LlamaForCausalLM"], kv_cache_dtype="int8", kv_cache_memory=2 * 1024 * 1024, **ENGINE)
    stats, mc = llm.stats(), llm.llm_engine.core.model_config
    per_block = bytes_per_block(mc, 16, 1, "int8")
    assert per_block == 2 * mc.num_hidden_layers * 16 * mc.num_key_value_heads * (mc.head_dim + 4)
    assert stats["num_gpu_blocks"] == 2 * 1024 * 1024 // per_block
    assert stats["kv_cache_bytes"] == stats["num_gpu_blocks"] * per_block


def test_prefix_cache_and_preemption_keep_the_tokens(tiny_checkpoints):
    """A pool too small for the batch preempts (recompute); a second round hits the prefix cache;
    both give the tokens of an ample pool."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    model = tiny_checkpoints["LlamaForCausalLM"]
    ample = LLM(model, kv_cache_dtype="int8", **ENGINE)
    want = [o.outputs[0].token_ids for o in ample.generate(PROMPTS, params, use_tqdm=False)]
    tight = LLM(model, kv_cache_dtype="int8", num_gpu_blocks_override=8, **ENGINE)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in tight.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1, "blocks leaked"


def test_refused_where_no_backend_reads_it():
    EngineConfig(kv_cache_dtype="int8")  # a valid value on its own
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        resolve_attention_backend("auto", "gpu", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        resolve_attention_backend("pallas", "cpu", kv_cache_dtype="int8")
    assert resolve_attention_backend("xla", "cpu", kv_cache_dtype="int8") == "xla"
