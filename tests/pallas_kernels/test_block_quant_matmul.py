"""The GGUF block-format matmul (``pallas_kernels/block_quant_matmul.py``): the blocks split out of
a file's raw rows dequantize exactly as the ``gguf`` package does, and the C++ kernel computes
what the jnp reference computes, for every format, ragged row and token counts included."""

from __future__ import annotations

import os
import shutil

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_quant_matmul import (
    BLOCK_FORMATS,
    block_quant_kernel_available,
    block_quant_matmul_cpu,
    block_quant_matmul_reference,
    dequantize_blocks,
    int8_dots_available,
    split_gguf_blocks,
)


def blocks(qtype: str, n: int, k: int, seed: int = 0):
    """A random ``[n, k]`` weight quantized by the gguf package: its raw rows and its floats."""
    w = np.random.default_rng(seed).standard_normal((n, k), np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return raw, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])


def parts(raw: np.ndarray, qtype: str) -> tuple:
    """``(qs, d, m)`` of the split blocks, ``m`` None for a format without minimums."""
    split = split_gguf_blocks(raw, qtype)
    return split["qs"], split["d"], split.get("m")


def device(*arrays) -> tuple:
    return tuple(None if a is None else jnp.asarray(a) for a in arrays)


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_split_blocks_dequantize_as_the_gguf_package_does(qtype):
    raw, expected = blocks(qtype, 7, 96)
    qs, d, m = parts(raw, qtype)
    bits, offset, has_min = BLOCK_FORMATS[qtype]
    assert qs.shape == (7, 96 * bits // 8) and d.shape == (7, 3) and d.dtype == np.float16
    assert (m is not None) == has_min and (m is None or (m.shape == (7, 3) and m.dtype == np.float16))
    # the kept bytes per 32 weights are the file's: a block as stored, nothing added
    assert (qs.nbytes + d.nbytes + (0 if m is None else m.nbytes)) == raw.nbytes
    got = dequantize_blocks(*device(qs, d, m), bits=bits, offset=offset)
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_cpu_kernel_matches_the_reference(qtype, tokens):
    assert block_quant_kernel_available() == (True, "")
    raw, w = blocks(qtype, 70, 160, seed=tokens)  # 70 rows: not a multiple of the kernel's tiles
    bits, offset, _ = BLOCK_FORMATS[qtype]
    args = (jnp.asarray(np.random.default_rng(1).standard_normal((tokens, 160), np.float32)),
            *device(*parts(raw, qtype)))
    ref = block_quant_matmul_reference(*args, bits=bits, offset=offset)
    got = block_quant_matmul_cpu(*args, bits=bits, offset=offset)
    assert got.shape == (tokens, 70)
    np.testing.assert_allclose(np.asarray(got), np.asarray(args[0]) @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_gpu_kernel_in_the_interpreter_matches_the_reference(qtype):
    """The Pallas kernel for a GPU (each block's scale on its partial product), run by Pallas's
    interpreter: 5 tokens pad to one 16-row tile, 96 outputs make three 32-wide column tiles."""
    from pallas_kernels.block_quant_matmul_triton import block_quant_matmul_triton

    raw, _ = blocks(qtype, 96, 128, seed=3)
    bits, offset, _ = BLOCK_FORMATS[qtype]
    args = (jnp.asarray(np.random.default_rng(2).standard_normal((5, 128), np.float32)),
            *device(*parts(raw, qtype)))
    expected = block_quant_matmul_reference(*args, bits=bits, offset=offset)
    got = block_quant_matmul_triton(*args, bits=bits, offset=offset, interpret=True)
    assert got.shape == (5, 96)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_cpu_kernel_reads_one_layer_of_a_stack_in_place(qtype):
    """A scanned model hands the kernel the whole stack and the layer index (traced, as in a
    scan): each layer's product is that layer's weight's, and an index outside the stack fails."""
    import jax

    bits, offset, _ = BLOCK_FORMATS[qtype]
    layers = [parts(blocks(qtype, 40, 96, seed=s)[0], qtype) for s in range(3)]
    qs, d, m = (None if p[0] is None else jnp.asarray(np.stack(p)) for p in zip(*layers, strict=True))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 96), np.float32))
    product = jax.jit(lambda layer: block_quant_matmul_cpu(x, qs, d, m, bits=bits, offset=offset, layer=layer))
    for i, (q, dd, mm) in enumerate(layers):
        expected = block_quant_matmul_reference(x, *device(q, dd, mm), bits=bits, offset=offset)
        np.testing.assert_allclose(np.asarray(product(jnp.int32(i))), np.asarray(expected), rtol=1e-5, atol=1e-5)
        stacked_ref = block_quant_matmul_reference(x, qs, d, m, bits=bits, offset=offset, layer=i)
        np.testing.assert_allclose(np.asarray(stacked_ref), np.asarray(expected), rtol=1e-6, atol=1e-6)
    with pytest.raises(Exception, match="layer index outside the stack"):
        np.asarray(product(jnp.int32(3)))


