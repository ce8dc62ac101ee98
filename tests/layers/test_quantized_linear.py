"""QuantizedLinear and the online quantizer against their float references."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.layers.quantized_linear import QuantizedLinear, quantized_linear, quantized_linear_reference
from jaxserve.models.config import ONLINE_QUANTIZATION_METHODS
from jaxserve.models.quantize import dequantize_columns, quantize_columns


def _weight(rows=96, cols=40, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Columns of very different magnitudes: a scale on the wrong axis, or a transposed kernel, shows.
    return (rng.standard_normal((rows, cols)) * np.geomspace(1e-3, 10, cols)).astype(np.float32)


def test_int8_columns_round_trip_within_half_a_step():
    w = _weight()
    q, scale = quantize_columns(w, "int8")
    assert q.dtype == np.int8 and scale.shape == (w.shape[1],)
    assert np.abs(q).max() == 127  # each column's largest entry uses the full range
    err = np.abs(dequantize_columns(q, scale) - w)
    assert np.all(err <= scale / 2 + 1e-7 * np.abs(w).max(axis=0))


def test_fp8_columns_round_trip_within_e4m3_precision():
    w = _weight()
    q, scale = quantize_columns(w, "fp8")
    assert q.dtype == ml_dtypes.float8_e4m3fn
    assert np.allclose(np.abs(q.astype(np.float32)).max(axis=0), 448)
    err = np.abs(dequantize_columns(q, scale) - w)
    # 3 mantissa bits: half an ulp is 1/16 of the value; below 2^-6 the subnormal step is 2^-9.
    assert np.all(err <= np.abs(w) / 16 + scale * 2.0**-10 + 1e-7)


def test_zero_column_gets_a_unit_scale():
    w = _weight()
    w[:, 3] = 0
    for method in ONLINE_QUANTIZATION_METHODS:
        q, scale = quantize_columns(w, method)
        assert scale[3] == 1 and not q[:, 3].astype(np.float32).any()


@pytest.mark.parametrize("method, int8_activations", [("int8", False), ("fp8", False), ("int8", True)])
def test_layer_matches_dequantized_reference(method, int8_activations):
    w = _weight()
    q, scale = quantize_columns(w, method)
    x = np.random.default_rng(1).standard_normal((5, w.shape[0])).astype(np.float32)
    bias = jnp.asarray(np.linspace(-1, 1, w.shape[1]), jnp.float32)
    args = (jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), bias)
    ref = np.asarray(quantized_linear_reference(*args))
    got = np.asarray(quantized_linear(*args, int8_activations=int8_activations))
    w_abs = np.abs(dequantize_columns(q, scale))
    # Float rounding of the sum, plus (int8 activations) half a step of each row's activations
    # times the column's absolute weights: per element, so a scale on the wrong axis fails.
    bound = 1e-5 * (np.abs(x) @ w_abs) + 1e-6
    if int8_activations:
        bound += (np.abs(x).max(axis=1, keepdims=True) / 254) * w_abs.sum(axis=0)
    assert np.all(np.abs(got - ref) <= bound)


def test_module_holds_quantized_kernel_and_column_scales():
    layer = QuantizedLinear(8, 6, method="int8", use_bias=True)
    assert layer.kernel[...].dtype == jnp.int8 and layer.kernel_scale[...].shape == (6,)
    assert layer(jnp.ones((3, 8))).shape == (3, 6)
    with pytest.raises(ValueError, match="int4"):
        QuantizedLinear(8, 6, method="int4")
