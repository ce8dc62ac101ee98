"""A vision-language model's prompt processing: the images of a request (``multi_modal_data``)
checked, preprocessed (PIL and numpy, no torch), hashed by content, and the prompt's image
placeholders expanded to one token per encoder output row, each image's ``MultiModalFeatureSpec``
(its hash, its placeholder offsets, its pixels) recorded for the core and the runner.

LLaVA: one ``<image>`` token per image in the prompt becomes ``tokens_per_image`` of them; the
pixels are the CLIP processor's (``preprocessor_config.json``, else the tower's image size).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from jaxserve.core.multimodal import MultiModalFeatureSpec
from jaxserve.engine.media import check_image, expand_placeholders, image_hash
from jaxserve.exceptions import InvalidRequestError
from jaxserve.models.clip_image_processor import CLIPImageProcessorConfig, preprocess_clip_image
from jaxserve.models.llava_vision import LlavaVisionConfig

IMAGE_PLACEHOLDER = "<image>"  # the text LLaVA's chat prompts carry for each image


@dataclass
class MultiModalProcessor:
    placeholder: ClassVar[str] = IMAGE_PLACEHOLDER  # what a chat image part becomes in the template's text

    image_token_id: int
    tokens_per_image: int
    image_processor: CLIPImageProcessorConfig
    limit_per_prompt: int

    @classmethod
    def from_folder(cls, folder: str | Path, limit_per_prompt: int) -> MultiModalProcessor:
        folder = Path(folder)
        vision = LlavaVisionConfig.from_hf(json.loads((folder / "config.json").read_text()))
        pre = folder / "preprocessor_config.json"
        size = vision.image_size
        proc = (CLIPImageProcessorConfig.from_dict(json.loads(pre.read_text())) if pre.is_file()
                else CLIPImageProcessorConfig(shortest_edge=size, crop_height=size, crop_width=size))
        if (proc.crop_height, proc.crop_width) != (size, size):
            raise ValueError(f"preprocessor_config.json: crop {proc.crop_height}x{proc.crop_width}, but the vision "
                             f"tower takes {size}x{size} images")
        return cls(vision.image_token_id, vision.tokens_per_image, proc, limit_per_prompt)

    def images_of(self, data: Any) -> list[Any]:
        """``multi_modal_data``'s images as RGB PIL images, each checked, in prompt order."""
        if not isinstance(data, dict):
            raise InvalidRequestError("multi_modal_data", f"expected a dict like {{'image': ...}}, "
                                                          f"got {type(data).__name__}")
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise InvalidRequestError("multi_modal_data", f"modalities {unknown} are not served; only 'image'")
        images = data.get("image", [])
        if not isinstance(images, (list, tuple)):
            return [check_image(images, "multi_modal_data.image")]
        return [check_image(im, f"multi_modal_data.image[{i}]") for i, im in enumerate(images)]

    def process(self, token_ids: Sequence[int], images: Sequence[Any]
                ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """Checked RGB images and the prompt's ids -> the expanded ids and one feature per image."""
        if len(images) > self.limit_per_prompt:  # before any pixel is processed
            raise InvalidRequestError("multi_modal_data", f"{len(images)} images, more than the limit of "
                                      f"{self.limit_per_prompt} per prompt (--limit-mm-per-prompt)")
        pixels = [preprocess_clip_image(im, self.image_processor) for im in images]
        hashes = [image_hash(p) for p in pixels]
        ids, features = expand_placeholders(token_ids, self.image_token_id, self.tokens_per_image, hashes,
                                            self.limit_per_prompt)
        by_hash = dict(zip(hashes, pixels))
        return ids, [MultiModalFeatureSpec(f.identifier, f.placeholder, data=by_hash[f.identifier])
                     for f in features]



@dataclass
class Qwen25VLMultiModalProcessor(MultiModalProcessor):
    """Qwen2.5-VL: each ``<|image_pad|>`` in the prompt (the chat template writes
    ``<|vision_start|><|image_pad|><|vision_end|>`` per image) becomes ``t * h * w / merge^2`` of
    them, from the image's own grid after smart resizing; a feature's data is ``(patches, grid)``."""

    placeholder: ClassVar[str] = "<|vision_start|><|image_pad|><|vision_end|>"

    tokens: Any = None  # models.qwen2_5_vl.Qwen25VLTokens
    qwen_processor: Any = None  # Qwen2VLImageProcessorConfig
    max_image_tokens: int = 0  # the encoder budget: an image above it could never be encoded; 0: no bound

    @classmethod
    def from_qwen_folder(cls, folder: str | Path, limit_per_prompt: int,
                         max_image_tokens: int = 0) -> Qwen25VLMultiModalProcessor:
        from jaxserve.models.qwen2_5_vl import Qwen25VLTokens
        from jaxserve.models.qwen2_vl_image_processor import Qwen2VLImageProcessorConfig

        folder = Path(folder)
        hf = json.loads((folder / "config.json").read_text())
        tokens = Qwen25VLTokens.from_hf(hf)
        vision = hf.get("vision_config") or {}
        pre = folder / "preprocessor_config.json"
        proc = (Qwen2VLImageProcessorConfig.from_dict(json.loads(pre.read_text())) if pre.is_file() else
                Qwen2VLImageProcessorConfig(patch_size=int(vision.get("patch_size", 14)),
                                            merge_size=tokens.merge_size,
                                            temporal_patch_size=int(vision.get("temporal_patch_size", 2))))
        if proc.merge_size != tokens.merge_size:
            raise ValueError(f"preprocessor_config.json: merge_size {proc.merge_size}, but the vision tower merges "
                             f"{tokens.merge_size}")
        return cls(tokens.image_token_id, 0, CLIPImageProcessorConfig(), limit_per_prompt, tokens, proc,
                   max_image_tokens)

    def process(self, token_ids: Sequence[int], images: Sequence[Any]
                ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        from jaxserve.core.multimodal import PlaceholderRange
        from jaxserve.models.qwen2_vl_image_processor import preprocess_qwen2_vl_image

        if len(images) > self.limit_per_prompt:  # before any pixel is processed
            raise InvalidRequestError("multi_modal_data", f"{len(images)} images, more than the limit of "
                                      f"{self.limit_per_prompt} per prompt (--limit-mm-per-prompt)")
        processed = [preprocess_qwen2_vl_image(im, self.qwen_processor) for im in images]
        for i, (_, grid) in enumerate(processed):
            n = self.tokens.num_image_tokens(grid)
            if 0 < self.max_image_tokens < n:
                raise InvalidRequestError(f"multi_modal_data.image[{i}]", f"{n} image tokens, more than the encoder "
                                          f"budget of {self.max_image_tokens} (--max-num-encoder-input-tokens)")
        grids = [grid for _, grid in processed]
        try:
            ids, offsets = self.tokens.expand(list(token_ids), grids)
        except ValueError as exc:
            raise InvalidRequestError("multi_modal_data", f"{exc} (one <|image_pad|> per image)") from None
        features = []
        for (patches, grid), offset in zip(processed, offsets):
            digest = image_hash(patches.reshape(grid[1], grid[2], -1))  # the grid is part of the content
            n = self.tokens.num_image_tokens(grid)
            features.append(MultiModalFeatureSpec(digest, PlaceholderRange(offset, n), data=(patches, grid)))
        return ids, features
