"""The dtype the weights and activations are served in, checked against the attention backend
before anything loads or compiles."""

from __future__ import annotations

from jaxserve.exceptions import ConfigError

# Dtypes each backend takes; a backend not listed takes float32, bfloat16 and float16.
BACKEND_DTYPES = {"cpu": ("float32", "bfloat16")}


def backend_takes(backend: str, dtype: str) -> bool:
    return dtype in BACKEND_DTYPES.get(backend, ("float32", "bfloat16", "float16"))


def resolve_serving_dtype(requested: str, checkpoint_dtype: str, platform: str, *, attention_backend: str,
                          quantized_file: bool = False) -> str:
    """``requested`` (``auto`` or a normalized name) made concrete for ``platform``.

    ``auto`` on a CPU serves float16 and GGUF checkpoints in float32: XLA:CPU has no float16
    arithmetic of its own (it upcasts op by op) and the cpu kernel takes none, so float32 runs on
    every backend and rounds less. An explicit dtype the chosen backend cannot take is a
    ConfigError naming both; ``auto`` as the backend then picks one that can (the runner's)."""
    if requested == "auto":
        if platform != "gpu" and (quantized_file or checkpoint_dtype == "float16"):
            return "float32"
        return checkpoint_dtype
    if attention_backend != "auto" and not backend_takes(attention_backend, requested):
        raise ConfigError(f"dtype {requested} with attention_backend {attention_backend}: the {attention_backend} "
                          f"backend takes {' or '.join(BACKEND_DTYPES[attention_backend])}; pick one of those "
                          "dtypes, or another attention backend (xla takes every dtype)")
    return requested
