"""All per-step host arrays travel in ONE host-to-device transfer.

The runner builds small numpy arrays in named groups (model inputs; sampling parameters). Each
would be its own transfer, and on a GPU the fixed cost per copy dominates such small arrays.
``pack`` lays them end to end in one int32 buffer (float32 and uint32 bit-cast, bool widened);
inside the compiled step ``unpack`` slices them back out at static offsets, which XLA folds away,
into the same groups. ``decode`` does the same on the host, to look at a step's inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

Groups = Mapping[str, Mapping[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Field:
    group: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    size: int  # elements; stored, since pack runs every step


@dataclasses.dataclass(frozen=True)
class PackLayout:
    fields: tuple[Field, ...]
    total: int

    @classmethod
    def of(cls, groups: Groups) -> PackLayout:
        fields, offset = [], 0
        for group, arrays in groups.items():
            for name, arr in arrays.items():
                f = Field(group, name, tuple(arr.shape), np.dtype(arr.dtype).name, offset, int(arr.size))
                fields.append(f)
                offset += f.size
        return cls(tuple(fields), offset)


_WORD_DTYPES = (np.dtype(np.bool_), np.dtype(np.float32), np.dtype(np.uint32), np.dtype(np.int32))


def pack(groups: Groups, layout: PackLayout) -> np.ndarray:
    buf = np.empty(layout.total, np.int32)
    for f in layout.fields:
        arr = groups[f.group][f.name]
        if arr.shape != f.shape:
            raise ValueError(f"{f.group}.{f.name}: shape {arr.shape} does not match the layout's {f.shape}")
        if arr.dtype not in _WORD_DTYPES:
            raise TypeError(f"{f.group}.{f.name}: cannot pack dtype {arr.dtype}")
        dst = buf[f.offset : f.offset + f.size].reshape(f.shape)
        if arr.dtype == np.bool_:
            dst[...] = arr  # widened to 0/1
        else:
            dst.view(arr.dtype)[...] = arr  # bit-cast: float32/uint32 words travel as int32
    return buf


def unpack(buf: jax.Array, layout: PackLayout) -> dict[str, dict[str, jax.Array]]:
    out: dict[str, dict[str, jax.Array]] = {}
    for f in layout.fields:
        words = buf[f.offset : f.offset + f.size].reshape(f.shape)
        if f.dtype == "bool":
            value = words != 0
        elif f.dtype == "int32":
            value = words
        else:
            value = jax.lax.bitcast_convert_type(words, jnp.dtype(f.dtype))
        out.setdefault(f.group, {})[f.name] = value
    return out


def decode(buf: np.ndarray, layout: PackLayout) -> dict[str, dict[str, np.ndarray]]:
    """``unpack`` on the host: the groups of a packed numpy buffer, as copies in their dtypes."""
    if buf.shape != (layout.total,):
        raise ValueError(f"buffer of shape {buf.shape} does not match the layout's {layout.total} words")
    out: dict[str, dict[str, np.ndarray]] = {}
    for f in layout.fields:
        words = buf[f.offset : f.offset + f.size].reshape(f.shape)
        value = words != 0 if f.dtype == "bool" else words.view(np.dtype(f.dtype)).copy()
        out.setdefault(f.group, {})[f.name] = value
    return out
