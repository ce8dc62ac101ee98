"""Linear maps whose weights stay quantized in memory (int8 or fp8 e4m3, one scale per output
column), dequantized inside the matmul; beside :class:`jaxserve.layers.linear.Linear`.

``kernel [in, out]`` holds the quantized values and ``kernel_scale [out]`` (float32) the step of
each output column, so ``weight = kernel * kernel_scale``: the scale multiplies the product's
columns, never the weight, and no dequantized copy of the weight is needed.

How the product is computed (``int8_activations``):

- False (w8a16): ``(x @ kernel.astype(x.dtype)) * kernel_scale``. XLA:GPU fuses the convert into
  the dot's operand read; XLA:CPU materialises the converted weight first, so on a CPU this only
  saves memory.
- True (int8 on a CPU): each token's activations are quantized to int8 on the fly (one scale per
  row, its absolute maximum / 127, as vLLM's dynamic per-token w8a8 and llama.cpp's Q8_0 path do),
  and the int8 x int8 -> int32 product runs in XLA:CPU's own int8 dot (YNNPACK, VNNI), which reads
  a quarter of float32's weight bytes. The rounding of the activations adds a relative error of
  about 1/254 per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.layers.block_quant_linear import BlockQuantLinear, block_format_of
from jaxserve.layers.linear import Linear, ProjectionLinear

QUANTIZED_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def quantized_linear_reference(x: jax.Array, kernel: jax.Array, kernel_scale: jax.Array,
                               bias: jax.Array | None = None) -> jax.Array:
    """The oracle: the weight dequantized in float32, then a plain matmul."""
    weight = kernel.astype(jnp.float32) * kernel_scale.astype(jnp.float32)
    y = x.astype(jnp.float32) @ weight
    return y if bias is None else y + bias


def quantize_rows_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per row: ``x ~= q * scale`` with ``scale [rows, 1]`` = the row's absolute
    maximum / 127 (1 for an all-zero row, such as padding)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


def quantized_linear(x: jax.Array, kernel: jax.Array, kernel_scale: jax.Array, bias: jax.Array | None = None,
                     *, int8_activations: bool = False) -> jax.Array:
    """``x @ (kernel * kernel_scale) (+ bias)`` without a dequantized weight (see the module doc)."""
    if int8_activations and kernel.dtype == jnp.int8:
        xq, x_scale = quantize_rows_int8(x.reshape(-1, x.shape[-1]))
        acc = jax.lax.dot(xq, kernel, preferred_element_type=jnp.int32)
        y = (acc.astype(jnp.float32) * x_scale * kernel_scale).reshape(*x.shape[:-1], -1).astype(x.dtype)
    else:
        y = jax.lax.dot_general(x, kernel.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
        y = (y * kernel_scale).astype(x.dtype)
    return y if bias is None else y + bias


class QuantizedLinear(nnx.Module):
    """``kernel [in, out]`` in int8 or float8_e4m3fn, ``kernel_scale [out]`` float32, and an
    optional ``bias [out]`` in the activations' dtype. Built with zeros: the loader fills it from
    a float checkpoint (``jaxserve.models.quantize``)."""

    def __init__(self, in_features: int, out_features: int, *, method: str, use_bias: bool = False,
                 param_dtype: jnp.dtype = jnp.float32, int8_activations: bool = False):
        if method not in QUANTIZED_DTYPES:
            raise ValueError(f"quantization method {method!r}: known ones are {', '.join(QUANTIZED_DTYPES)}")
        self.method = method
        self.int8_activations = int8_activations
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), QUANTIZED_DTYPES[method]))
        self.kernel_scale = nnx.Param(jnp.ones((out_features,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        return quantized_linear(x, self.kernel[...], self.kernel_scale[...],
                                None if self.bias is None else self.bias[...],
                                int8_activations=self.int8_activations)


def default_int8_activations(platform: str | None = None) -> bool:
    """Int8 activations where they pay: on a CPU (XLA:CPU's int8 dot; its float dot of a converted
    weight reads more than float32's), not on a GPU (XLA:GPU fuses the convert into the dot)."""
    return (platform or jax.default_backend()) == "cpu"


def make_linear(in_features: int, out_features: int, *, use_bias: bool, param_dtype: jnp.dtype,
                quantization: str | None, rngs: nnx.Rngs) -> Linear | QuantizedLinear | BlockQuantLinear:
    """A float :class:`Linear`, a :class:`QuantizedLinear` of ``quantization`` ("int8", "fp8"), or a
    :class:`BlockQuantLinear` for a GGUF block format ("gguf:Q4_1", ...)."""
    if quantization is None:
        return ProjectionLinear(in_features, out_features, use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
    block_format = block_format_of(quantization)
    if block_format is not None:
        return BlockQuantLinear(in_features, out_features, qtype=block_format, use_bias=use_bias,
                                param_dtype=param_dtype)
    return QuantizedLinear(in_features, out_features, method=quantization, use_bias=use_bias,
                           param_dtype=param_dtype, int8_activations=default_int8_activations())
