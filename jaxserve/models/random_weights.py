"""Random weights for a model config, drawn with numpy and written as safetensors (no torch).

The demo model, the test suite's tiny checkpoints and the benchmarks' random models all come from
here. One generator seeded once draws every tensor in the order of
:func:`jaxserve.models.hf_tensors.expected_tensors`, so a (config, seed, dtype, std) names one set of
bytes on every machine.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.models.config import ModelConfig
from jaxserve.models.hf_tensors import expected_tensors
from jaxserve.models.safetensors_io import save_checkpoint_weights

_NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                 "float16": np.dtype(np.float16)}


def random_tensors(cfg: ModelConfig, *, seed: int, std: float) -> dict[str, np.ndarray]:
    """Every tensor the checkpoint of ``cfg`` holds, in ``cfg.dtype``: norm scales 1, everything
    else (embeddings, projections, biases) normal with standard deviation ``std``."""
    rng = np.random.default_rng(seed)
    dtype = _NUMPY_DTYPES[cfg.dtype]
    tensors = {}
    for name, shape in expected_tensors(cfg).items():
        if name.endswith("norm.weight"):
            arr = np.ones(shape, np.float32)
        else:
            arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        tensors[name] = arr.astype(dtype)
    return tensors


def write_random_weights(folder: str | Path, *, seed: int, std: float, max_shard_bytes: int | None = None) -> None:
    """Draw the weights of the checkpoint whose ``config.json`` is in ``folder`` and write them there."""
    cfg = ModelConfig.from_pretrained(folder)
    save_checkpoint_weights(random_tensors(cfg, seed=seed, std=std), folder, max_shard_bytes)
