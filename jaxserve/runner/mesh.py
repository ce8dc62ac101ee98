"""The tensor-parallel mesh and the sharding plan: where every array of a step lives.

One mesh axis, :data:`TP_AXIS`, over the devices of one model replica. The plan, in one place:

- weights: the axis of :data:`jaxserve.models.tp_layout.SPLIT_AXES` (q|k|v and gate|up by output
  columns, o and down by input rows, embedding and LM head by vocabulary), everything else
  replicated;
- KV cache ``[L, blocks, block_size, Hkv, D]``: split on the key/value heads;
- a draft model: as the target when its heads divide the mesh (its own pool split the same way),
  else replicated; an EAGLE head (:data:`jaxserve.models.tp_layout.EAGLE_SPLIT_AXES`) split as
  one target layer, its one-layer pool ``[blocks, block_size, Hkv, D]`` on the key/value heads
  like the target's, when its heads divide the mesh, else both replicated;
- LoRA slot tables (:func:`lora_table_specs`): as their base weights, ``b`` split on its output
  columns under a column-split base (q|k|v, gate|up, the LM head's vocabulary; ``a`` replicated),
  ``a`` split on its input rows under a row-split one (o, down, the embedding's vocabulary; ``b``
  replicated);
- everything else (penalty tables, last sampled tokens, the packed step inputs, the bitmask):
  replicated; the host packs one buffer and every device receives it whole.

With one device the mesh still exists, so a runner given a device puts everything on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.models.tp_layout import EAGLE_SPLIT_AXES, split_axis

TP_AXIS = "tp"

REPLICATED = PartitionSpec()
KV_CACHE_SPEC = PartitionSpec(None, None, None, TP_AXIS, None)
HEAD_POOL_SPEC = PartitionSpec(None, None, TP_AXIS, None)  # one layer's pool: the layer axis dropped


def select_devices(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """``devices``, or by default the first ``tensor_parallel_size`` of ``jax.devices()``; a
    ValueError naming both counts when there are too few."""
    if devices is not None:
        return list(devices)
    present = jax.devices()
    if tensor_parallel_size > len(present):
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} exceeds the {len(present)} "
                         f"{present[0].platform} devices present")
    return present[:tensor_parallel_size]


def make_mesh(devices: Sequence[jax.Device], tensor_parallel_size: int) -> Mesh:
    """A one-axis mesh (:data:`TP_AXIS`) over exactly ``devices``, in their order."""
    if len(devices) != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs as many devices, got {len(devices)}")
    return Mesh(np.asarray(list(devices), dtype=object), (TP_AXIS,))


def param_spec(path: tuple, ndim: int) -> PartitionSpec:
    """The spec of the weight at module path ``path`` with ``ndim`` axes (a scanned stack's
    leading layer axis included)."""
    axis = split_axis(path)
    if axis is None:
        return REPLICATED
    axis += ndim - _own_ndim(path, ndim)
    return PartitionSpec(*(TP_AXIS if i == axis else None for i in range(ndim)))


def _own_ndim(path: tuple, ndim: int) -> int:
    """Axes of the parameter itself: a scanned stack (``layers.stacked``) has one more."""
    return ndim - 1 if "stacked" in path else ndim


def param_sharding(mesh: Mesh, path: tuple, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, param_spec(path, ndim))


# Each LoRA table pair, a (layers, in, slots, R) and b (layers, slots, R, out): the one split as
# its base weight is, and on which axis (the other is replicated). The LM head's b and the
# embedding's a are split on the (padded) vocabulary, as the base head and embedding are.
LORA_SPLIT = {"qkv": ("b", 3), "gate_up": ("b", 3), "o": ("a", 1), "down": ("a", 1), "lm_head": ("b", 3),
              "embed": ("a", 1)}


def lora_table_specs(names) -> tuple[dict[str, PartitionSpec], dict[str, PartitionSpec]]:
    """The specs of the LoRA ``a`` and ``b`` tables ``names`` (the fused projections, the LM
    head's, the embedding's). The delta then needs no collective of its own beyond one all-reduce
    of ``x @ a`` (``T x slots*R``) at o and down, where the base's own all-reduce follows, and one
    of the embedding's looked-up ``a`` rows (as large), beside the base embedding's."""
    specs: tuple[dict[str, PartitionSpec], dict[str, PartitionSpec]] = ({}, {})
    for name in names:
        which, axis = LORA_SPLIT[name]
        for table, spec in zip("ab", specs):
            spec[name] = (PartitionSpec(*(TP_AXIS if i == axis else None for i in range(4)))
                          if table == which else REPLICATED)
    return specs


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, REPLICATED)


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_CACHE_SPEC)


def eagle_head_shardings(mesh: Mesh, weights: dict[str, Any], split: bool) -> tuple[dict[str, NamedSharding],
                                                                                   NamedSharding]:
    """The shardings of an EAGLE head's weights (by flat name) and of each of its two pools:
    ``split``, the layer's projections as a target layer's and the pools on their key/value
    heads; otherwise all replicated."""
    def spec(name: str, ndim: int) -> PartitionSpec:
        axis = EAGLE_SPLIT_AXES.get(name.removeprefix("layers.0.")) if split else None
        return REPLICATED if axis is None else PartitionSpec(*(TP_AXIS if i == axis else None for i in range(ndim)))

    pool = NamedSharding(mesh, HEAD_POOL_SPEC if split else REPLICATED)
    return {name: NamedSharding(mesh, spec(name, len(w.shape))) for name, w in weights.items()}, pool


def weight_shardings(mesh: Mesh, flat_state: Sequence[tuple[tuple, Any]]) -> list[NamedSharding]:
    """The sharding of each ``(path, array)`` of a flattened model state, in order."""
    return [param_sharding(mesh, path, len(x.shape)) for path, x in flat_state]


def bytes_per_device(arrays: Any) -> dict[jax.Device, int]:
    """Bytes each device holds of ``arrays`` (a pytree of jax arrays), read from their shards."""
    held: dict[jax.Device, int] = {}
    for x in jax.tree.leaves(arrays):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.size * shard.data.dtype.itemsize
    return held
