"""The real-model workload of ``jaxserve bench throughput --workload real-model``: one stream and a
batch, each against transformers, next to the memory-bandwidth ceiling of one stream.

A decode step of one stream reads every weight once, so ``weight bytes / read bandwidth`` bounds
its steps per second from above; the bandwidth is measured here, in the bench's own process, by a
numpy reduction over a buffer far larger than the caches (one thread, as a step's matmuls at one
row are bound by reading, not by arithmetic).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

# Model names the bench resolves itself (anything else is a folder, a hub id or a .gguf file).
BENCH_MODEL_NAMES = ("smollm2",)
BANDWIDTH_BUFFER_BYTES = 512 << 20  # larger than any last-level cache of this class of machine


def resolve_bench_model(name: str) -> str:
    """``smollm2``: SmolLM2-135M-Instruct, fetched and cached by ``jaxserve.models.smollm2``;
    any other name is passed through as the engine's model source."""
    if name not in BENCH_MODEL_NAMES:
        return name
    from jaxserve.models.smollm2 import smollm2_gguf_path

    return str(smollm2_gguf_path())


def hf_from_pretrained_args(model: str) -> tuple[str, dict]:
    """transformers' ``from_pretrained`` arguments for a folder, or for a ``.gguf`` file (its
    folder and ``gguf_file``, which transformers dequantizes)."""
    path = Path(model)
    if path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return model, {}


def read_bandwidth_bytes_per_s(nbytes: int = BANDWIDTH_BUFFER_BYTES, repeats: int = 5) -> float:
    """The best of ``repeats`` timed sums over an ``nbytes`` float32 buffer (first touched before
    timing, so page faults are not counted)."""
    buf = np.ones(nbytes // 4, dtype=np.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.nbytes / best


def ceiling(weight_bytes: int, bandwidth: float) -> dict:
    """One stream's decode bound: every weight read once per token."""
    return {"weight_bytes": weight_bytes, "read_bandwidth_gb_s": bandwidth / 1e9,
            "one_stream_ceiling_tokens_per_s": bandwidth / weight_bytes}