def int8_emulation(x: np.ndarray, qs: np.ndarray, d: np.ndarray, m: np.ndarray | None, bits: int,
                   offset: int) -> np.ndarray:
    """llama.cpp's int8-activation product in numpy: each token's blocks of 32 rounded to int8 at
    the block's absolute maximum / 127, multiplied exactly by the weights' integer values."""
    t, k = x.shape
    blocks = x.reshape(t, k // 32, 32).astype(np.float64)
    amax = np.abs(blocks).max(-1, keepdims=True)
    dx = amax / 127
    xq = np.rint(blocks * np.where(amax > 0, 127 / np.where(amax > 0, amax, 1), 0))
    if bits == 8:
        q = qs.view(np.int8).astype(np.float64).reshape(qs.shape[0], -1, 32)
    else:
        packed = qs.reshape(qs.shape[0], -1, 16)
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float64)
    dots = np.einsum("tbj,nbj->tnb", xq, q - offset)  # exact integers
    d = d.astype(np.float64)
    m = np.zeros_like(d) if m is None else m.astype(np.float64)
    return (np.einsum("tnb,tb,nb->tn", dots, dx[..., 0], d) + np.einsum("tb,nb->tn", (dx[..., 0] * xq.sum(-1)), m))


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None or not int8_dots_available(),
                    reason="no C++ compiler, or no AVX-512 VNNI")
@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("k", [160, 608, 1056])
def test_int8_activations_are_llama_cpps_product(qtype, tokens, k):
    """The int8 path computes exactly the int8-activation product (a wrong block scale, nibble order
    or Q8_0's sign would be off by far more than float rounding), and stays within the int8
    rounding of the float product. Every count of inputs is an odd count of blocks (the last pair
    has one); rows of 160 inputs are read four side by side, 608 four (Q4, 304 bytes) or, for 5
    tokens, two (Q8_0, 608 bytes), 1056 two (Q4, 528 bytes, 5 tokens) or one at a time."""
    raw, w = blocks(qtype, 70, k, seed=tokens + 7)
    bits, offset, _ = BLOCK_FORMATS[qtype]
    x = np.random.default_rng(5).standard_normal((tokens, k)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: scale 0
    qs, d, m = parts(raw, qtype)
    got = np.asarray(block_quant_matmul_cpu(jnp.asarray(x), *device(qs, d, m), bits=bits, offset=offset,
                                            int8_activations=True))
    scale = np.abs(x @ w.T).max()
    np.testing.assert_allclose(got, int8_emulation(x, qs, d, m, bits, offset), rtol=0, atol=1e-5 * scale)
    error = np.abs(got - x @ w.T).max() / scale
    assert 1e-5 < error < 0.02  # rounded to int8 (not the float path), by at most a few hundredths


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None or not int8_dots_available(),
                    reason="no C++ compiler, or no AVX-512 VNNI")
@pytest.mark.parametrize("k", [160, 608, 1056])
def test_int8_path_uses_each_rows_own_block_scales(k):
    """Q8_0 rows read four, two (3 tokens, 608 inputs) or one side by side: one block scale of one
    row changed moves that row's outputs alone, by the product the emulation predicts; the unchanged scales' emulation
    misses it (the comparison above can fail on a wrong scale)."""
    raw, _ = blocks("Q8_0", 37, k, seed=11)  # 37 rows: a short last tile of each width
    qs, d, m = parts(raw, "Q8_0")
    x = np.random.default_rng(6).standard_normal((3, k)).astype(np.float32)
    wrong = d.copy()
    row, block = 33, k // 32 - 1  # in the short tile, the odd count's lone last block
    wrong[row, block] = np.float16(-3 * float(d[row, block]))
    got = np.asarray(block_quant_matmul_cpu(jnp.asarray(x), *device(qs, wrong, None), bits=8, offset=0,
                                            int8_activations=True))
    want, before = int8_emulation(x, qs, wrong, None, 8, 0), int8_emulation(x, qs, d, None, 8, 0)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    moved = np.abs(got - before).max(axis=0) > 1e-3 * scale
    assert moved.tolist() == [n == row for n in range(37)]
