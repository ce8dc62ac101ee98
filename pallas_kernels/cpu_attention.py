"""Ragged paged attention as a C++ kernel called through XLA's FFI: the engine's ``cpu`` backend.

On the CPU, XLA can only express paged attention as a gather of pages into a new array followed
by small batched dots (:mod:`.xla_attention`); in a decode step that gather's memory traffic is
most of the attention time. ``csrc/paged_attention_cpu.cc`` reads each K/V row from its page
once per work item and keeps scores and the online softmax in cache-sized scratch, spreading work
items over XLA's own intra-op threads.

The library is built on first use (:mod:`.cpu_ffi`: the system C++ compiler, a build folder, a
name hashing the source, flags, jaxlib and the CPU). When no compiler is found or the build
fails, :func:`cpu_attention_available` says why and ``auto`` picks ``xla``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ._common import check_options, check_shapes, check_sinks
from .cpu_ffi import CpuFfiKernel, default_build_dir

TARGET = "jaxserve_paged_attention_cpu"
KERNEL = CpuFfiKernel("paged_attention_cpu.cc", TARGET, "JaxservePagedAttentionCpu")
SOURCE = KERNEL.source
DTYPES = (jnp.float32, jnp.bfloat16)
__all__ = ["build_library", "cpu_attention_available", "default_build_dir", "prebuild",
           "ragged_paged_attention_cpu", "register"]


def build_library(build_dir: Path | None = None) -> Path:
    """Compile the kernel unless this exact build exists; returns the shared library's path."""
    return KERNEL.build_library(build_dir)


def prebuild(build_dir: Path | None = None) -> None:
    """Build the library now unless it exists, for a background thread started early: the compiler
    then runs while the caller loads its model. A failure is left for :func:`register` to report."""
    KERNEL.prebuild(build_dir)


def _build_once(build_dir: Path | None) -> Path:
    return KERNEL.build_once(build_dir)


def register(build_dir: Path | None = None) -> None:
    """Build (once per machine) and register the FFI target with XLA (once per process)."""
    KERNEL.register(build_dir)


def cpu_attention_available(build_dir: Path | None = None) -> tuple[bool, str]:
    """(True, "") when the kernel is built (into ``build_dir``) and registered, else (False, the reason)."""
    return KERNEL.available(build_dir)


def ragged_paged_attention_cpu(
    q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    interpret: bool = False, sinks=None,
):
    """The contract of :mod:`pallas_kernels`, computed by the C++ kernel on the CPU; ``sinks``
    as the reference takes them."""
    del interpret
    check_options(sliding_window, soft_cap)
    hq = check_shapes(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc)[1]
    check_sinks(sinks, hq)
    if (q.dtype not in DTYPES or k_cache.dtype not in (q.dtype, jnp.float8_e4m3fn, jnp.int8)
            or v_cache.dtype != k_cache.dtype):
        raise ValueError(f"the cpu attention backend takes float32 or bfloat16 q, and k_cache/v_cache of q's "
                         f"dtype, float8_e4m3fn or int8 (rows with their scales, int8_kv), got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    register()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = jnp.int32
    return call(
        q, k_cache, v_cache, kv_lens.astype(i32), block_tables.astype(i32), query_start_loc.astype(i32),
        jnp.asarray(num_seqs, i32).reshape(1),
        jnp.zeros((hq,), jnp.float32) if sinks is None else sinks.astype(jnp.float32),
        sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0), use_sinks=np.int32(sinks is not None),
    )
