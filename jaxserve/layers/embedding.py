"""Token embedding, which doubles as the LM head when the checkpoint ties them."""

import jax
import jax.numpy as jnp
from flax import nnx


class Embedding(nnx.Module):
    """``embedding [num_embeddings, features]``: rows looked up by token id, or attended to as a
    tied LM head (``hidden @ embedding.T``)."""

    def __init__(self, num_embeddings: int, features: int, *, param_dtype: jnp.dtype = jnp.float32,
                 rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=0.02)
        self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), param_dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.embedding[...][ids]

    def attend(self, hidden: jax.Array) -> jax.Array:
        return hidden @ self.embedding[...].T
