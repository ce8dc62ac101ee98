"""Image inputs of a vision-language model (vLLM's multimodal engine arguments)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.base import SubConfig


@dataclasses.dataclass
class MultiModalConfig(SubConfig):
    limit_mm_per_prompt: int = 4
    """Most images one prompt may carry (vLLM's flag takes {"image": N}; here N)."""
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
            self.limit_mm_per_prompt = int(limit.get("image", 0))
        if self.limit_mm_per_prompt < 0:
            raise self.bad("limit_mm_per_prompt", "must be >= 0")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) < 0:
                raise self.bad(name, "must be >= 0")
        if 0 < self.encoder_cache_size < self.max_num_encoder_input_tokens:
            raise self.bad("encoder_cache_size", "must be at least max_num_encoder_input_tokens")
