"""Linear maps with weights stored ``[in, out]``, as a function and as an NNX module."""

import jax
import jax.numpy as jnp
from flax import nnx


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x @ weight (+ bias)`` with weights stored ``[in, out]`` (transposed once at load time)."""
    y = x @ weight
    return y if bias is None else y + bias


class Linear(nnx.Module):
    """``kernel [in, out]`` (the transpose of a Hugging Face ``weight``) and an optional ``bias [out]``.

    Fused projections (q|k|v, gate|up) are one ``Linear`` whose output columns are the parts side
    by side: one matmul instead of several.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 param_dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=0.02)  # Hugging Face's initializer_range
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(x, self.kernel[...], None if self.bias is None else self.bias[...])
