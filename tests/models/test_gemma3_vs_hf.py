"""Gemma 3 text (Gemma3ForCausalLM) against transformers on a tiny random checkpoint: five
sliding-window layers per global one with their own rotary bases, q/k norms, Gemma's RMSNorm
(1 + w) and sandwich norms, scaled embeddings, its query scale and a final logit soft-cap. Logits
over chunks that cross the window, then greedy decoding; the global layers' linear rope scaling;
the hub's older config form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.models import ModelConfig, load_model
from tests.models.paged_sequence import PagedSequence, prompt
from tests.models.test_model_vs_hf import hf_greedy, hf_logits
from tests.tiny_models import build_tiny_checkpoint

ARCH = "Gemma3ForCausalLM"
LINEAR_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}


# each case about 25 s on the loaded 2-core machine (the unrolled 6-layer model compiles per chunk shape)
@pytest.mark.parametrize("rope", [None, pytest.param(LINEAR_ROPE, marks=pytest.mark.slow)],
                         ids=["default_rope", "linear_rope"])
def test_logits_and_greedy_match_transformers(tmp_path, rope):
    extra = {} if rope is None else {"rope_parameters": rope}
    # initializer_range 0.2: the norms' w far from 0, so (1 + w) against w would show
    folder = str(build_tiny_checkpoint(tmp_path / "gemma3", ARCH, seed=3, initializer_range=0.2, **extra))
    model = load_model(folder)
    cfg = model.config
    assert cfg.layer_windows == (20,) * 5 + (None,)
    assert cfg.local_rope is not None and cfg.local_rope.theta == 10_000.0 and cfg.rope.theta == 1_000_000.0
    assert cfg.rope.rope_type == ("default" if rope is None else "linear")
    ids = prompt(45, seed=2)
    theirs = hf_logits(folder, ids)
    seq = PagedSequence(model)
    parts = [seq.feed(ids[:18]), seq.feed(ids[18:])]  # the second chunk starts mid-block, past the window
    np.testing.assert_allclose(np.concatenate(parts), theirs, atol=2e-4, rtol=0)
    assert np.abs(theirs).max() < 30.0  # the soft-cap bounds them
    ours, logits = [], parts[-1]
    for _ in range(8):
        ours.append(int(logits[-1].argmax()))
        logits = seq.feed([ours[-1]])
    assert ours == hf_greedy(folder, ids, 8)


def test_hub_config_form():
    """The hub's Gemma 3 config.json (before transformers 5): rope_theta and rope_scaling for the
    global layers, rope_local_base_freq for the local ones, sliding_window_pattern."""
    cfg = ModelConfig.from_dict({
        "architectures": [ARCH], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512, "sliding_window_pattern": 4, "query_pre_attn_scalar": 16,
        "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16"})
    assert cfg.layer_windows == (512, 512, 512, None) * 2
    assert cfg.rope.rope_type == "linear" and cfg.rope.factor == 8.0 and cfg.rope.theta == 1_000_000.0
    assert cfg.local_rope is not None and cfg.local_rope.theta == 10_000.0
    assert cfg.embed_scale == 8.0 and cfg.norm_offset == 1.0 and cfg.qk_norm and cfg.sandwich_norms
    assert cfg.query_pre_attn_scalar == 16.0 and cfg.final_logit_softcapping is None


def test_scanned_layers_refused_for_mixed_windows(tmp_path):
    from jaxserve.exceptions import ConfigError

    folder = build_tiny_checkpoint(tmp_path / "gemma3", ARCH, seed=1)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gemma3_text"
    with pytest.raises(ConfigError, match="unrolled"):
        load_model(str(folder), scan_layers=True)
