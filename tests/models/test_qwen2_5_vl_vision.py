"""Qwen2.5-VL's vision tower (2D rotary, window attention, merger) against transformers' on a
tiny random config built here."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxserve.models.qwen2_5_vl_vision import Qwen25VisionConfig, load_qwen25_vision_tower  # noqa: E402


@pytest.fixture(scope="module")
def towers():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    hf_cfg = Qwen2_5_VLVisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=40,
                                    patch_size=2, temporal_patch_size=2, spatial_merge_size=2, window_size=8,
                                    fullatt_block_indexes=[1])
    hf = Qwen2_5_VisionTransformerPretrainedModel(hf_cfg).eval()
    cfg = Qwen25VisionConfig.from_hf(hf_cfg.to_dict())
    return hf, cfg, load_qwen25_vision_tower(cfg, {k: v.numpy() for k, v in hf.state_dict().items()})


def test_pack_of_grids_padded_to_a_bucket_equals_each_image_alone(towers):
    """Three images of different grids packed and padded to 256 patches (the padding in its own
    window and image): each image's rows equal transformers' for that image alone, in one call of a
    program that depends only on the bucket."""
    import jax

    from jaxserve.models.qwen2_5_vl_vision import pack_arrays, pack_plan

    hf, cfg, tower = towers
    grids = [(8, 12), (4, 10), (6, 6)]
    rng = np.random.default_rng(7)
    images = [rng.standard_normal((h * w, 24)).astype(np.float32) for h, w in grids]
    plan = pack_plan(grids, 256, cfg)
    assert plan.num_tokens == (24, 10, 9) and plan.window_id[-1] == plan.image_id[-1] == -1
    padded = np.zeros((256, 24), np.float32)
    padded[:sum(len(p) for p in images)] = np.concatenate(images)
    padded[sum(len(p) for p in images):] = 100.0  # whatever the padding holds changes nothing
    out = np.asarray(jax.jit(tower.packed)(jnp.asarray(padded), *map(jnp.asarray, pack_arrays(plan))))
    assert out.shape == (64, 40)
    row = 0
    for (gh, gw), patches, n in zip(grids, images, plan.num_tokens):
        with torch.no_grad():
            ref = hf(torch.from_numpy(patches), grid_thw=torch.tensor([[1, gh, gw]]))
        ref = (ref.pooler_output if hasattr(ref, "pooler_output") else ref).numpy()
        np.testing.assert_allclose(out[row:row + n], ref, atol=1e-4, rtol=1e-4)
        row += n
    with pytest.raises(ValueError, match="do not pack"):
        pack_plan(grids, 128, cfg)


@pytest.mark.parametrize("grid", [(8, 12), (6, 6), (4, 10)])
def test_tower_equals_transformers(towers, grid):
    hf, _, tower = towers
    gh, gw = grid
    patches = np.random.default_rng(gh * gw).standard_normal((gh * gw, 3 * 2 * 2 * 2)).astype(np.float32)
    with torch.no_grad():
        out = hf(torch.from_numpy(patches), grid_thw=torch.tensor([[1, gh, gw]]))
    ref = (out.pooler_output if hasattr(out, "pooler_output") else out).numpy()
    ours = np.asarray(tower(jnp.asarray(patches), gh, gw))
    assert ours.shape == ref.shape == (gh * gw // 4, 40)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
