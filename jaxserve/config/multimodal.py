"""Image inputs of a vision-language model (vLLM's multimodal engine arguments)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from jaxserve.config.base import SubConfig


def parse_mm_limit(text: str) -> int | dict:
    """``--limit-mm-per-prompt``'s value: an integer, or vLLM's JSON form ``{"image": N}`` (checked
    by ``validate``, so the command line and ``EngineConfig(limit_mm_per_prompt={...})`` agree)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f'{text!r} is neither an integer nor JSON such as {{"image": 2}}') from None
    if isinstance(value, bool) or not isinstance(value, (int, dict)):
        raise argparse.ArgumentTypeError(f'{text!r} is neither an integer nor JSON such as {{"image": 2}}')
    return value


@dataclasses.dataclass
class MultiModalConfig(SubConfig):
    limit_mm_per_prompt: int = dataclasses.field(default=4, metadata={"cli_type": parse_mm_limit})
    """Most images one prompt may carry: N, or vLLM's JSON form {"image": N}."""
    allowed_local_media_path: str = ""
    """A folder whose files requests may name as file:// image URLs; empty: none may."""
    max_num_encoder_input_tokens: int = 0
    """Image tokens (encoder outputs) one step may encode; 0: max_num_batched_tokens."""
    encoder_cache_size: int = 0
    """Image tokens whose encoder outputs are kept between steps; 0: the encoder budget."""

    def validate(self) -> None:
        limit: object = self.limit_mm_per_prompt
        if isinstance(limit, dict):  # vLLM's offline form, {"image": N}
            other = sorted(set(limit) - {"image"})
            if other:
                raise self.bad("limit_mm_per_prompt", f"modalities {other} are not served; only 'image'")
            count = limit.get("image", 0)
            if isinstance(count, bool) or not isinstance(count, int):
                raise self.bad("limit_mm_per_prompt", f"'image' must be an integer, got {count!r}")
            self.limit_mm_per_prompt = count
        if self.limit_mm_per_prompt < 0:
            raise self.bad("limit_mm_per_prompt", "must be >= 0")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) < 0:
                raise self.bad(name, "must be >= 0")
        if 0 < self.encoder_cache_size < self.max_num_encoder_input_tokens:
            raise self.bad("encoder_cache_size", "must be at least max_num_encoder_input_tokens")
