import jax


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x @ weight (+ bias)`` with weights stored ``[in, out]`` (transposed once at load time)."""
    y = x @ weight
    return y if bias is None else y + bias
