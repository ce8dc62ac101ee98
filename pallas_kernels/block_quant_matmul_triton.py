"""``x @ W.T`` for a weight kept in GGUF's 32-wide blocks, as a Pallas kernel (Triton lowering)
for a GPU; its jnp reference is :func:`.block_quant_matmul.block_quant_matmul_reference` (the
layout is described there).

XLA does not fuse a per-block scale into a dot's operand: written as jnp, the weight is
dequantized into a buffer of its full size first (``scripts/gpu_aot_check.py --quantization gguf``
finds it). Here each program owns a ``[rows, cols]`` tile of the output and walks the input one
32-wide block at a time, with the block's scale applied to the block's partial product instead of
to the weight:

    y[t, n] = sum_b d[n, b] * (x[t, b] . q[n, b]) + (m[n, b] - offset * d[n, b]) * sum(x[t, b])

so the only weight bytes read are the stored ones (1 byte a weight for Q8_0, half for Q4), and
the only product is a ``[rows, 32] x [32, cols]`` dot per block (two ``16``-wide ones for 4 bits:
the low nibbles hold a block's first 16 values, the high ones its last 16). ``interpret=True``
runs it in Pallas's interpreter on a CPU (the tests). The scales are read as stored (float16, and
no ``m`` for a format without minimums) and widened in the kernel, so a block costs the file's bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .block_quant_matmul import BLOCK

HALF = BLOCK // 2


def _kernel(x_ref, qs_ref, d_ref, *rest, bits: int, offset: int, rows: int, cols: int, blocks: int):
    """One ``[rows, cols]`` output tile; ``rest`` is ``(m_ref, o_ref)`` for a format with minimums,
    else ``(o_ref,)``. The per-block constant is ``m - offset * d``."""
    m_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    t0 = pl.program_id(0) * rows
    n0 = pl.program_id(1) * cols
    t_idx, n_idx = pl.ds(t0, rows), pl.ds(n0, cols)

    def dot(x, q):  # [rows, w] . [cols, w] -> [rows, cols], float32
        return lax.dot_general(x, q.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def total(x):
        return jnp.sum(x.astype(jnp.float32), axis=1)

    def block(b, acc):
        if bits == 8:
            x = x_ref[t_idx, pl.ds(b * BLOCK, BLOCK)]
            q = qs_ref[n_idx, pl.ds(b * BLOCK, BLOCK)].astype(jnp.int32)
            part, x_sum = dot(x, jnp.where(q >= 128, q - 256, q)), total(x)  # the stored bytes are int8
        else:
            x_lo = x_ref[t_idx, pl.ds(b * BLOCK, HALF)]
            x_hi = x_ref[t_idx, pl.ds(b * BLOCK + HALF, HALF)]
            packed = qs_ref[n_idx, pl.ds(b * HALF, HALF)].astype(jnp.int32)
            part = dot(x_lo, packed & 0x0F) + dot(x_hi, packed >> 4)
            x_sum = total(x_lo) + total(x_hi)
        d = d_ref[n_idx, pl.ds(b, 1)][:, 0].astype(jnp.float32)
        c = -offset * d
        if m_ref is not None:
            c = m_ref[n_idx, pl.ds(b, 1)][:, 0].astype(jnp.float32) + c
        return acc + part * d[None, :] + x_sum[:, None] * c[None, :]

    acc = lax.fori_loop(0, blocks, block, jnp.zeros((rows, cols), jnp.float32))
    o_ref[t_idx, n_idx] = acc


def _pow2_at_least(n: int, low: int, high: int) -> int:
    p = low
    while p < n and p < high:
        p *= 2
    return p


@functools.partial(jax.jit, static_argnames=("bits", "offset", "interpret", "rows", "cols", "num_warps"))
def block_quant_matmul_triton(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array | None, *, bits: int, offset: int,
                              interpret: bool = False, rows: int | None = None, cols: int | None = None,
                              num_warps: int = 4) -> jax.Array:
    """``x [..., K] @ W.T`` with ``W [N, K]`` in blocks (``qs``, ``d``, ``m`` or None); float32 out.
    ``rows`` (default: the rows rounded up to a power of two, 16 to 64) and ``cols`` (default: 64,
    32 or 16, the largest that divides ``N``) tile the output; the rows are padded to a whole tile."""
    n, blocks = d.shape
    lead, k = x.shape[:-1], x.shape[-1]
    if k != blocks * BLOCK or qs.shape != (n, k * bits // 8):
        raise ValueError(f"block_quant_matmul_triton: x [..., {k}], qs {qs.shape}, d {d.shape} do not agree")
    cols = cols or next((c for c in (64, 32, 16) if n % c == 0), 16)
    if n % cols:
        raise ValueError(f"block_quant_matmul_triton: cols {cols} must divide the {n} output features")
    flat = x.reshape(-1, k)
    t = flat.shape[0]
    rows = rows or _pow2_at_least(t, 16, 64)
    padded = -(-t // rows) * rows
    if padded != t:
        flat = jnp.pad(flat, ((0, padded - t), (0, 0)))
    scales = (d,) if m is None else (d, m)
    out = pl.pallas_call(
        functools.partial(_kernel, bits=bits, offset=offset, rows=rows, cols=cols, blocks=blocks),
        out_shape=jax.ShapeDtypeStruct((padded, n), jnp.float32),
        grid=(padded // rows, n // cols),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name=f"block_quant_matmul_q{bits}",
    )(flat, qs, *scales)
    return out[:t].reshape(*lead, n)
