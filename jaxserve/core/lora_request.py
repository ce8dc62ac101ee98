"""A request's LoRA adapter, as vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``.

Pure data: the engine loads ``lora_path`` and learns the weights' digest; :func:`lora_cache_key`
then names the adapter in the prefix cache as ``name@sha256``, so that a reload of different
weights under the same name never reuses the KV blocks computed with the old ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if self.lora_int_id < 1:
            # 0 is the base model in vLLM's numbering.
            raise ValueError(f"LoRARequest.lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def int_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def lora_cache_key(name: str, weights_digest: str) -> str:
    """The prefix-cache key of an adapter: its name and the sha256 of its weights."""
    return f"{name}@{weights_digest}"
