"""``x @ W`` for a few rows and a float weight on the CPU, beside its jnp reference.

- :func:`dense_matmul_reference`: the plain dot (any backend), weight ``layer`` of a stack sliced out.
- :func:`dense_matmul_cpu`: ``csrc/dense_matmul_cpu.cc`` through XLA's FFI, which streams the
  weight once per call for all rows (XLA:CPU's GEMM packs the weight first: 2-16 rows cost about
  twice one row) and reads weight ``layer`` of a stack in place.

The weight is float32, bfloat16 or float16, stored ``[K, N]`` (``[in, out]``, a Linear kernel) or,
``transposed``, ``[N, K]`` (a tied embedding as the LM head); a stack adds a leading layer axis.
Invariant: a row's result does not depend on how many rows are in the call (the kernel sums each
output in one order fixed by ``K``), so greedy speculative output equals the plain engine's.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .cpu_ffi import CpuFfiKernel

KERNEL = CpuFfiKernel("dense_matmul_cpu.cc", "jaxserve_dense_matmul_cpu", "JaxserveDenseMatmulCpu")
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _layer_of(w: jax.Array, layer: jax.Array | int | None) -> jax.Array:
    return w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)


def dense_matmul_reference(x: jax.Array, w: jax.Array, *, layer: jax.Array | int | None = None,
                           transposed: bool = False) -> jax.Array:
    """The oracle: ``x [..., K] @ W`` (``W.T`` when ``transposed``), W weight ``layer`` of a stack
    (None: ``w`` is the weight); XLA's dot in ``x``'s dtype."""
    w = _layer_of(w, layer)
    return x @ (w.T if transposed else w)


def dense_matmul_cpu(x: jax.Array, w: jax.Array, *, layer: jax.Array | int | None = None,
                     transposed: bool = False) -> jax.Array:
    """The same product by the C++ kernel, summed in float32 and returned in ``x``'s dtype; the
    kernel must be registered (:func:`dense_kernel_available`)."""
    KERNEL.register()
    if w.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"dense_matmul_cpu: weight dtype {w.dtype}: the kernel takes float32, bfloat16, float16")
    if layer is None:  # a stack of one: a reshape, no copy
        w, layer = w[None], 0
    if w.ndim != 3:
        raise ValueError(f"dense_matmul_cpu: a layer index needs a stack w [L, K, N], got {w.shape}")
    k = w.shape[2] if transposed else w.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"dense_matmul_cpu: x has {x.shape[-1]} features, the weight {k}")
    rows = x.reshape(-1, k).astype(jnp.float32)
    n = w.shape[1] if transposed else w.shape[2]
    call = jax.ffi.ffi_call(KERNEL.target, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))
    y = call(rows, w, jnp.asarray(layer, jnp.int32), transposed=np.int32(transposed))
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


def dense_kernel_available(build_dir: Path | None = None) -> tuple[bool, str]:
    """(True, "") when the CPU kernel is built and registered, else (False, the reason)."""
    return KERNEL.available(build_dir)
