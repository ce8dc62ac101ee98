"""CLIP's image preprocessing (the one LLaVA uses) in PIL and numpy: no torch at runtime.

Mirrors transformers' ``CLIPImageProcessor``: RGB, resize so the shorter edge is ``shortest_edge``
(bicubic, through PIL), centre crop, scale to [0, 1], normalize per channel, channels first.
Pillow is the optional ``vision`` extra; it is imported only when an image is processed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class CLIPImageProcessorConfig:
    """The fields of a ``preprocessor_config.json`` that change the pixels."""

    shortest_edge: int = 224
    crop_height: int = 224
    crop_width: int = 224
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = 3  # PIL.Image.BICUBIC

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CLIPImageProcessorConfig:
        size, crop = d.get("size", {"shortest_edge": 224}), d.get("crop_size", {"height": 224, "width": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            shortest_edge=int(size["shortest_edge"]), crop_height=int(crop["height"]), crop_width=int(crop["width"]),
            do_resize=bool(d.get("do_resize", True)), do_center_crop=bool(d.get("do_center_crop", True)),
            do_rescale=bool(d.get("do_rescale", True)), rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            do_normalize=bool(d.get("do_normalize", True)),
            image_mean=tuple(d.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(d.get("image_std", OPENAI_CLIP_STD)),
            resample=int(d.get("resample", 3)),
        )


def resize_shortest_edge(image: Any, shortest_edge: int, resample: int) -> Any:
    """Scale a PIL image so its shorter side is ``shortest_edge``; the longer side is truncated
    to an int, as transformers' ``get_resize_output_image_size`` does."""
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    size = (new_short, new_long) if w <= h else (new_long, new_short)
    return image if size == (w, h) else image.resize(size, resample=resample)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Crop ``pixels [H, W, C]`` about its centre, zero-padding a side that is too short."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        ph, pw = max(height, h), max(width, w)
        padded = np.zeros((ph, pw, pixels.shape[2]), pixels.dtype)
        top, left = (ph - h) // 2, (pw - w) // 2
        padded[top:top + h, left:left + w] = pixels
        pixels, h, w = padded, ph, pw
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top:top + height, left:left + width]


def preprocess_clip_image(image: Any, cfg: CLIPImageProcessorConfig) -> np.ndarray:
    """One PIL image -> ``pixel_values [3, crop_height, crop_width]`` float32."""
    image = image.convert("RGB")
    if cfg.do_resize:
        image = resize_shortest_edge(image, cfg.shortest_edge, cfg.resample)
    pixels = np.asarray(image)
    if cfg.do_center_crop:
        pixels = center_crop(pixels, cfg.crop_height, cfg.crop_width)
    out = pixels.astype(np.float32)
    if cfg.do_rescale:
        out = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
        out = ((out - mean) / std).astype(np.float32)
    return np.ascontiguousarray(out.transpose(2, 0, 1))
