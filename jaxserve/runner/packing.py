"""All per-step host arrays travel in ONE host-to-device transfer.

The runner builds its step inputs as a registered pytree of small numpy arrays
(:class:`.step_inputs.StepArrays`). Each leaf would be its own transfer, and on a GPU the fixed
cost per copy dominates such small arrays. ``pack`` lays the leaves end to end, in the pytree's
field order, in one int32 buffer (float32 and uint32 bit-cast, bool widened); inside the compiled
step ``unpack`` slices them back out at static offsets, which XLA folds away, and rebuilds the
same typed dataclasses. Each leaf starts on a 256-byte boundary: XLA:GPU hands a slice of a
parameter to a custom call as an address inside it, and a Mosaic GPU kernel refuses an operand
that is not 256-byte aligned (an H200 refused the mosaic step for its block tables). ``decode``
does the same on the host, to look at a step's inputs. The layout follows the pytree's fields: a
field added to a dataclass is packed with no change here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Leaves start at multiples of this many int32 words (256 bytes; see the module docstring).
ALIGN_WORDS = 64


@dataclasses.dataclass(frozen=True)
class Field:
    name: str  # the leaf's path in the pytree: "model.positions"
    shape: tuple[int, ...]
    dtype: str
    offset: int
    size: int  # elements; stored, since pack runs every step


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Where each leaf of a pytree lies in the buffer. Hashable: it is the compiled step's static
    argument, so a pytree of other fields or shapes is another program."""

    fields: tuple[Field, ...]
    total: int
    treedef: Any  # the pytree's structure: unpack and decode rebuild the same dataclasses

    @classmethod
    def of(cls, tree: Any) -> PackLayout:
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        fields, offset = [], 0
        for path, arr in with_paths:
            arr = np.asarray(arr)
            name = jax.tree_util.keystr(path, simple=True, separator=".")
            f = Field(name, tuple(arr.shape), np.dtype(arr.dtype).name, offset, int(arr.size))
            fields.append(f)
            offset = _aligned(offset + f.size)
        return cls(tuple(fields), offset, treedef)


def _aligned(words: int) -> int:
    return -(-words // ALIGN_WORDS) * ALIGN_WORDS


_WORD_DTYPES = (np.dtype(np.bool_), np.dtype(np.float32), np.dtype(np.uint32), np.dtype(np.int32))


def pack(tree: Any, layout: PackLayout) -> np.ndarray:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef != layout.treedef:
        raise ValueError(f"inputs of structure {treedef} do not match the layout's {layout.treedef}")
    buf = np.zeros(layout.total, np.int32)  # the gaps between leaves are zeros
    for f, arr in zip(layout.fields, leaves):
        if arr.shape != f.shape:
            raise ValueError(f"{f.name}: shape {arr.shape} does not match the layout's {f.shape}")
        if arr.dtype not in _WORD_DTYPES:
            raise TypeError(f"{f.name}: cannot pack dtype {arr.dtype}")
        dst = buf[f.offset : f.offset + f.size].reshape(f.shape)
        if arr.dtype == np.bool_:
            dst[...] = arr  # widened to 0/1
        else:
            dst.view(arr.dtype)[...] = arr  # bit-cast: float32/uint32 words travel as int32
    return buf


def unpack(buf: jax.Array, layout: PackLayout) -> Any:
    """The pytree ``pack`` was given, its leaves sliced out of ``buf`` (traced: static slices)."""
    values = []
    for f in layout.fields:
        words = buf[f.offset : f.offset + f.size].reshape(f.shape)
        if f.dtype == "bool":
            values.append(words != 0)
        elif f.dtype == "int32":
            values.append(words)
        else:
            values.append(jax.lax.bitcast_convert_type(words, jnp.dtype(f.dtype)))
    return jax.tree_util.tree_unflatten(layout.treedef, values)


def decode(buf: np.ndarray, layout: PackLayout) -> Any:
    """``unpack`` on the host: the pytree of a packed numpy buffer, as copies in their dtypes."""
    if buf.shape != (layout.total,):
        raise ValueError(f"buffer of shape {buf.shape} does not match the layout's {layout.total} words")
    values = []
    for f in layout.fields:
        words = buf[f.offset : f.offset + f.size].reshape(f.shape)
        values.append(words != 0 if f.dtype == "bool" else words.view(np.dtype(f.dtype)).copy())
    return jax.tree_util.tree_unflatten(layout.treedef, values)
