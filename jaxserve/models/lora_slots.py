"""The device table of ``max_loras`` adapter slots that one compiled step reads.

Each fused projection (q|k|v, o, gate|up, down) has an ``a`` table ``(layers, slots, in,
parts*max_rank)`` and a ``b`` table ``(layers, slots, parts*max_rank, out)``, block-diagonal
over the fused parts; an adapter's smaller rank and missing projections are zeros. Writing a slot
is one jitted update whose slot index is traced, so loading or swapping an adapter compiles
nothing after the first write.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers.lora import FUSED_PROJECTIONS, LoRABatch
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora_adapter import LoRAAdapter, projection_shape


def fused_shapes(cfg: ModelConfig, max_rank: int) -> dict[str, tuple[int, int, int]]:
    """``(in, parts*max_rank, out)`` of each fused projection's slot."""
    out = {}
    for name, parts in FUSED_PROJECTIONS.items():
        d_in = projection_shape(cfg, parts[0])[0]
        d_out = sum(projection_shape(cfg, p)[1] for p in parts)
        out[name] = (d_in, len(parts) * max_rank, d_out)
    return out


def adapter_slot_arrays(adapter: LoRAAdapter, cfg: ModelConfig, max_rank: int
                        ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One slot's ``a``/``b`` arrays per fused projection, ``(layers, in, R)`` and ``(layers, R, out)``."""
    a_out, b_out = {}, {}
    for name, (d_in, width, d_out) in fused_shapes(cfg, max_rank).items():
        a = np.zeros((cfg.num_hidden_layers, d_in, width), np.float32)
        b = np.zeros((cfg.num_hidden_layers, width, d_out), np.float32)
        col = 0
        for i, proj in enumerate(FUSED_PROJECTIONS[name]):
            width_out = projection_shape(cfg, proj)[1]
            for layer in range(cfg.num_hidden_layers):
                w = adapter.weights.get((layer, proj))
                if w is not None:
                    r0 = i * max_rank
                    a[layer, :, r0:r0 + w.rank] = w.a.T
                    b[layer, r0:r0 + w.rank, col:col + width_out] = w.b.T
            col += width_out
        a_out[name], b_out[name] = a, b
    return a_out, b_out


@jax.jit
def _write_slot(tables: dict[str, jax.Array], slot: jax.Array, values: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {k: jax.lax.dynamic_update_index_in_dim(t, values[k].astype(t.dtype), slot, axis=1)
            for k, t in tables.items()}


class LoRASlotTable:
    """The ``max_loras`` device slots; :meth:`write` puts an adapter in a slot, :meth:`batch`
    gives the step's :class:`LoRABatch` for the tokens' slot indices."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: str | None = None):
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        dt = jnp.dtype(dtype or cfg.dtype)
        layers = cfg.num_hidden_layers
        shapes = fused_shapes(cfg, max_rank)
        self.a = {k: jnp.zeros((layers, max_loras, d_in, w), dt) for k, (d_in, w, _) in shapes.items()}
        self.b = {k: jnp.zeros((layers, max_loras, w, d_out), dt) for k, (_, w, d_out) in shapes.items()}

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"LoRA slot {slot} outside 0..{self.max_loras - 1}")
        a, b = adapter_slot_arrays(adapter, self.cfg, self.max_rank)
        self.a = _write_slot(self.a, jnp.int32(slot), a)
        self.b = _write_slot(self.b, jnp.int32(slot), b)

    def batch(self, slot_ids: jax.Array) -> LoRABatch:
        return LoRABatch(slot_ids=slot_ids, a=self.a, b=self.b)
