"""The device table of ``max_loras`` adapter slots that one compiled step reads.

Each fused projection (q|k|v, o, gate|up, down) has an ``a`` table ``(layers, in, slots,
parts*max_rank)`` (part ``p``'s rank block at ``p*max_rank``; the slots inside, so that one
layer's ``x @ a`` over every slot reads it as stored) and a compact ``b`` table ``(layers, slots,
max_rank, out)``: each part's rows sit above its own columns only, with no block-diagonal zeros
(:func:`~jaxserve.layers.lora.lora_delta_parts`); an adapter's smaller rank and missing projections
are zeros. Writing a slot
is one jitted update whose slot index is traced, so loading or swapping an adapter compiles
nothing after the first write.

Under tensor parallelism (a ``TPLayout`` of several shards) the ``b`` tables of the column-split
projections (q|k|v, gate|up) have their output columns in the layout's shard-major order, key/value
heads repeated as the base weights store them (:mod:`.tp_layout`), so that splitting ``b`` on its
output axis gives each device the columns of its own base shard; the row-split ones (o, down)
keep the base's input order, which their ``a`` tables split on. The LM head's and the embedding's
tables span the base's padded vocabulary (``TPLayout.padded_vocab``, zeros past the real one), so
that the head's ``b`` and the embedding's ``a`` split on it as the base head and embedding do.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers.lora import FUSED_PROJECTIONS, LoRABatch
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora_adapter import LoRAAdapter, LoRALayerWeights, projection_shape
from jaxserve.models.tp_layout import TPLayout


def layout_columns(cfg: ModelConfig, layout: TPLayout | None, name: str) -> np.ndarray | None:
    """For each output column of fused projection ``name`` as ``layout`` stores it, the column of
    the plain ``[q | k | v]`` (``[gate | up]``) order it is; None when the orders are the same."""
    if layout is None or layout.size == 1 or name not in ("qkv", "gate_up"):
        return None
    n = layout.size
    if name == "gate_up":
        per = cfg.intermediate_size // n
        return np.concatenate([np.r_[s * per:(s + 1) * per, cfg.intermediate_size + s * per:
                                     cfg.intermediate_size + (s + 1) * per] for s in range(n)])
    d, q_per = layout.head_dim, layout.q_heads_per_shard
    q_size, kv_size = cfg.q_size, cfg.kv_size

    def heads(base: int, hs: list[int]) -> list[np.ndarray]:
        return [np.arange(base + h * d, base + (h + 1) * d) for h in hs]

    cols: list[np.ndarray] = []
    for s in range(n):
        kv = layout.kv_heads_of_shard(s)
        cols += heads(0, list(range(s * q_per, (s + 1) * q_per))) + heads(q_size, kv) + heads(q_size + kv_size, kv)
    return np.concatenate(cols)


def fused_shapes(cfg: ModelConfig, max_rank: int, layout: TPLayout | None = None) -> dict[str, tuple[int, int, int]]:
    """``(in, parts*max_rank, out)`` of each fused projection's slot: ``a``'s width and ``b``'s
    columns (``out`` as ``layout`` stores it; ``b`` has ``max_rank`` rows)."""
    out = {}
    for name, parts in FUSED_PROJECTIONS.items():
        d_in = projection_shape(cfg, parts[0])[0]
        d_out = sum(projection_shape(cfg, p)[1] for p in parts)
        cols = layout_columns(cfg, layout, name)
        out[name] = (d_in, len(parts) * max_rank, d_out if cols is None else len(cols))
    return out


def adapter_slot_arrays(adapter: LoRAAdapter, cfg: ModelConfig, max_rank: int, layout: TPLayout | None = None
                        ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One slot's ``a``/``b`` arrays per fused projection, ``(layers, in, parts*max_rank)`` and
    ``(layers, max_rank, out)``."""
    a_out, b_out = {}, {}
    for name, (d_in, width, _) in fused_shapes(cfg, max_rank).items():
        a = np.zeros((cfg.num_hidden_layers, d_in, width), np.float32)
        d_out = sum(projection_shape(cfg, p)[1] for p in FUSED_PROJECTIONS[name])
        b = np.zeros((cfg.num_hidden_layers, max_rank, d_out), np.float32)
        col = 0
        for i, proj in enumerate(FUSED_PROJECTIONS[name]):
            width_out = projection_shape(cfg, proj)[1]
            for layer in range(cfg.num_hidden_layers):
                w = adapter.weights.get((layer, proj))
                if w is not None:
                    r0 = i * max_rank
                    a[layer, :, r0:r0 + w.rank] = w.a.T
                    b[layer, :w.rank, col:col + width_out] = w.b.T  # its own columns: no other part's rows
            col += width_out
        cols = layout_columns(cfg, layout, name)
        a_out[name], b_out[name] = a, (b if cols is None else b[:, :, cols])
    return a_out, b_out


