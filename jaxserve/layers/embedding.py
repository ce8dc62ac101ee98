"""Token embedding, which doubles as the LM head when the checkpoint ties them."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxserve.layers.dense_matmul import dense_product
from jaxserve.layers.shard import shard_map


def vocab_parallel_rows(table: jax.Array, ids: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    """``table[ids]`` for a ``table`` whose first axis is the (padded) vocabulary, split over
    ``mesh`` on that axis: each shard looks up the ids in its own row range, writes zeros for the
    rest, and one sum over the shards (exact: one non-zero term per element) gives every shard the
    full rows, with no shard ever reading another's."""
    if mesh is None or mesh.size == 1:
        return table[ids]
    axes = mesh.axis_names

    def lookup_local(rows: jax.Array, ids: jax.Array) -> jax.Array:
        local = ids - jax.lax.axis_index(axes) * rows.shape[0]
        mine = (local >= 0) & (local < rows.shape[0])
        found = rows[jnp.clip(local, 0, rows.shape[0] - 1)]
        mine = mine.reshape(mine.shape + (1,) * (found.ndim - 1))
        return jax.lax.psum(jnp.where(mine, found, jnp.zeros_like(found)), axes)

    rows = PartitionSpec(axes, *(None,) * (table.ndim - 1))
    return shard_map(lookup_local, mesh, in_specs=(rows, PartitionSpec()), out_specs=PartitionSpec())(table, ids)


def vocab_parallel_logits(h: jax.Array, weight: jax.Array, tied: bool, mesh: Mesh) -> jax.Array:
    """``h @ head`` for an LM head split over ``mesh`` on the (padded) vocabulary: ``weight`` is
    the head ``[hidden, vocab]`` split on its columns, or ``tied``, the embedding ``[vocab,
    hidden]`` split on its rows. Each device multiplies by its own slice under ``shard_map`` (left
    to itself, the partitioner may gather the whole head instead); the logits come back split on
    the vocabulary, for the caller to add to or gather."""
    axes = mesh.axis_names
    weight_spec = PartitionSpec(axes, None) if tied else PartitionSpec(None, axes)

    def local(h: jax.Array, w: jax.Array) -> jax.Array:
        return h @ (w.T if tied else w)

    return shard_map(local, mesh, in_specs=(PartitionSpec(), weight_spec), out_specs=PartitionSpec(None, axes))(
        h, weight)


class Embedding(nnx.Module):
    """``embedding [num_embeddings, features]``: rows looked up by token id, or attended to as a
    tied LM head (``hidden @ embedding.T``).

    Split over a mesh, the rows are vocabulary-parallel (:func:`vocab_parallel_rows`).
    """

    def __init__(self, num_embeddings: int, features: int, *, param_dtype: jnp.dtype = jnp.float32,
                 rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=0.02)
        self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), param_dtype))

    def __call__(self, ids: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        return vocab_parallel_rows(self.embedding[...], ids, mesh)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """``hidden @ embedding.T``: the logits of a tied head; a few rows on a CPU run the
        small-row kernel, which reads the ``[vocab, hidden]`` table as stored (no transpose)."""
        return dense_product(hidden, self.embedding[...], transposed=True)
