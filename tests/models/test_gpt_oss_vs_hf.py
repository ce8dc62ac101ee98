"""gpt-oss (GptOssForCausalLM) against transformers on a tiny random checkpoint: sliding and full
layers alternating, attention sinks, the biased router and experts with the clamped SwiGLU (the
checkpoint's interleaved gate/up columns). Logits over chunks that cross the window, then greedy
decoding; yarn rope; what is refused by name (MXFP4, the attention backends without sinks). Tensor
and expert parallelism: tests/parallel/tp_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxserve.exceptions import ConfigError
from jaxserve.models import ModelConfig, load_model
from jaxserve.runner.model_runner import resolve_attention_backend
from tests.models.paged_sequence import PagedSequence, prompt
from tests.models.test_model_vs_hf import hf_greedy, hf_logits
from tests.tiny_models import build_tiny_checkpoint

ARCH = "GptOssForCausalLM"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # initializer_range 0.2: routers far from uniform and sinks of either sign, so each shows in the logits
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("gpt_oss") / ARCH, ARCH, seed=5,
                                     initializer_range=0.2))


def test_logits_and_greedy_match_transformers(folder):
    model = load_model(folder)
    cfg = model.config
    assert cfg.layer_windows == (12, None) and cfg.attention_sinks and cfg.is_moe
    assert cfg.clamped_swiglu == (1.702, 7.0) and cfg.o_proj_bias
    assert cfg.rope.rope_type == "yarn" and not cfg.rope.truncate and cfg.rope.attention_factor > 1.3
    ids = prompt(40, seed=2)
    theirs = hf_logits(folder, ids)
    seq = PagedSequence(model)
    parts = [seq.feed(ids[:17]), seq.feed(ids[17:])]  # the second chunk starts mid-block, past the window
    np.testing.assert_allclose(np.concatenate(parts), theirs, atol=2e-4, rtol=0)
    ours, logits = [], parts[-1]
    for _ in range(6):
        ours.append(int(logits[-1].argmax()))
        logits = seq.feed([ours[-1]])
    assert ours == hf_greedy(folder, ids, 6)


def test_refusals(folder):
    raw = json.loads(Path(folder, "config.json").read_text())
    with pytest.raises(ConfigError, match="mxfp4"):
        ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": "mxfp4"}})
    cfg = ModelConfig.from_pretrained(Path(folder))
    import pallas_kernels

    cpu_kernel = pallas_kernels.cpu_attention_available()[0]
    assert resolve_attention_backend("auto", "cpu", mc=cfg) == ("cpu" if cpu_kernel else "xla")
    assert resolve_attention_backend("auto", "gpu", mc=cfg) == "xla"  # pallas, triton, mosaic have none
    assert resolve_attention_backend("xla", "cpu", mc=cfg) == "xla"
    for backend in ("triton", "pallas", "mosaic"):
        with pytest.raises(ConfigError, match=f"{backend} has no attention sinks"):
            resolve_attention_backend(backend, "cpu", mc=cfg)


@pytest.mark.parametrize("params", [
    {},  # gpt-oss's own: factor 32 over 4096 positions, truncate false
    {"truncate": True, "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 10_000.0},
    {"mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0},
    {"attention_factor": 0.9},
], ids=["gpt_oss", "truncated", "mscale", "attention_factor"])
def test_yarn_matches_transformers(params):
    """The yarn frequencies and their cos/sin scale against transformers' own computation."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxserve.layers.rotary import rope_inv_freq

    base = GptOssConfig().rope_parameters
    hf = GptOssConfig(head_dim=64, rope_parameters={**base, **params})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = ModelConfig.from_dict({**hf.to_dict(), "architectures": [ARCH]})
    np.testing.assert_allclose(rope_inv_freq(ours.rope, 64), want_freq.numpy(), rtol=1e-6)
    assert ours.rope.attention_factor == pytest.approx(want_factor, rel=1e-6)
