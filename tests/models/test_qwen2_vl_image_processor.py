"""Qwen2.5-VL's preprocessing against transformers' processor: sizes, patch order, grids."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.models.qwen2_vl_image_processor import (
    Qwen2VLImageProcessorConfig,
    num_image_tokens,
    preprocess_qwen2_vl_image,
    smart_resize,
)

Image = pytest.importorskip("PIL.Image")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("shape", [(40, 60), (61, 33), (28, 28), (10, 90), (300, 200)])
def test_patches_and_grid_equal_transformers(shape):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16})
    img = Image.fromarray(np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8))
    ref = hf(images=img, return_tensors="np")
    cfg = Qwen2VLImageProcessorConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    patches, grid = preprocess_qwen2_vl_image(img, cfg)
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert patches.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(patches, ref["pixel_values"], atol=1e-6)
    assert 4 <= num_image_tokens(grid, 2) <= 16


def test_smart_resize_limits():
    assert smart_resize(28, 28, 28, 56 * 56, 10**6) == (56, 56)  # grown to the minimum area
    h, w = smart_resize(4000, 3000, 28, 56 * 56, 28 * 28 * 100)
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 100
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000, 28, 56 * 56, 10**6)
