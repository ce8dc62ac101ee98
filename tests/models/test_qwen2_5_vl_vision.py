"""Qwen2.5-VL's vision tower (2D rotary, window attention, merger) against transformers' on a
tiny random config built here."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxserve.models.qwen2_5_vl_vision import Qwen25VisionConfig, load_qwen25_vision_tower  # noqa: E402


@pytest.mark.parametrize("grid", [(8, 12), (6, 6), (4, 10)])
def test_tower_equals_transformers(grid):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    hf_cfg = Qwen2_5_VLVisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=40,
                                    patch_size=2, temporal_patch_size=2, spatial_merge_size=2, window_size=8,
                                    fullatt_block_indexes=[1])
    hf = Qwen2_5_VisionTransformerPretrainedModel(hf_cfg).eval()
    cfg = Qwen25VisionConfig.from_hf(hf_cfg.to_dict())
    tower = load_qwen25_vision_tower(cfg, {k: v.numpy() for k, v in hf.state_dict().items()})
    gh, gw = grid
    patches = np.random.default_rng(gh * gw).standard_normal((gh * gw, 3 * 2 * 2 * 2)).astype(np.float32)
    with torch.no_grad():
        out = hf(torch.from_numpy(patches), grid_thw=torch.tensor([[1, gh, gw]]))
    ref = (out.pooler_output if hasattr(out, "pooler_output") else out).numpy()
    ours = np.asarray(tower(jnp.asarray(patches), gh, gw))
    assert ours.shape == ref.shape == (gh * gw // 4, 40)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
