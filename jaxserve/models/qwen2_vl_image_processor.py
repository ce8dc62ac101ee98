"""Qwen2-VL / Qwen2.5-VL image preprocessing in PIL and numpy (transformers' ``Qwen2VLImageProcessor``).

The image is resized (bicubic) to the nearest size whose sides are multiples of
``patch_size * merge_size`` and whose area lies in ``[min_pixels, max_pixels]``, normalized, and
cut into ``patch_size`` patches, each repeated ``temporal_patch_size`` times (a still image is a
one-frame video), ordered so that each ``merge_size x merge_size`` group of patches is contiguous:
the vision tower's patch merger folds each group into one language-model token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.models.clip_image_processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD


@dataclass(frozen=True)
class Qwen2VLImageProcessorConfig:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen2VLImageProcessorConfig:
        size = d.get("size") or {}
        return cls(
            min_pixels=int(d.get("min_pixels") or size.get("shortest_edge", 56 * 56)),
            max_pixels=int(d.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280)),
            patch_size=int(d.get("patch_size", 14)), temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            merge_size=int(d.get("merge_size", 2)),
            image_mean=tuple(d.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(d.get("image_std", OPENAI_CLIP_STD)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
        )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Sides rounded to multiples of ``factor``, then scaled (keeping the aspect) into the pixel range."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def preprocess_qwen2_vl_image(image: Any, cfg: Qwen2VLImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One PIL image -> ``(patches [grid_h * grid_w, C * T * p * p] float32, (1, grid_h, grid_w))``."""
    image = image.convert("RGB")
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    h, w = smart_resize(image.height, image.width, p * m, cfg.min_pixels, cfg.max_pixels)
    if (w, h) != image.size:
        image = image.resize((w, h), resample=3)  # PIL.Image.BICUBIC
    x = (np.asarray(image).astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = ((x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)).astype(np.float32)
    c = x.shape[2]
    gh, gw = h // p, w // p
    x = x.transpose(2, 0, 1).reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p)), (1, gh, gw)


def num_image_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """Language-model tokens one image becomes: its patches over the merger's group size."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)
