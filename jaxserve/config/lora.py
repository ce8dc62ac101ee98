"""Multi-LoRA serving (vLLM's LoRA engine arguments)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.base import SubConfig


@dataclasses.dataclass
class LoRAConfig(SubConfig):
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT format) beside the base model, several in one batch (vLLM's flag)."""
    max_loras: int = 1
    """Adapters in one step: the device slots of stacked LoRA weights (vLLM's flag)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory, at least max_loras. Default: max_loras."""
    max_lora_rank: int = 16
    """Largest adapter rank r accepted; the slots are padded to it (vLLM's flag)."""

    lora_lm_head: bool = False
    """Allocate LM-head LoRA slots, so adapters whose target_modules include lm_head are served
    (each row's logits add its adapter's delta). Set by itself when a --lora-modules adapter has one;
    off, such an adapter loaded later is refused naming this flag."""
    lora_embedding: bool = False
    """Allocate token-embedding LoRA slots, so adapters whose target_modules include embed_tokens
    are served. Set by itself when a --lora-modules adapter has one; off, such an adapter loaded
    later is refused naming this flag."""

    def validate(self) -> None:
        if not self.enable_lora:
            for name in ("lora_lm_head", "lora_embedding"):
                if getattr(self, name):
                    raise self.bad(name, "needs enable_lora")
            return
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise self.bad(name, "must be >= 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise self.bad("max_cpu_loras", f"must be >= max_loras ({self.max_loras})")
