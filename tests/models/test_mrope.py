"""M-RoPE positions against transformers' Qwen2.5-VL ``get_rope_index`` (its own code, run on a
config object: the method reads only the config)."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest

from jaxserve.models.mrope import mrope_positions

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def hf_rope_index(ids, types_, grids, merge=2):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    fake = types.SimpleNamespace(config=types.SimpleNamespace(
        vision_config=types.SimpleNamespace(spatial_merge_size=merge, tokens_per_second=2)))
    fake.get_vision_position_ids = functools.partial(Qwen2_5_VLModel.get_vision_position_ids, fake)
    pos, delta = Qwen2_5_VLModel.get_rope_index(fake, torch.tensor([ids]), torch.tensor([types_]),
                                                image_grid_thw=torch.tensor(grids))
    return pos[:, 0].numpy(), int(delta.reshape(-1)[0])


@pytest.mark.parametrize("layout", [
    [(3, (1, 4, 6)), (2, (1, 8, 4))],  # text, image, text, image, text
    [(0, (1, 2, 2))],                  # the prompt starts with an image
    [(5, (1, 6, 6))],
])
def test_positions_equal_transformers(layout):
    ids, types_, images = [], [], []
    for n_text, grid in layout:
        ids += [1] * n_text
        types_ += [0] * n_text
        images.append((len(ids), grid))
        n_img = grid[0] * grid[1] * grid[2] // 4
        ids += [9] * n_img
        types_ += [1] * n_img
    ids += [1] * 4
    types_ += [0] * 4
    ref, ref_delta = hf_rope_index(ids, types_, [g for _, g in layout])
    ours, delta = mrope_positions(len(ids), images, 2)
    np.testing.assert_array_equal(ours, ref)
    assert delta == ref_delta


def test_text_only_is_plain_positions():
    pos, delta = mrope_positions(5, [], 2)
    assert pos.tolist() == [list(range(5))] * 3 and delta == 0
