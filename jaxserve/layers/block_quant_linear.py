"""A linear map whose weight stays in a GGUF file's 32-wide quant blocks (``--quantization gguf``):
Q8_0, Q4_0 or Q4_1, as stored, dequantized inside the product.

The weight is held one row per output feature (``qs [out, in * bits / 8]``, ``d`` and ``m``
``[out, in / 32]`` in float32; :mod:`pallas_kernels.block_quant_matmul` has the layout). Which
product runs is fixed per compiled step by its row count: up to :data:`KERNEL_MAX_ROWS` rows on
a CPU, the C++ kernel, which reads the blocks as stored (a decode step's cost is the bytes it
reads); above that, the weight dequantized in the step and a float dot, where the arithmetic per
weight byte is high enough that the dequantization is cheap. On a GPU, a Pallas kernel
(:mod:`pallas_kernels.block_quant_matmul_triton`) that reads the blocks as stored.

Under tensor parallelism the blocks are split as the float kernels are (:mod:`jaxserve.models.tp_layout`)
and each device multiplies by its own blocks under ``shard_map`` (:func:`project`): a custom call
left to the partitioner would have every device gather the whole weight first.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxserve import envs
from jaxserve.layers.shard import shard_map
from pallas_kernels.block_quant_matmul import (
    BLOCK,
    BLOCK_FORMATS,
    block_quant_kernel_available,
    block_quant_matmul_cpu,
    block_quant_matmul_reference,
    dequantize_blocks,
)
from pallas_kernels.block_quant_matmul_triton import block_quant_matmul_triton

KERNEL_MAX_ROWS = 128  # the kernel is faster or even up to here (docs/benchmarks.md, "GGUF blocks kept")
# The model-side method name: "gguf:Q4_1" for a file whose projections are Q4_1 blocks, and
# "gguf:Q4_1:Q8_0" when its (tied) token embedding is kept as Q8_0 blocks too.
GGUF_PREFIX = "gguf:"


def block_format_of(method: str) -> str | None:
    """The projections' block format of a model-side method (``"gguf:Q4_1..."`` -> ``"Q4_1"``);
    None for another method."""
    return method.split(":")[1] if method.startswith(GGUF_PREFIX) else None


def embedding_block_format_of(method: str | None) -> str | None:
    """The token embedding's block format (``"gguf:Q4_1:Q8_0"`` -> ``"Q8_0"``), None if it is float."""
    parts = (method or "").split(":")
    return parts[2] if method and method.startswith(GGUF_PREFIX) and len(parts) > 2 else None