def module_slot_arrays(w: LoRALayerWeights | None, d_in: int, d_out: int, max_rank: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """One slot's arrays of a whole-module pair (the LM head: ``d_in`` hidden, ``d_out`` vocab; the
    embedding: vocab, hidden): ``a`` ``(1, d_in, max_rank)`` and ``b`` ``(1, max_rank, d_out)``, one
    "layer" so they share the fused tables' axes; zeros when the adapter has no such pair, and past
    the adapter's own vocabulary (a vocabulary padded to the tensor-parallel size)."""
    a = np.zeros((1, d_in, max_rank), np.float32)
    b = np.zeros((1, max_rank, d_out), np.float32)
    if w is not None:
        (d_out_w, rank), d_in_w = w.b.shape, w.a.shape[1]
        a[0, :d_in_w, :rank], b[0, :rank, :d_out_w] = w.a.T, w.b.T
    return a, b


def _shardings(tables: dict[str, Any], slot_axis: int) -> dict[str, jax.sharding.Sharding]:
    """Each table's (named) sharding with its slot axis dropped (a slot's array has one axis less)."""
    out: dict[str, jax.sharding.Sharding] = {}
    for k, t in tables.items():
        sh = t.sharding
        assert isinstance(sh, jax.sharding.NamedSharding)
        spec = list(sh.spec) + [None] * (t.ndim - len(sh.spec))
        del spec[slot_axis]
        out[k] = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*spec))
    return out


A_SLOT_AXIS, B_SLOT_AXIS = 2, 1  # the slot axis of the a and b tables


@functools.partial(jax.jit, static_argnames="axis")
def _write_slot(tables: dict[str, jax.Array], slot: jax.Array, values: dict[str, jax.Array],
                axis: int) -> dict[str, jax.Array]:
    return {k: jax.lax.dynamic_update_index_in_dim(t, values[k].astype(t.dtype), slot, axis=axis)
            for k, t in tables.items()}


class LoRASlotTable:
    """The ``max_loras`` device slots; :meth:`write` puts an adapter in a slot, :meth:`batch`
    gives the step's :class:`LoRABatch` for the tokens' slot indices."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: str | None = None,
                 layout: TPLayout | None = None, abstract: bool = False, lm_head: bool = False,
                 embedding: bool = False):
        self.cfg, self.max_loras, self.max_rank, self.layout = cfg, max_loras, max_rank, layout
        dt = jnp.dtype(dtype or cfg.dtype)
        layers = cfg.num_hidden_layers
        shapes = fused_shapes(cfg, max_rank, layout)
        # abstract: shapes only (a compile for a target with no device here), never written
        make = (lambda shape: jax.ShapeDtypeStruct(shape, dt)) if abstract else (lambda shape: jnp.zeros(shape, dt))
        # jax arrays (ShapeDtypeStructs when abstract)
        self.a: dict[str, Any] = {k: make((layers, d_in, max_loras, w)) for k, (d_in, w, _) in shapes.items()}
        self.b: dict[str, Any] = {k: make((layers, max_loras, max_rank, d_out)) for k, (_, _, d_out) in shapes.items()}
        # the vocabulary as the base head and embedding store it: padded to a multiple of the shards
        self.vocab = cfg.vocab_size if layout is None else layout.padded_vocab
        if lm_head:  # the LM head's slots, one "layer" so they share the other tables' axes
            self.a["lm_head"] = make((1, cfg.hidden_size, max_loras, max_rank))
            self.b["lm_head"] = make((1, max_loras, max_rank, self.vocab))
        if embedding:  # a: (1, vocab, slots, rank), gathered by token id (LoRABatch.embedding_delta)
            self.a["embed"] = make((1, self.vocab, max_loras, max_rank))
            self.b["embed"] = make((1, max_loras, max_rank, cfg.hidden_size))

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"LoRA slot {slot} outside 0..{self.max_loras - 1}")
        a, b = adapter_slot_arrays(adapter, self.cfg, self.max_rank, self.layout)
        if "lm_head" in self.a:
            a["lm_head"], b["lm_head"] = module_slot_arrays(adapter.lm_head, self.cfg.hidden_size, self.vocab,
                                                            self.max_rank)
        elif adapter.lm_head is not None:
            raise ValueError(f"LoRA adapter {adapter.path} has an LM-head LoRA; this slot table has no LM-head slots")
        if "embed" in self.a:
            a["embed"], b["embed"] = module_slot_arrays(adapter.embedding, self.vocab, self.cfg.hidden_size,
                                                        self.max_rank)
        elif adapter.embedding is not None:
            raise ValueError(f"LoRA adapter {adapter.path} has an embedding LoRA; "
                             "this slot table has no embedding slots")
        if isinstance(next(iter(self.a.values())).sharding, jax.sharding.NamedSharding):
            # On a mesh, the new slot goes to the tables' devices split as they are, so the update
            # keeps their placement.
            a, b = jax.device_put((a, b), (_shardings(self.a, A_SLOT_AXIS), _shardings(self.b, B_SLOT_AXIS)))
        self.a = _write_slot(self.a, jnp.int32(slot), a, axis=A_SLOT_AXIS)
        self.b = _write_slot(self.b, jnp.int32(slot), b, axis=B_SLOT_AXIS)

    def batch(self, slot_ids: jax.Array) -> LoRABatch:
        return LoRABatch(slot_ids=slot_ids, a=self.a, b=self.b)
