"""Pre-quantized checkpoints in the compressed-tensors format (vLLM's ``compressed-tensors``, the
format llm-compressor writes): which ones jaxserve serves, read from ``config.json``'s
``quantization_config``.

Served: 8-bit symmetric weights, int (``int-quantized``, ``naive-quantized``) or float e4m3
(``float-quantized``), one scale per output channel (``weight_scale [out, 1]``) or per tensor
(``[1]`` or ``[]``, broadcast to every column), with no activation quantization (w8a16) or dynamic
per-token/per-tensor activations (w8a8: jaxserve quantizes activations on the fly where it pays,
see :mod:`jaxserve.layers.quantized_linear`). Everything else is refused with a ``ConfigError``
naming the field and its value, never loaded wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.exceptions import ConfigError

COMPRESSED_TENSORS = "compressed-tensors"
_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
_WEIGHT_TYPES = {"int": "int8", "float": "fp8"}  # weights.type -> QuantizedLinear's method
_STORED_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
_STRATEGIES = ("channel", "tensor")
_DYNAMIC_INPUT_STRATEGIES = ("token", "tensor")
# ignore may only keep the LM head float: jaxserve quantizes every decoder projection or none.
_IGNORABLE = ("lm_head", "re:.*lm_head")


@dataclass(frozen=True)
class CompressedTensorsScheme:
    method: str  # "int8" or "fp8": the dtype of the stored weights and of QuantizedLinear's kernel
    strategy: str  # "channel" or "tensor": the shape of weight_scale
    dynamic_activations: bool  # w8a8 (activations quantized per token at run time) vs w8a16


def _bad(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"quantization_config.{field} = {value!r}: {why}")


def parse_scheme(qc: dict[str, Any]) -> CompressedTensorsScheme:
    """The scheme of a compressed-tensors ``quantization_config``, or a ConfigError naming the
    first field jaxserve does not serve."""
    if qc.get("quant_method") != COMPRESSED_TENSORS:
        raise _bad("quant_method", qc.get("quant_method"), f"jaxserve reads only {COMPRESSED_TENSORS!r} here")
    fmt = qc.get("format")
    if fmt not in _FORMATS:
        raise _bad("format", fmt, f"supported formats are {', '.join(_FORMATS)}")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _bad("config_groups", sorted(groups), "exactly one group is supported")
    (name, group), = groups.items()
    where = f"config_groups.{name}"
    if group.get("format") not in (None, fmt):
        raise _bad(f"{where}.format", group.get("format"), f"must match the checkpoint's format {fmt!r}")
    if group.get("targets") != ["Linear"]:
        raise _bad(f"{where}.targets", group.get("targets"), "only ['Linear'] (every projection) is supported")
    w = group.get("weights") or {}
    checks: list[tuple[str, Any, bool, str]] = [
        ("num_bits", w.get("num_bits"), w.get("num_bits") == 8, "only 8-bit weights are supported"),
        ("type", w.get("type"), w.get("type") in _WEIGHT_TYPES, "must be int or float"),
        ("strategy", w.get("strategy"), w.get("strategy") in _STRATEGIES, "must be channel or tensor"),
        ("symmetric", w.get("symmetric"), w.get("symmetric") is True, "only symmetric weights are supported"),
        ("dynamic", w.get("dynamic"), not w.get("dynamic"), "weights need stored scales"),
        ("group_size", w.get("group_size"), w.get("group_size") is None, "group quantization is not supported"),
        ("block_structure", w.get("block_structure"), w.get("block_structure") is None,
         "block quantization is not supported"),
        ("actorder", w.get("actorder"), w.get("actorder") is None, "activation ordering is not supported"),
    ]
    for field, value, ok, why in checks:
        if not ok:
            raise _bad(f"{where}.weights.{field}", value, why)
    method = _WEIGHT_TYPES[w["type"]]
    if fmt == "float-quantized" and method != "fp8" or fmt == "int-quantized" and method != "int8":
        raise _bad("format", fmt, f"does not hold {w['type']} weights")
    inputs = group.get("input_activations")
    if inputs is not None:
        if not inputs.get("dynamic"):
            raise _bad(f"{where}.input_activations.dynamic", inputs.get("dynamic"),
                       "static input scales are not supported (dynamic per-token activations are)")
        if inputs.get("strategy") not in _DYNAMIC_INPUT_STRATEGIES:
            raise _bad(f"{where}.input_activations.strategy", inputs.get("strategy"), "must be token or tensor")
        if inputs.get("symmetric") is not True:
            raise _bad(f"{where}.input_activations.symmetric", inputs.get("symmetric"),
                       "only symmetric activations are supported")
    if group.get("output_activations") is not None:
        raise _bad(f"{where}.output_activations", group["output_activations"], "not supported")
    for entry in qc.get("ignore") or []:
        if entry not in _IGNORABLE:
            raise _bad("ignore", entry, "only the LM head may stay unquantized")
    if qc.get("kv_cache_scheme") is not None:
        raise _bad("kv_cache_scheme", qc["kv_cache_scheme"], "a quantized KV cache is not supported here")
    return CompressedTensorsScheme(method, w["strategy"], inputs is not None)


def checkpoint_scheme(folder: str | Path) -> CompressedTensorsScheme | None:
    """The compressed-tensors scheme a checkpoint folder's ``config.json`` declares, or None when
    it declares no ``quantization_config``. Any other quant_method is refused."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    qc = cfg.get("quantization_config")
    return None if qc is None else parse_scheme(qc)


def stored_getter(get: Callable[[str], np.ndarray], scheme: CompressedTensorsScheme) -> Callable[[str], np.ndarray]:
    """``get`` that refuses a decoder projection's weight stored in any dtype but the scheme's,
    so a float weight is never cast to int8 silently."""
    want = _STORED_DTYPES[scheme.method]

    def checked(name: str) -> np.ndarray:
        array = get(name)
        if name.endswith("_proj.weight") and array.dtype != want:
            raise ConfigError(f"{name}: stored as {array.dtype}, quantization_config says {scheme.method} ({want})")
        return array
    return checked


def column_scales(get: Callable[[str], np.ndarray], prefix: str) -> np.ndarray:
    """``prefix.weight_scale`` as one float32 scale per output row of ``prefix.weight``: a
    per-tensor scale broadcast, a per-channel ``[out, 1]`` one flattened."""
    scale = np.asarray(get(prefix + ".weight_scale"), np.float32).reshape(-1)
    rows = get(prefix + ".weight").shape[0]
    if scale.size == 1:
        return np.full((rows,), scale[0], np.float32)
    if scale.size != rows:
        raise ConfigError(f"{prefix}.weight_scale: {scale.size} scales for {rows} output channels")
    return scale


def scale_names(names: list[str]) -> list[str]:
    """The checkpoint's scale tensors (they sit beside the weights the float model expects)."""
    return [n for n in names if n.endswith(".weight_scale")]
