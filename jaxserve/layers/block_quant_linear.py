"""A linear map whose weight stays in a GGUF file's 32-wide quant blocks (``--quantization gguf``):
Q8_0, Q4_0 or Q4_1, as stored, dequantized inside the product.

The weight is held one row per output feature (``qs [out, in * bits / 8]``, ``d`` and, for Q4_1
only, ``m`` ``[out, in / 32]`` in the file's float16: the file's bytes per block;
:mod:`pallas_kernels.block_quant_matmul` has the layout). Which
product runs is fixed per compiled step by its row count: up to :data:`KERNEL_MAX_ROWS` rows on
a CPU, the C++ kernel, which reads the blocks as stored (a decode step's cost is the bytes it
reads), with int8 activations up to :data:`INT8_MAX_ROWS` rows of a 4-bit format and
:data:`Q8_INT8_MAX_ROWS` of a Q8_0 projection (the tied head keeps float ones); above that, the weight
dequantized in the step and a float dot, where the arithmetic per
weight byte is high enough that the dequantization is cheap. On a GPU, a Pallas kernel
(:mod:`pallas_kernels.block_quant_matmul_triton`) that reads the blocks as stored.

In a scanned model (:class:`jaxserve.models.layer_stack.ScannedLayers`) a layer's ``qs``/``d``/``m``
stay the whole stack (``READS_STACK_IN_PLACE``) and the product is given the layer index: the
kernel reads that layer's blocks where they are, where the scan's slice would copy them all, every
layer, every step (a quarter of a decode step's time on SmolLM2's Q4_1 file).

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
from jaxserve.layers.linear import Linear
from jaxserve.layers.shard import shard_map
from pallas_kernels.block_quant_matmul import (
    BLOCK,
    BLOCK_FORMATS,
    block_quant_kernel_available,
    block_quant_matmul_cpu,
    block_quant_matmul_reference,
    dequantize_blocks,
    layer_of,
)
from pallas_kernels.block_quant_matmul_triton import block_quant_matmul_triton

KERNEL_MAX_ROWS = 128  # the kernel is faster or even up to here (docs/benchmarks.md, "GGUF blocks kept")
# Up to this many rows a 4-bit format's kernel quantizes the activations to int8 per block of 32
# and uses VNNI's int8 dots (llama.cpp's path; the float path where the CPU lacks them): 1.6-2x
# faster at 1-4 Q4_1 rows, slower from 16 on.
INT8_MAX_ROWS = 4
# The same for Q8_0 projections (llama.cpp's own path): as fast at one row, faster at 4-16 on
# SmolLM2's shapes. Not 32 (as fast again there): 32-row prompt chunks with int8 activations cost
# the accuracy table's Q8_0 row 3.6 points of top-1 agreement. Not the tied Q8_0 head
# (``float_activations``): with int8 activations SmolLM2's greedy chat answer changed
# (docs/benchmarks.md, "One stream's block matmuls", "Q8_0: where the time goes").
Q8_INT8_MAX_ROWS = 16
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

    # A scanned stack leaves this module's parameters whole (with their layer axis): the call
    # is given the layer index instead (module doc).
    READS_STACK_IN_PLACE = True

    def __init__(self, in_features: int, out_features: int, *, qtype: str, use_bias: bool = False,
                 param_dtype: jnp.dtype = jnp.float32, float_activations: bool = False):
        if qtype not in BLOCK_FORMATS:
            raise ValueError(f"GGUF block format {qtype!r}: kept quantized are {', '.join(BLOCK_FORMATS)}")
        if in_features % BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of the {BLOCK}-wide blocks")
        self.qtype = qtype
        # True for the tied Q8_0 head: int8 activations there changed SmolLM2's greedy answer
        self.float_activations = float_activations
        self.bits, self.offset, has_min = BLOCK_FORMATS[qtype]
        blocks = in_features // BLOCK
        self.qs = nnx.Param(jnp.zeros((out_features, in_features * self.bits // 8), jnp.uint8))
        self.d = nnx.Param(jnp.zeros((out_features, blocks), jnp.float16))
        # no minimums in the format: no array (a zero one would be read by every product)
        self.m = nnx.Param(jnp.zeros((out_features, blocks), jnp.float16)) if has_min else nnx.data(None)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else nnx.data(None)

    def __call__(self, x: jax.Array, mesh: Mesh | None = None, split: str | None = None,
                 layer: jax.Array | int | None = None) -> jax.Array:
        """``x [T, in]`` -> ``[T, out]``. With a ``mesh`` of several devices, ``split`` says how the
        blocks are split over it: "column" (by output rows: each device computes its output columns),
        "row" (by input, in whole blocks: each device's partial product, summed over the devices).
        ``layer``: which weight of a scanned stack this is (the parameters then carry the layer axis)."""
        qs, d, m = self.qs[...], self.d[...], _value(self.m)
        stacked = qs.ndim == 3
        if stacked and layer is None:
            raise ValueError(f"BlockQuantLinear: blocks stacked over {qs.shape[0]} layers need the layer index")
        layer = layer if stacked else None
        int8_rows = 0 if self.float_activations else int8_max_rows(self.bits)
        if mesh is None or mesh.size == 1:
            y = _block_matmul(x, qs, d, m, self.bits, self.offset, layer, int8_rows)
        else:
            y = _split_block_matmul(x, qs, d, m, self.bits, self.offset, mesh, split, layer, int8_rows)
        y = y.astype(x.dtype)
        if self.bias is None:
            return y
        bias = self.bias[...]
        return y + (jax.lax.dynamic_index_in_dim(bias, layer, 0, keepdims=False) if stacked else bias)


def set_int8_activations(model: nnx.Module) -> int:
    """Every :class:`BlockQuantLinear` of ``model`` multiplies few rows by int8 activations on a
    CPU, a tied Q8_0 head's too (served, it keeps float ones): for a draft model, whose tokens
    only decide what the target verifies. Returns how many products that switched."""
    switched = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, BlockQuantLinear) and module.float_activations:
            module.float_activations = False
            switched += 1
    return switched


def project(linear: nnx.Module, x: jax.Array, mesh: Mesh | None, split: str,
            layer: jax.Array | int | None = None) -> jax.Array:
    """``linear(x)``; a :class:`BlockQuantLinear` is told the mesh, how its blocks are split
    ("column" or "row"; the float kernels' split is in their shardings already) and the layer
    index (which it needs when its parameters are a scanned stack's); a float :class:`Linear`,
    the layer index and the mesh."""
    if isinstance(linear, BlockQuantLinear):
        return linear(x, mesh, split, layer)
    if isinstance(linear, Linear):  # a float weight: the small-row kernel wants the layer and the mesh
        return linear(x, layer, mesh)
    return linear(x)


def _value(param: nnx.Param | None) -> jax.Array | None:
    return None if param is None else param[...]


def int8_max_rows(bits: int) -> int:
    """Up to how many rows a projection of ``bits``-bit blocks takes int8 activations (read at
    trace time, so a test may set the constants)."""
    return INT8_MAX_ROWS if bits == 4 else Q8_INT8_MAX_ROWS


def _split_block_matmul(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array | None, bits: int, offset: int,
                        mesh: Mesh, split: str | None, layer: jax.Array | int | None, int8_rows: int) -> jax.Array:
    """The product on each device's own blocks (module doc), the result replicated ("row") or
    split on its columns ("column"), as the float kernels' products are."""
    axes = mesh.axis_names

    def local(x: jax.Array, index: jax.Array, qs: jax.Array, d: jax.Array, *m: jax.Array) -> jax.Array:
        y = _block_matmul(x, qs, d, m[0] if m else None, bits, offset, None if layer is None else index, int8_rows)
        return jax.lax.psum(y, axes) if split == "row" else y

    if split == "column":
        weight, x_spec, out_spec = PartitionSpec(axes, None), PartitionSpec(), PartitionSpec(None, axes)
    elif split == "row":
        weight, x_spec, out_spec = PartitionSpec(None, axes), PartitionSpec(None, axes), PartitionSpec()
    else:
        raise ValueError(f"split: 'column' or 'row' for GGUF blocks over {mesh.size} devices, got {split!r}")
    if layer is not None:  # the stack's layer axis is not split
        weight = PartitionSpec(None, *weight)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    blocks = (qs, d) if m is None else (qs, d, m)  # the scales are split as the quants are
    return shard_map(local, mesh, in_specs=(x_spec, PartitionSpec(), *(weight,) * len(blocks)),
                     out_specs=out_spec)(x, index, *blocks)


class BlockQuantEmbedding(nnx.Module):
    """A token embedding kept in ``qtype`` blocks (rows = tokens), which doubles as the tied LM
    head: a lookup dequantizes only the rows it reads; ``attend`` is a block matmul."""

    def __init__(self, num_embeddings: int, features: int, *, qtype: str, param_dtype: jnp.dtype = jnp.float32):
        self.head = BlockQuantLinear(features, num_embeddings, qtype=qtype, float_activations=True)
        self.param_dtype = param_dtype

    def __call__(self, ids: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        """The rows of ``ids``; split over a mesh, vocabulary-parallel as the float
        :class:`~jaxserve.layers.embedding.Embedding` is (each device its own rows, zeros
        elsewhere, one sum)."""
        h = self.head
        qs, d, m = h.qs[...], h.d[...], _value(h.m)
        if mesh is None or mesh.size == 1:
            return self._rows(ids, qs, d, m)
        axes = mesh.axis_names

        def lookup_local(ids: jax.Array, qs: jax.Array, d: jax.Array, *m: jax.Array) -> jax.Array:
            local = ids - jax.lax.axis_index(axes) * qs.shape[0]
            mine = (local >= 0) & (local < qs.shape[0])
            found = self._rows(jnp.clip(local, 0, qs.shape[0] - 1), qs, d, m[0] if m else None)
            return jax.lax.psum(jnp.where(mine[:, None], found, jnp.zeros_like(found)), axes)

        rows = PartitionSpec(axes, None)
        blocks = (qs, d) if m is None else (qs, d, m)
        return shard_map(lookup_local, mesh, in_specs=(PartitionSpec(), *(rows,) * len(blocks)),
                         out_specs=PartitionSpec())(ids, *blocks)

    def _rows(self, ids: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array | None) -> jax.Array:
        h = self.head
        return dequantize_blocks(qs[ids], d[ids], None if m is None else m[ids], bits=h.bits,
                                 offset=h.offset).astype(self.param_dtype)

    def attend(self, hidden: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        """The logits over the (padded) vocabulary; split over a mesh, each device's vocabulary
        slice, its columns split (the caller gathers them)."""
        return self.head(hidden, mesh, "column")


def _block_matmul(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array | None, bits: int, offset: int,
                  layer: jax.Array | int | None = None, int8_rows: int = 0) -> jax.Array:
    """The kernel for few rows on a CPU, else the weight dequantized and a float dot; on a GPU the
    dequantization fused into the dot (module doc). The platform is the one the step is lowered
    for (``platform_dependent`` keeps that branch alone), not the process's default backend: the
    deviceless GPU compile runs on a CPU. ``layer``: weight ``layer`` of stacked blocks;
    ``int8_rows``: up to how many rows the kernel takes int8 activations."""
    stacked = layer is not None
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)

    def on_cpu(x: jax.Array, index: jax.Array, qs: jax.Array, d: jax.Array, *m: jax.Array) -> jax.Array:
        at, mins = index if stacked else None, m[0] if m else None
        rows = math.prod(x.shape[:-1])
        if rows <= KERNEL_MAX_ROWS and _kernel_usable():
            return block_quant_matmul_cpu(x, qs, d, mins, bits=bits, offset=offset, layer=at,
                                          int8_activations=rows <= int8_rows)
        return block_quant_matmul_reference(x, qs, d, mins, bits=bits, offset=offset, layer=at)

    def on_gpu(x: jax.Array, index: jax.Array, qs: jax.Array, d: jax.Array, *m: jax.Array) -> jax.Array:
        # a GPU unrolls its layers (llama.default_scan_layers): a stack here is sliced first
        qs, d, mins = layer_of(qs, d, m[0] if m else None, index if stacked else None)
        return block_quant_matmul_triton(x, qs, d, mins, bits=bits, offset=offset)

    blocks = (qs, d) if m is None else (qs, d, m)
    return jax.lax.platform_dependent(x, index, *blocks, cpu=on_cpu, cuda=on_gpu, rocm=on_gpu)


def _kernel_usable() -> bool:
    """On a CPU whose compiler built the kernel (decided once per trace, never per step)."""
    return jax.default_backend() == "cpu" and block_quant_kernel_available(envs.kernel_build_dir())[0]