class BlockQuantLinear(nnx.Module):
    """``y = x @ W.T (+ bias)`` with ``W [out, in]`` in ``qtype`` blocks; built with zeros, filled by
    the GGUF loader (:func:`jaxserve.models.loader.load_gguf_model`)."""

    def __init__(self, in_features: int, out_features: int, *, qtype: str, use_bias: bool = False,
                 param_dtype: jnp.dtype = jnp.float32):
        if qtype not in BLOCK_FORMATS:
            raise ValueError(f"GGUF block format {qtype!r}: kept quantized are {', '.join(BLOCK_FORMATS)}")
        if in_features % BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of the {BLOCK}-wide blocks")
        self.qtype = qtype
        self.bits, self.offset, _ = BLOCK_FORMATS[qtype]
        blocks = in_features // BLOCK
        self.qs = nnx.Param(jnp.zeros((out_features, in_features * self.bits // 8), jnp.uint8))
        self.d = nnx.Param(jnp.zeros((out_features, blocks), jnp.float32))
        self.m = nnx.Param(jnp.zeros((out_features, blocks), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else nnx.data(None)

    def __call__(self, x: jax.Array, mesh: Mesh | None = None, split: str | None = None) -> jax.Array:
        """``x [T, in]`` -> ``[T, out]``. With a ``mesh`` of several devices, ``split`` says how the
        blocks are split over it: "column" (by output rows: each device computes its output columns),
        "row" (by input, in whole blocks: each device's partial product, summed over the devices)."""
        qs, d, m = self.qs[...], self.d[...], self.m[...]
        if mesh is None or mesh.size == 1:
            y = _block_matmul(x, qs, d, m, self.bits, self.offset)
        else:
            y = _split_block_matmul(x, qs, d, m, self.bits, self.offset, mesh, split)
        y = y.astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]


def project(linear: nnx.Module, x: jax.Array, mesh: Mesh | None, split: str) -> jax.Array:
    """``linear(x)``; a :class:`BlockQuantLinear` is told the mesh and how its blocks are split
    ("column" or "row"; the float kernels' split is in their shardings already)."""
    if isinstance(linear, BlockQuantLinear):
        return linear(x, mesh, split)
    return linear(x)


def _split_block_matmul(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array, bits: int, offset: int,
                        mesh: Mesh, split: str | None) -> jax.Array:
    """The product on each device's own blocks (module doc), the result replicated ("row") or
    split on its columns ("column"), as the float kernels' products are."""
    axes = mesh.axis_names

    def local(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array) -> jax.Array:
        y = _block_matmul(x, qs, d, m, bits, offset)
        return jax.lax.psum(y, axes) if split == "row" else y

    if split == "column":
        weight, x_spec, out_spec = PartitionSpec(axes, None), PartitionSpec(), PartitionSpec(None, axes)
    elif split == "row":
        weight, x_spec, out_spec = PartitionSpec(None, axes), PartitionSpec(None, axes), PartitionSpec()
    else:
        raise ValueError(f"split: 'column' or 'row' for GGUF blocks over {mesh.size} devices, got {split!r}")
    return shard_map(local, mesh, in_specs=(x_spec, weight, weight, weight), out_specs=out_spec)(x, qs, d, m)


class BlockQuantEmbedding(nnx.Module):
    """A token embedding kept in ``qtype`` blocks (rows = tokens), which doubles as the tied LM
    head: a lookup dequantizes only the rows it reads; ``attend`` is a block matmul."""

    def __init__(self, num_embeddings: int, features: int, *, qtype: str, param_dtype: jnp.dtype = jnp.float32):
        self.head = BlockQuantLinear(features, num_embeddings, qtype=qtype)
        self.param_dtype = param_dtype

    def __call__(self, ids: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        """The rows of ``ids``; split over a mesh, vocabulary-parallel as the float
        :class:`~jaxserve.layers.embedding.Embedding` is (each device its own rows, zeros
        elsewhere, one sum)."""
        h = self.head
        qs, d, m = h.qs[...], h.d[...], h.m[...]
        if mesh is None or mesh.size == 1:
            return self._rows(qs, d, m, ids)
        axes = mesh.axis_names

        def lookup_local(qs: jax.Array, d: jax.Array, m: jax.Array, ids: jax.Array) -> jax.Array:
            local = ids - jax.lax.axis_index(axes) * qs.shape[0]
            mine = (local >= 0) & (local < qs.shape[0])
            found = self._rows(qs, d, m, jnp.clip(local, 0, qs.shape[0] - 1))
            return jax.lax.psum(jnp.where(mine[:, None], found, jnp.zeros_like(found)), axes)

        rows = PartitionSpec(axes, None)
        return shard_map(lookup_local, mesh, in_specs=(rows, rows, rows, PartitionSpec()),
                         out_specs=PartitionSpec())(qs, d, m, ids)

    def _rows(self, qs: jax.Array, d: jax.Array, m: jax.Array, ids: jax.Array) -> jax.Array:
        h = self.head
        return dequantize_blocks(qs[ids], d[ids], m[ids], bits=h.bits, offset=h.offset).astype(self.param_dtype)

    def attend(self, hidden: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        """The logits over the (padded) vocabulary; split over a mesh, each device's vocabulary
        slice, its columns split (the caller gathers them)."""
        return self.head(hidden, mesh, "column")


def _block_matmul(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array, bits: int, offset: int) -> jax.Array:
    """The kernel for few rows on a CPU, else the weight dequantized and a float dot; on a GPU the
    dequantization fused into the dot (module doc). The platform is the one the step is lowered
    for (``platform_dependent`` keeps that branch alone), not the process's default backend: the
    deviceless GPU compile runs on a CPU."""

    def on_cpu(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array) -> jax.Array:
        if math.prod(x.shape[:-1]) <= KERNEL_MAX_ROWS and _kernel_usable():
            return block_quant_matmul_cpu(x, qs, d, m, bits=bits, offset=offset)
        return block_quant_matmul_reference(x, qs, d, m, bits=bits, offset=offset)

    def on_gpu(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array) -> jax.Array:
        return block_quant_matmul_triton(x, qs, d, m, bits=bits, offset=offset)

    return jax.lax.platform_dependent(x, qs, d, m, cpu=on_cpu, cuda=on_gpu, rocm=on_gpu)


def _kernel_usable() -> bool:
    """On a CPU whose compiler built the kernel (decided once per trace, never per step)."""
    return jax.default_backend() == "cpu" and block_quant_kernel_available(envs.kernel_build_dir())[0]
