"""M-RoPE tables against transformers' Qwen2.5-VL rotary embedding, at positions with images."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxserve.layers.mrope_rotary import mrope_cos_sin  # noqa: E402
from jaxserve.models.mrope import mrope_positions  # noqa: E402


def test_tables_equal_transformers():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    cfg = Qwen2_5_VLTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [4, 2, 2]})
    rope = Qwen2_5_VLRotaryEmbedding(cfg)
    positions, _ = mrope_positions(3 + 6 + 4, [(3, (1, 4, 6))], 2)
    with torch.no_grad():
        cos, sin = rope(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions.astype(np.int64))[:, None])
    ours_cos, ours_sin = mrope_cos_sin(jnp.asarray(positions), jnp.asarray(rope.inv_freq.numpy()), [4, 2, 2])
    assert cos.shape == (1, 13, 16)
    np.testing.assert_allclose(np.asarray(ours_cos), cos[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours_sin), sin[0].numpy(), atol=1e-6)


def test_sections_must_cover_the_frequencies():
    with pytest.raises(ValueError, match="mrope_section"):
        mrope_cos_sin(jnp.zeros((3, 2)), jnp.ones(8), [4, 2, 1])
