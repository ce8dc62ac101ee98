"""Online quantization of a float checkpoint's weights at load time (vLLM's ``--quantization``),
in numpy, to the layout :class:`jaxserve.layers.quantized_linear.QuantizedLinear` holds.

One scale per output column (``kernel [in, out]`` quantized over its input axis): ``int8``
symmetric with 127 steps, ``fp8`` float8_e4m3fn scaled so the column's absolute maximum is 448,
e4m3's largest finite value. vLLM's online fp8 keeps one scale per tensor; a column's own scale
costs the same multiply on the product and loses less.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxserve.models.config import ONLINE_QUANTIZATION_METHODS

FP8_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def quantize_columns(weight: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray]:
    """``weight [in, out]`` (any float dtype) -> ``(kernel [in, out], scale [out] float32)`` with
    ``weight ~= kernel * scale``; an all-zero column gets scale 1."""
    w = np.asarray(weight, np.float32)
    amax = np.abs(w).max(axis=0)
    if method == "int8":
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale
    if method == "fp8":
        scale = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
        q = np.clip(w / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
        return q, scale
    raise ValueError(f"quantization {method!r}: online methods are {', '.join(ONLINE_QUANTIZATION_METHODS)}")


def dequantize_columns(kernel: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return kernel.astype(np.float32) * scale
