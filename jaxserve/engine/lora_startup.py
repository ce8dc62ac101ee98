"""Which LoRA slot tables an engine allocates at start.

The layers' tables always exist with ``enable_lora``; the two vocabulary-sized ones, the LM
head's and the token embedding's, only when the configuration asks (``lora_lm_head`` /
``lora_embedding``) or when an adapter named at start (``--lora-modules``) targets them. vLLM
wraps every supported module when it starts; here a server whose adapters touch neither keeps
exactly the steps it compiled before. An adapter loaded later that needs a table the engine did
not allocate is refused by the input processor, naming the flag.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.config import EngineConfig
from jaxserve.core.lora_request import LoRARequest
from jaxserve.models.lora_adapter import whole_module_targets

# The module an adapter targets -> the flag that allocates its slots.
TABLE_FLAGS = {"lm_head": "lora_lm_head", "embed_tokens": "lora_embedding"}


def with_startup_lora_slots(config: EngineConfig, lora_requests: Sequence[LoRARequest]) -> EngineConfig:
    """``config`` with the LM-head / embedding slots on where a startup adapter needs them (a copy,
    validated again)."""
    if not config.enable_lora:
        return config
    needs = {TABLE_FLAGS[m]: True for r in lora_requests for m in whole_module_targets(r.lora_path)
             if not getattr(config, TABLE_FLAGS[m])}
    return config.replace(**needs) if needs else config
