"""``x @ W`` for a float weight, with the few-row products of a CPU step routed to the C++ kernel.

XLA:CPU's float dot with 2-16 rows packs the weight before its GEMM and costs about twice the
1-row dot, so a speculative step verifying K+1 tokens cost about two plain steps.
:func:`pallas_kernels.dense_matmul.dense_matmul_cpu` streams the weight once for all rows and
sums each row in an order that does not depend on the row count. Which product runs is fixed
per compiled step by its row count and platform:

- on a CPU (the platform the step is lowered for, through ``platform_dependent``: the deviceless
  GPU compile never sees the kernel), up to :data:`KERNEL_MAX_ROWS` rows, where the kernel is
  registered, for a float32/bfloat16/float16 weight and one device: the kernel. Every row count
  up to there takes it, 1 included, so a plain decode step and a speculative verification of the
  same tokens give bitwise the same rows;
- else the plain dot (:func:`pallas_kernels.dense_matmul.dense_matmul_reference`).

A stacked weight (``[L, in, out]``, a scanned model's layer) is read in place at ``layer`` by
the kernel; the plain dot slices it out.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve import envs
from pallas_kernels.dense_matmul import (
    WEIGHT_DTYPES,
    dense_kernel_available,
    dense_matmul_cpu,
    dense_matmul_reference,
)

# Up to here the kernel is as fast as XLA's dot or faster on SmolLM2's shapes (docs/benchmarks.md,
# "Small-row dense kernel"). A lone 1-row product is slower, but 1 row is taken so that plain and
# verified rows match bitwise, and a scanned layer's in-place read more than pays for it there.
KERNEL_MAX_ROWS = 8


def dense_product(x: jax.Array, weight: jax.Array, *, layer: jax.Array | int | None = None,
                  transposed: bool = False, mesh: Mesh | None = None) -> jax.Array:
    """``x [..., K] @ W`` in ``x``'s dtype, ``W = weight`` (``[K, N]``; ``transposed``: ``[N, K]``,
    used as its transpose), or weight ``layer`` of a stack ``[L, ...]`` when ``layer`` is given."""
    rows = math.prod(x.shape[:-1])
    if (rows > KERNEL_MAX_ROWS or (mesh is not None and mesh.size > 1)
            or jnp.dtype(weight.dtype) not in WEIGHT_DTYPES or not _kernel_usable()):
        return dense_matmul_reference(x, weight, layer=layer, transposed=transposed)
    stacked = layer is not None
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)

    def on_cpu(x: jax.Array, weight: jax.Array, index: jax.Array) -> jax.Array:
        return dense_matmul_cpu(x, weight, layer=index if stacked else None, transposed=transposed)

    def elsewhere(x: jax.Array, weight: jax.Array, index: jax.Array) -> jax.Array:
        return dense_matmul_reference(x, weight, layer=index if stacked else None, transposed=transposed)

    return jax.lax.platform_dependent(x, weight, index, cpu=on_cpu, default=elsewhere)


def _kernel_usable() -> bool:
    """On a CPU whose compiler built the kernel (decided once per trace, never per step)."""
    return jax.default_backend() == "cpu" and dense_kernel_available(envs.kernel_build_dir())[0]
