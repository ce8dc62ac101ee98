"""A linear map whose weight stays in a GGUF file's 32-wide quant blocks (``--quantization gguf``):
Q8_0, Q4_0 or Q4_1, as stored, dequantized inside the product.

The weight is held one row per output feature (``qs [out, in * bits / 8]``, ``d`` and ``m``
``[out, in / 32]`` in float32; :mod:`pallas_kernels.block_quant_matmul` has the layout). Which
product runs is fixed per compiled step by its row count: up to :data:`KERNEL_MAX_ROWS` rows on
a CPU, the C++ kernel, which reads the blocks as stored (a decode step's cost is the bytes it
reads); above that, or on a GPU, the weight dequantized in the step and a float dot, where the
arithmetic per weight byte is high enough that the dequantization is cheap.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve import envs
from pallas_kernels.block_quant_matmul import (
    BLOCK,
    BLOCK_FORMATS,
    block_quant_kernel_available,
    block_quant_matmul_cpu,
    block_quant_matmul_reference,
    dequantize_blocks,
)

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

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _block_matmul(x, self.qs[...], self.d[...], self.m[...], self.bits, self.offset).astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]


class BlockQuantEmbedding(nnx.Module):
    """A token embedding kept in ``qtype`` blocks (rows = tokens), which doubles as the tied LM
    head: a lookup dequantizes only the rows it reads; ``attend`` is a block matmul."""

    def __init__(self, num_embeddings: int, features: int, *, qtype: str, param_dtype: jnp.dtype = jnp.float32):
        self.head = BlockQuantLinear(features, num_embeddings, qtype=qtype)
        self.param_dtype = param_dtype

    def __call__(self, ids: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        if mesh is not None and mesh.size > 1:
            raise NotImplementedError("GGUF blocks are kept on one device only")
        h = self.head
        rows = dequantize_blocks(h.qs[...][ids], h.d[...][ids], h.m[...][ids], bits=h.bits, offset=h.offset)
        return rows.astype(self.param_dtype)

    def attend(self, hidden: jax.Array) -> jax.Array:
        return self.head(hidden)


def _block_matmul(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array, bits: int, offset: int) -> jax.Array:
    """The kernel for few rows on a CPU, else the weight dequantized and a float dot (module doc)."""
    if math.prod(x.shape[:-1]) <= KERNEL_MAX_ROWS and _kernel_usable():
        return block_quant_matmul_cpu(x, qs, d, m, bits=bits, offset=offset)
    return block_quant_matmul_reference(x, qs, d, m, bits=bits, offset=offset)


def _kernel_usable() -> bool:
    """On a CPU whose compiler built the kernel (decided once per trace, never per step)."""
    return jax.default_backend() == "cpu" and block_quant_kernel_available(envs.kernel_build_dir())[0]
