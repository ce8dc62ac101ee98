"""The LoRA delta of a mixed batch: each token adds its own adapter's ``x @ A @ B`` (or nothing).

The adapters sit in a fixed table of ``max_loras`` slots, ``a``: ``(slots, in, rank)`` and ``b``:
``(slots, rank, out)`` (scaling folded into ``b``, ranks below the table's padded with zeros);
``slot_ids[t]`` is token ``t``'s slot, ``-1`` for a base-model token. Shapes never depend on
which adapters are loaded, so writing a slot compiles nothing.

Equivalent forms:
- :func:`lora_delta_one_hot` multiplies by every slot at once (``in x slots*rank``) and masks the
  rank block of the token's slot; two dense matmuls, no sort, cost linear in ``max_loras``.
- :func:`lora_delta_ragged` sorts tokens by slot and runs ``jax.lax.ragged_dot`` (a grouped
  matmul); cost independent of ``max_loras`` but it pays a sort and two gathers.
``scripts/lora_matmul_bench.py`` measures both; the runner uses the one-hot form (see
docs/benchmarks.md) for every bucket, as :func:`lora_delta_parts` on the fused projections (q|k|v,
gate|up: one ``x @ A`` over all slots and parts, then each part's rank block times its own columns
of a compact ``B``). :func:`lora_delta_gathered` (each token's own slot) was tried for the decode
buckets and measured no faster on CPU, so no step uses it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxserve.layers.embedding import vocab_parallel_rows
from jaxserve.layers.shard import shard_map


def lora_delta_one_hot(x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``(tokens, out)``: ``x[t] @ a[s] @ b[s]`` with ``s = slot_ids[t]``, zero where ``s == -1``."""
    return lora_delta_packed(x, slot_ids, jnp.transpose(a, (1, 0, 2)), b)


