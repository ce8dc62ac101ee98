"""The small-row dense kernel (``pallas_kernels/dense_matmul.py``): it computes what numpy computes
for ragged shapes, every weight dtype, both layouts and a stack's layer; a row's result is bitwise
the same whatever the row count; bad input is refused by name."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dense_matmul import dense_kernel_available, dense_matmul_cpu, dense_matmul_reference

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")


def weights(shape: tuple[int, ...], dtype, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 17])
def test_kernel_matches_numpy_on_a_stack_layer(dtype, transposed, rows):
    assert dense_kernel_available() == (True, "")
    k, n = 37, 83  # neither a multiple of 16 nor of a column tile
    w = weights((3, n, k) if transposed else (3, k, n), dtype)
    x = weights((rows, k), jnp.float32, seed=1)
    got = jax.jit(lambda x, w, i: dense_matmul_cpu(x, w, layer=i, transposed=transposed))(x, w, 2)
    w2 = np.asarray(w[2].astype(jnp.float32), np.float64)
    expected = np.asarray(x, np.float64) @ (w2.T if transposed else w2)
    assert got.shape == (rows, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_lone_weight_and_leading_axes(transposed):
    w = weights((200, 150), jnp.float32)  # K 150 / N 200 when transposed; several column ranges
    x = weights((2, 3, w.shape[1] if transposed else w.shape[0]), jnp.float32, seed=2)
    got = dense_matmul_cpu(x, w, transposed=transposed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense_matmul_reference(x, w, transposed=transposed)),
                               rtol=1e-5, atol=1e-5)


def test_bfloat16_activations_come_back_in_bfloat16():
    w = weights((64, 40), jnp.bfloat16)
    x = weights((3, 64), jnp.bfloat16, seed=3)
    got = dense_matmul_cpu(x, w)
    assert got.dtype == jnp.bfloat16
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_row_is_bitwise_the_same_whatever_the_row_count(transposed, dtype):
    k, n = 576, 333
    w = weights((n, k) if transposed else (k, n), dtype, seed=4)
    x = weights((17, k), jnp.float32, seed=5)
    alone = [np.asarray(dense_matmul_cpu(x[i:i + 1], w, transposed=transposed))[0] for i in range(17)]
    for rows in (2, 4, 7, 8, 17):
        together = np.asarray(dense_matmul_cpu(x[:rows], w, transposed=transposed))
        for i in range(rows):
            np.testing.assert_array_equal(together[i], alone[i], err_msg=f"row {i} of {rows}")


def test_no_rows_and_refusals():
    w = weights((3, 16, 8), jnp.float32)
    assert dense_matmul_cpu(jnp.zeros((0, 16)), w, layer=0).shape == (0, 8)
    with pytest.raises(ValueError, match="features"):
        dense_matmul_cpu(jnp.zeros((2, 15)), w, layer=0)
    with pytest.raises(ValueError, match="layer index needs a stack"):
        dense_matmul_cpu(jnp.zeros((2, 16)), w[0], layer=0)
    with pytest.raises(TypeError, match="weight dtype int8"):
        dense_matmul_cpu(jnp.zeros((2, 16)), w.astype(jnp.int8), layer=0)
    with pytest.raises(Exception, match="layer index outside the stack"):
        dense_matmul_cpu(jnp.zeros((2, 16)), w, layer=3).block_until_ready()
