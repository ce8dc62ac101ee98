"""RMSNorm, as a function and as an NNX module holding its scale."""

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in float32 and cast back, as the Hugging Face Llama family does; with an
    ``offset`` (Gemma's 1: the checkpoint stores ``w - 1``), scaled by ``offset + w`` in float32
    before the cast, as Gemma does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


class RMSNorm(nnx.Module):
    """:func:`rms_norm` over the last axis with a learned ``scale [num_features]`` (ones at init).

    Not ``nnx.RMSNorm``: it multiplies the scale in before casting back to the input's dtype,
    where Hugging Face casts first and scales after; in half precision the results differ.
    """

    def __init__(self, num_features: int, *, eps: float = 1e-6, param_dtype: jnp.dtype = jnp.float32,
                 offset: float = 0.0):
        self.scale = nnx.Param(jnp.full((num_features,), 1.0 - offset, param_dtype))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.offset)
