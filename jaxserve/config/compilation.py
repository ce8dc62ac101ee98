"""How the step is compiled and which kernels it runs (vLLM's ``CompilationConfig``, with the
attention backend and the layer layout)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve import envs
from jaxserve.config.base import SubConfig

SMALL_DECODE_MIN_WEIGHT_BYTES = 64 << 20  # the smallest weights that get decode buckets below 16 by default
ATTENTION_BACKENDS = ("auto", "xla", "pallas", "triton", "cpu", "mosaic")  # built in; more may be registered


@dataclasses.dataclass
class CompilationConfig(SubConfig):
    enforce_eager: bool = False
    """Run the step without jax.jit (for comparison with the compiled path)."""
    attention_backend: str = "auto"
    """auto, xla, pallas, triton, cpu, mosaic, or a name registered with
    pallas_kernels.register_attention_backend in this process. auto = pallas on a GPU (mosaic is
    opt-in: Hopper only, and it must pass a start-up self-check); on a CPU, cpu (the C++ kernel)
    when it builds here, else xla (mosaic on a CPU runs interpreted: tests only)."""
    compilation_cache_dir: str | None = None
    """JAX persistent compilation cache folder; default is under the user cache; 'off' disables it."""
    interpret_kernels: bool | None = None
    """Run Pallas kernels in interpret mode (default: on when not on a GPU)."""
    scan_layers: bool | None = None
    """Decoder layers under lax.scan over stacked weights (compile time flat in depth), or unrolled
    over per-layer weights (no weight slicing per step; longer compiles for deep models).
    Default: unrolled up to 8 layers, scanned above."""
    min_decode_bucket: int | None = None
    """Smallest token bucket of a decode step, a power of two up to 16: decode steps of fewer
    requests run in buckets of 1, 2, 4, 8 tokens (with K speculative tokens also (K+1) * 2^j)
    instead of padding to 16 rows (compiled in the background once the engine is ready).
    Default: 1 on a CPU for weights of 64 MiB or more, where a padded row costs its whole
    matmul; 16 on a GPU and for smaller models."""

    def validate(self) -> None:
        if not _is_backend_name(self.attention_backend):
            # Registered names are known only to the kernels' registry: the runner checks them.
            raise self.bad("attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)} or a registered name")
        m = self.min_decode_bucket
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m not in (1, 2, 4, 8, 16)):
            raise self.bad("min_decode_bucket", f"must be 1, 2, 4, 8 or 16, got {m!r}")

    def resolved_min_decode_bucket(self, platform: str, weight_bytes: int) -> int:
        if self.min_decode_bucket is not None:
            return self.min_decode_bucket
        # A tiny model's step is overhead, not matmuls: its padded rows cost less than the variants.
        return 1 if platform != "gpu" and weight_bytes >= SMALL_DECODE_MIN_WEIGHT_BYTES else 16

    def resolved_compilation_cache_dir(self) -> str | None:
        if self.compilation_cache_dir == "off":
            return None
        if self.compilation_cache_dir:
            return self.compilation_cache_dir
        return str(envs.cache_dir() / "xla")


def _is_backend_name(name: Any) -> bool:
    """A built-in backend, or a name a registered one could have (letters, digits, ``_-.``)."""
    return isinstance(name, str) and (name in ATTENTION_BACKENDS or (
        bool(name) and all(c.isalnum() or c in "_-." for c in name)))
