"""An attention backend registered at run time runs the engine's compiled step by its name."""

from __future__ import annotations

import functools

import pytest

import pallas_kernels as pk
from jaxserve import LLM, ConfigError, EngineConfig, SamplingParams
from tests.pallas_kernels.test_registry import dense_attention
from tests.shapes import BACKEND_COMPARISON_SHAPE


def _greedy(demo_model, backend):
    llm = LLM(demo_model, show_progress=False, attention_backend=backend, **BACKEND_COMPARISON_SHAPE)
    assert llm.stats()["attention_backend"] == backend
    prompts = [list(range(3, 3 + n)) for n in (1, 9, 40)]  # a chunked prefill among them
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_registered_backend_gives_xla_tokens(demo_model):
    pk.register_attention_backend("dense_engine_test", functools.partial(dense_attention))
    try:
        assert _greedy(demo_model, "dense_engine_test") == _greedy(demo_model, "xla")
    finally:
        pk.unregister_attention_backend("dense_engine_test")


def test_backend_names_config_and_runner(demo_model):
    assert EngineConfig(attention_backend="not_registered_yet").attention_backend == "not_registered_yet"
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="bad name!")
    with pytest.raises(ConfigError, match="not built in nor registered"):
        LLM(demo_model, show_progress=False, attention_backend="not_registered_yet", **BACKEND_COMPARISON_SHAPE)
