"""``x @ W.T`` for a weight kept in GGUF's 32-wide quant blocks (Q8_0, Q4_0, Q4_1), beside its jnp
reference.

A weight ``W [N, K]`` is stored one row per output feature, blocks along the input, as in a
``.gguf`` file: ``qs [N, K * bits / 8]`` uint8 (int8 values for 8 bits; for 4 bits byte ``j`` of
a block holds element ``j`` in its low nibble and ``j + 16`` in its high one), block scales
``d [N, K / 32]`` and, for a format that has them (Q4_1), block minimums ``m [N, K / 32]``, with
``W[n, k] = d[n, k // 32] * (q[n, k] - offset) + m[n, k // 32]`` (``offset`` 8 for Q4_0; ``m`` is
None, not zeros, for Q8_0 and Q4_0). ``d`` and ``m`` stay float16, the file's own scales: a block
is then the file's bytes (18 per 32 weights for Q4_0, 20 for Q4_1, 34 for Q8_0), and every
consumer widens them to float32 (exact) as it reads them.

- :func:`block_quant_matmul_reference`: the weight dequantized, then a plain matmul (any backend;
  XLA writes the dequantized weight whole before the dot).
- :func:`.block_quant_matmul_triton.block_quant_matmul_triton`: a Pallas kernel for a GPU that
  applies each block's scale to its partial product.
- :func:`block_quant_matmul_cpu`: ``csrc/block_quant_matmul_cpu.cc`` through XLA's FFI, which
  reads the blocks as stored (XLA:CPU would write the whole float weight first).

Each also takes a stack of weights (``qs [L, N, ...]``, ``d`` and ``m`` ``[L, N, K / 32]``) and a
``layer`` index: a scanned model's layer multiplies by its own weight of the stack, which the C++
kernel reads in place (slicing it out first is a copy of the blocks every layer, every step).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .cpu_ffi import CpuFfiKernel

BLOCK = 32
# GGUF block format -> (bits, offset, has a minimum)
BLOCK_FORMATS = {"Q8_0": (8, 0, False), "Q4_0": (4, 8, False), "Q4_1": (4, 0, True)}
KERNEL = CpuFfiKernel("block_quant_matmul_cpu.cc", "jaxserve_block_quant_matmul_cpu", "JaxserveBlockQuantMatmulCpu")


def dequantize_blocks(qs: jax.Array, d: jax.Array, m: jax.Array | None, *, bits: int, offset: int) -> jax.Array:
    """``W [N, K]`` in float32 from its blocks (``d``/``m`` of any float dtype; ``m`` None: no minimum)."""
    n, nb = d.shape
    if bits == 8:
        q = jax.lax.bitcast_convert_type(qs, jnp.int8).astype(jnp.float32).reshape(n, nb, BLOCK)
    else:
        packed = qs.reshape(n, nb, BLOCK // 2)
        q = jnp.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(jnp.float32)
    w = d.astype(jnp.float32)[..., None] * (q - offset)
    if m is not None:
        w = w + m.astype(jnp.float32)[..., None]
    return w.reshape(n, nb * BLOCK)


def layer_of(qs: jax.Array, d: jax.Array, m: jax.Array | None,
             layer: jax.Array | int | None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Weight ``layer`` of a stack (``qs [L, N, ...]``); a lone weight (``layer`` None) as it is."""
    if layer is None:
        return qs, d, m
    def pick(a: jax.Array) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)

    return pick(qs), pick(d), None if m is None else pick(m)


def block_quant_matmul_reference(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array | None, *, bits: int,
                                 offset: int, layer: jax.Array | int | None = None) -> jax.Array:
    """The oracle: ``x [..., K] @ W.T`` with ``W`` (weight ``layer`` of a stack) dequantized in
    float32; float32 out."""
    qs, d, m = layer_of(qs, d, m, layer)
    w = dequantize_blocks(qs, d, m, bits=bits, offset=offset)
    return jax.lax.dot_general(x.astype(jnp.float32), w, (((x.ndim - 1,), (1,)), ((), ())))


def block_quant_matmul_cpu(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array | None, *, bits: int,
                           offset: int, layer: jax.Array | int | None = None,
                           int8_activations: bool = False) -> jax.Array:
    """The same product by the C++ kernel (float32 out), reading weight ``layer`` of a stack in
    place; the kernel must be registered. ``int8_activations``: llama.cpp's path, each token's
    activations quantized per block of 32 to int8 and multiplied by VNNI's int8 dots, where the
    CPU has them (:func:`int8_dots_available`; without them the float path runs)."""
    KERNEL.register()
    if layer is None:  # a stack of one: a reshape, no copy
        qs, d, layer = qs[None], d[None], 0
        m = None if m is None else m[None]
    if qs.ndim != 3:
        raise ValueError(f"block_quant_matmul_cpu: a layer index needs a stack qs [L, N, bytes], got {qs.shape}")
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    n = qs.shape[1]
    call = jax.ffi.ffi_call(KERNEL.target, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))
    scales = (d,) if m is None else (d, m)  # m: a trailing argument only where the format has one
    for name, s in zip("dm", scales):
        if s.dtype != jnp.float16:
            raise TypeError(f"block_quant_matmul_cpu: {name} must be float16 (the file's scales), got {s.dtype}")
    y = call(rows, qs, jnp.asarray(layer, jnp.int32), *scales,
             bits=np.int32(bits), offset=np.int32(offset), int8_activations=np.int32(int8_activations))
    return y.reshape(*x.shape[:-1], n)


def int8_dots_available() -> bool:
    """True when this CPU has AVX-512 VNNI (and BW), which the kernel, built for the machine it
    runs on, then uses for ``int8_activations``."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_vnni" in flags and "avx512bw" in flags


def block_quant_kernel_available(build_dir: Path | None = None) -> tuple[bool, str]:
    """(True, "") when the CPU kernel is built and registered, else (False, the reason)."""
    return KERNEL.available(build_dir)


def split_gguf_blocks(raw: np.ndarray, qtype: str) -> dict[str, np.ndarray]:
    """A GGUF tensor's raw rows (``[N, bytes per row]`` uint8, as the file stores them) into
    ``{"qs", "d"}`` and, for a format with minimums, ``"m"``; the scales stay the file's float16."""
    bits, _, has_min = BLOCK_FORMATS[qtype]
    header = 4 if has_min else 2  # f16 d, then f16 m for Q4_1
    per_block = header + BLOCK * bits // 8
    rows = np.ascontiguousarray(raw).view(np.uint8)
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, per_block)
    parts = {"qs": np.ascontiguousarray(blocks[..., header:]).reshape(n, -1),
             "d": blocks[..., 0:2].copy().view(np.float16)[..., 0]}
    if has_min:
        parts["m"] = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    return parts
