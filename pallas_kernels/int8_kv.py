"""Int8 K/V pages (``--kv-cache-dtype int8``, the CPU backends): one scale per position and KV head.

Layout: an int8 pool is ``[num_blocks, block_size, Hkv, D + SCALE_BYTES]``. Each (position, head)
row holds its ``D`` values rounded to ``round(x / scale)`` in [-127, 127], then its float32
``scale = max|x| / 127`` bitcast into the last four bytes (native byte order, which the C++
kernel reads back with a plain copy). The scale travels inside the row, so a block carries
everything needed to read it: prefix-cache sharing, preemption and the head-axis split under
tensor parallelism see an ordinary pool of one more array shape, and no new array joins the
step's pytree.

Why per position: a static per-head scale needs calibration data jaxserve does not have, and one
outlier token's key would set the step for every other token of that head. Invariant: dequantized
values differ from the written ones by at most ``scale / 2`` per element; an all-zero row has
scale 0 and reads back as zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCALE_BYTES = 4  # one float32 per (position, KV head)
INT8 = jnp.dtype(jnp.int8)
_QMAX = 127.0


def is_int8(dtype) -> bool:
    return jnp.dtype(dtype) == INT8


def stored_head_dim(head_dim: int, dtype) -> int:
    """The pool's last axis for a model of ``head_dim`` stored in ``dtype``."""
    return head_dim + SCALE_BYTES if is_int8(dtype) else head_dim


def quantize_rows(x: jax.Array) -> jax.Array:
    """``x [..., D]`` (any float) -> int8 ``[..., D + SCALE_BYTES]``: values, then their scale."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / _QMAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(xf / safe[..., None]), -_QMAX, _QMAX).astype(INT8)
    return jnp.concatenate([q, jax.lax.bitcast_convert_type(scale, INT8)], axis=-1)


def dequantize_rows(rows: jax.Array) -> jax.Array:
    """int8 ``[..., D + SCALE_BYTES]`` -> float32 ``[..., D]``."""
    scale = jax.lax.bitcast_convert_type(rows[..., -SCALE_BYTES:], jnp.float32)
    return rows[..., :-SCALE_BYTES].astype(jnp.float32) * scale[..., None]


def pages_f32(pages: jax.Array) -> jax.Array:
    """Gathered pages ``[..., Hkv, stored D]`` as float32 ``[..., Hkv, D]``, whatever the pool."""
    return dequantize_rows(pages) if is_int8(pages.dtype) else pages.astype(jnp.float32)
