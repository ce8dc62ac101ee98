"""jaxserve: a JAX/XLA reimplementation of the vLLM V1 inference engine.

``from jaxserve import LLM, SamplingParams`` works as in vLLM. Heavy modules (jax, the model) load
on first use, so ``import jaxserve`` stays cheap for tools that only need the core.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# The public API: what the server, notebooks and users import, and nothing below it.
_LAZY = {
    "SamplingParams": "jaxserve.core.sampling_params",
    "EngineConfig": "jaxserve.config",
    "add_flags": "jaxserve.config",  # flags from a dataclass's fields (the server's FrontendArgs)
    "dataclass_flags": "jaxserve.config",
    "LLM": "jaxserve.engine.llm",
    "AsyncLLM": "jaxserve.engine.async_llm",
    "DPAsyncLLM": "jaxserve.engine.dp.async_llm",
    "EngineClient": "jaxserve.engine.protocol",
    "RequestOutput": "jaxserve.engine.outputs",
    "CompletionOutput": "jaxserve.engine.outputs",
    "Logprob": "jaxserve.engine.outputs",
    "RequestMetrics": "jaxserve.engine.outputs",
    "RequestOutputKind": "jaxserve.engine.outputs",
    "EntryTimes": "jaxserve.engine.timeline",
    "RequestTimeline": "jaxserve.engine.timeline",
    "StepRecord": "jaxserve.engine.step_records",
    "StepInputs": "jaxserve.runner.inspection",
    "StepProgram": "jaxserve.runner.inspection",
    "Profile": "jaxserve.engine.profiling",
    "PromptType": "jaxserve.engine.processor",
    "StructuredOutputsParams": "jaxserve.core.structured_outputs",
    "LoRARequest": "jaxserve.core.lora_request",
    "with_startup_lora_slots": "jaxserve.engine.lora_startup",  # the LM-head/embedding slots --lora-modules need
    "chat_images": "jaxserve.engine.media",  # chat image parts -> template text and images (LLM.chat, the server)
    "InvalidRequestError": "jaxserve.exceptions",
    "ConfigError": "jaxserve.exceptions",
    "EngineDeadError": "jaxserve.exceptions",
    "EngineOverloadedError": "jaxserve.exceptions",
    "NodeLostError": "jaxserve.exceptions",
    "run_headless": "jaxserve.distributed.headless",
    "PoolingLLM": "jaxserve.engine.pooling_llm",
    "pooling_task_of": "jaxserve.engine.pooling_llm",
    "EmbeddingRequestOutput": "jaxserve.engine.pooling_outputs",
    "ClassificationRequestOutput": "jaxserve.engine.pooling_outputs",
    "ScoringRequestOutput": "jaxserve.engine.pooling_outputs",
}

__all__ = list(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
