"""Model definitions, the Hugging Face checkpoint loader, model sources (folder or hub id) and the
demo model.

The names below load on first use: resolving a model source or building the demo checkpoint
needs neither jax nor flax, so the command line can report a wrong path before importing them.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ModelConfig": "jaxserve.models.config",
    "LlamaForCausalLM": "jaxserve.models.llama",
    "load_model": "jaxserve.models.loader",
    "SUPPORTED_ARCHITECTURES": "jaxserve.models.registry",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxserve.models' has no attribute {name!r}")