def lora_delta_packed(x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """:func:`lora_delta_one_hot` with ``a`` stored ``(in, slots, rank)``, the slot tables' layout:
    both matmuls then read their table as stored (the reshapes are free), with no transpose copy."""
    d_in, slots, rank = a.shape
    xa = jnp.dot(x, a.reshape(d_in, slots * rank), preferred_element_type=jnp.float32)  # (T, slots*rank)
    mask = jax.nn.one_hot(slot_ids, slots, dtype=xa.dtype)  # -1 -> a zero row
    xa = (xa.reshape(-1, slots, rank) * mask[:, :, None]).reshape(-1, slots * rank)
    out = jnp.dot(xa.astype(b.dtype), b.reshape(slots * rank, -1), preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def lora_delta_parts(x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array,
                     part_widths: tuple[int, ...] | None = None, shards: int = 1,
                     layer: jax.Array | int | None = None) -> jax.Array:
    """The one-hot delta of a fused projection with ``b`` stored compact: ``a`` ``(in, slots,
    parts*rank)`` (part ``p``'s rank block at ``p*rank``), ``b`` ``(slots, rank, out)``, whose
    columns are ``shards`` groups of ``part_widths`` (the base's ``[q_s | k_s | v_s]`` per shard;
    None: one part). Each part's rank block multiplies only its own columns, so no block-diagonal
    zeros are read or multiplied; one part is :func:`lora_delta_packed`.

    ``layer``: ``a`` and ``b`` are the stacked ``(layers, ...)`` tables and each part reads its
    block of layer ``layer``'s ``b`` in one slice of the table: slicing the layer's whole ``b``
    first, shared by the parts' dots, made XLA:GPU write it out once per layer, every step."""
    if layer is not None:
        a = a[layer]
    d_in, slots, width = a.shape
    rank = b.shape[-2]
    parts = part_widths or (b.shape[-1] // shards,)
    if len(parts) == 1:
        return lora_delta_packed(x, slot_ids, a, b if layer is None else b[layer])
    xa = jnp.dot(x, a.reshape(d_in, slots * width), preferred_element_type=jnp.float32)
    mask = jax.nn.one_hot(slot_ids, slots, dtype=xa.dtype)  # -1 -> a zero row
    xa = (xa.reshape(-1, slots, len(parts), rank) * mask[:, :, None, None]).astype(b.dtype)
    b = b.reshape(*b.shape[:-1], shards, sum(parts))  # a shard's columns stay on its device under TP
    outs, col = [], 0
    for p, w in enumerate(parts):
        b_p = b[..., col:col + w] if layer is None else b[layer, ..., col:col + w]
        outs.append(jnp.einsum("tsr,srnw->tnw", xa[:, :, p], b_p, preferred_element_type=jnp.float32))
        col += w
    return jnp.concatenate(outs, axis=-1).reshape(x.shape[0], -1).astype(x.dtype)


def lora_delta_gathered(x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array,
                        part_widths: tuple[int, ...] | None = None) -> jax.Array:
    """:func:`lora_delta_parts` (one shard) by gathering each token's slot: ``a`` ``(in, slots,
    parts*rank)``, ``b`` ``(slots, rank, out)`` compact with ``part_widths`` output columns per part
    (in order; None: one part). Reads and multiplies only the token's own slot and, per part, its own
    rank block and columns, so its cost is ``tokens`` slots rather than ``max_loras`` per token."""
    parts = part_widths or (b.shape[-1],)
    rank = b.shape[1]
    safe = jnp.maximum(slot_ids, 0)
    a_t = jnp.take(a, safe, axis=1)  # (in, T, parts*rank)
    xa = jnp.einsum("ti,itr->tr", x, a_t, preferred_element_type=jnp.float32)
    xa = jnp.where((slot_ids >= 0)[:, None], xa, 0.0).astype(b.dtype)  # a base token adds nothing
    outs, col = [], 0
    for p, width in enumerate(parts):
        b_p = b[:, :, col:col + width][safe]  # (T, rank, width)
        outs.append(jnp.einsum("tr,tro->to", xa[:, p * rank:(p + 1) * rank], b_p,
                               preferred_element_type=jnp.float32))
        col += width
    return jnp.concatenate(outs, axis=-1).astype(x.dtype)


def lora_delta_ragged(x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """The same delta by a grouped matmul over the tokens sorted by slot (base tokens sort last)."""
    slots = a.shape[0]
    key = jnp.where(slot_ids < 0, slots, slot_ids)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=slots + 1)[:slots].astype(jnp.int32)
    xs = x[order]
    # Rows past sum(sizes) (the base tokens) belong to no group and come out zero.
    xa = jax.lax.ragged_dot(xs, a, sizes, preferred_element_type=jnp.float32)
    out = jax.lax.ragged_dot(xa.astype(b.dtype), b, sizes, preferred_element_type=jnp.float32)
    return jnp.zeros_like(out).at[order].set(out).astype(x.dtype)


def lora_delta_reference(x: np.ndarray, slot_ids: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row by row in numpy, for the tests."""
    out = np.zeros((x.shape[0], b.shape[2]), np.float32)
    for t, s in enumerate(slot_ids):
        if s >= 0:
            out[t] = x[t].astype(np.float32) @ a[s].astype(np.float32) @ b[s].astype(np.float32)
    return out


# The fused projections the model runs, and the adapter projections each is made of (in column order).
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """One step's adapters: every token's slot and the slot tables of the fused projections,
    ``a[name]``: ``(layers, in, slots, parts*rank)``, ``b[name]``: ``(layers, slots, rank, out)``
    (compact: each part's rows over its own columns, so one delta covers q|k|v and gate|up)."""

    slot_ids: jax.Array  # (tokens,) int32, -1 for a base-model token
    a: dict[str, jax.Array]
    b: dict[str, jax.Array]

    def delta(self, name: str, x: jax.Array, layer: jax.Array | int, part_widths: tuple[int, ...] | None = None,
              shards: int = 1) -> jax.Array:
        """``part_widths``/``shards``: the fused output's columns, as :func:`lora_delta_parts`."""
        return lora_delta_parts(x, self.slot_ids, self.a[name], self.b[name], part_widths, shards, layer)

    def head_delta(self, h: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        """``(rows, vocab)``: each logits row's LM-head delta (``slot_ids`` one per row of ``h``),
        over the table's vocabulary (padded to the mesh's size). Over a mesh, each device computes
        its own vocabulary columns (B split on them, A whole, no collective) and the delta stays
        split so, for the caller to add to its split logits before they are gathered."""
        a, b = self.a["lm_head"][0], self.b["lm_head"][0]
        if mesh is None or mesh.size == 1:
            return lora_delta_packed(h, self.slot_ids, a, b)
        axes = mesh.axis_names
        whole = PartitionSpec()
        return shard_map(lora_delta_packed, mesh, in_specs=(whole, whole, whole, PartitionSpec(None, None, axes)),
                         out_specs=PartitionSpec(None, axes))(h, self.slot_ids, a, b)

    def embedding_delta(self, input_ids: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        """``(tokens, hidden)``: each token's row of its slot's embedding A times that slot's B
        (a gather, not a one-hot over the vocabulary); zero for a base token. Over a mesh, A is
        split on the vocabulary as the base embedding is and its rows are looked up the same way
        (:func:`~jaxserve.layers.embedding.vocab_parallel_rows`: one sum of ``tokens x slots*rank``,
        exact); B is whole on every device."""
        a = vocab_parallel_rows(self.a["embed"][0], input_ids, mesh)  # (T, slots, rank)
        mask = jax.nn.one_hot(self.slot_ids, a.shape[1], dtype=jnp.float32)  # -1 -> a zero row
        xa = (a.astype(jnp.float32) * mask[:, :, None]).astype(self.b["embed"].dtype)
        return jnp.einsum("tsr,srh->th", xa, self.b["embed"][0], preferred_element_type=jnp.float32)
