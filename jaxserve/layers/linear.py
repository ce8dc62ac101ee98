"""Linear maps with weights stored ``[in, out]``, as a function and as an NNX module."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.layers.dense_matmul import dense_product


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
           layer: jax.Array | int | None = None, mesh: Mesh | None = None) -> jax.Array:
    """``x @ weight (+ bias)`` with weights stored ``[in, out]`` (transposed once at load time);
    with ``layer``, ``weight`` (and ``bias``) are a stack ``[L, in, out]`` and weight ``layer``
    is the one used. Few rows on a CPU run the small-row kernel (:mod:`.dense_matmul`)."""
    y = dense_product(x, weight, layer=layer, mesh=mesh)
    if bias is None:
        return y
    return y + (bias if layer is None else jax.lax.dynamic_index_in_dim(bias, layer, 0, keepdims=False))


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

    def __call__(self, x: jax.Array, layer: jax.Array | int | None = None, mesh: Mesh | None = None) -> jax.Array:
        """``x [..., in]`` -> ``[..., out]``. ``layer``: which weight of a scanned stack this is,
        needed when the parameters carry the layer axis (:class:`ProjectionLinear`); ``mesh``: the
        step's devices (the small-row kernel runs on one)."""
        kernel = self.kernel[...]
        if kernel.ndim == 2:
            layer = None
        elif layer is None:
            raise ValueError(f"Linear: a kernel stacked over {kernel.shape[0]} layers needs the layer index")
        return linear(x, kernel, None if self.bias is None else self.bias[...], layer=layer, mesh=mesh)


class ProjectionLinear(Linear):
    """A decoder layer's float projection (q|k|v, o, gate|up, down), always called with its layer
    index (:func:`jaxserve.layers.block_quant_linear.project`). In a scanned stack its parameters
    stay whole and the small-row kernel reads this layer's weight in place: the scan's slice would
    copy every layer's weight each step."""

    READS_STACK_IN_PLACE = True
