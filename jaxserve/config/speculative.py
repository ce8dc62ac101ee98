"""Speculative decoding (vLLM's ``--speculative-config`` / ``LLM(speculative_config=...)``).

``SpecDecodeConfig`` is the engine's sub-configuration: one field holding vLLM's JSON (text on the
command line, a dict offline), parsed and checked by name when the configuration is built, into the
frozen ``SpeculativeConfig`` the scheduler and the runner read.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from jaxserve.config.base import SubConfig
from jaxserve.exceptions import ConfigError
from jaxserve.models.config import QUANTIZATION_METHODS

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# The methods whose proposer is a model named by ``model`` (EAGLE's: a head over the target's hidden states).
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# The methods whose proposer is a one-layer head over the target's hidden states, its KV in the
# target's blocks (mtp: the target checkpoint's own multi-token-prediction layer; no ``model``).
HEAD_METHODS = ("eagle", "eagle3", "mtp")
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "quantization",
         "draft_tensor_parallel_size")
_NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
_DRAFT_KEYS = ("model", "quantization", "draft_tensor_parallel_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    model: str | None = None  # draft_model: the draft's folder, .gguf file or hub id; eagle/eagle3: the head's
    # (mtp: None, the layers are the target's)
    quantization: str | None = None  # draft_model: the draft's weight format (the engine flag's values)
    # 1: the draft or head replicated on every device of the target's mesh; None or the target's
    # tensor_parallel_size: split like the target where its shapes allow (EngineConfig checks which)
    draft_tensor_parallel_size: int | None = None

    @classmethod
    def parse(cls, value: None | str | dict[str, Any]) -> SpeculativeConfig | None:
        """From the flag's JSON text or a dict; None/empty means off. As vLLM: ``method``
        defaults to ngram when prompt_lookup_max is given and to draft_model when model is (vLLM's
        older form), prompt_lookup_min to max and max to min."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config: not valid JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ConfigError(f"speculative_config: unsupported key(s) {', '.join(unknown)}; "
                              f"jaxserve reads {', '.join(_KEYS)}")
        method = value.get("method") or ("ngram" if "prompt_lookup_max" in value else
                                         "draft_model" if value.get("model") else None)
        if method not in METHODS:
            raise ConfigError(f"speculative_config.method={method!r} is not supported; "
                              f"jaxserve has {', '.join(METHODS)}")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError("speculative_config.num_speculative_tokens must be an integer >= 1, "
                              f"got {k!r}")
        if method in MODEL_METHODS:
            return cls._draft_model(method, value, k)
        if method == "mtp":
            return cls._mtp(value, k)
        stray = sorted(set(value) & set(_DRAFT_KEYS))
        if stray:
            raise ConfigError(f"speculative_config.{stray[0]} is for methods {', '.join(MODEL_METHODS)}, "
                              f"not {method}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = lo if lo is not None else hi, hi if hi is not None else lo
        if lo is None:
            lo, hi = 5, 5  # vLLM's defaults when neither is given
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"speculative_config.{name} must be an integer >= 1, got {n!r}")
        assert isinstance(lo, int) and isinstance(hi, int)
        if lo > hi:
            raise ConfigError(f"speculative_config.prompt_lookup_min={lo} is above "
                              f"prompt_lookup_max={hi}")
        return cls(method, k, hi, lo)

    @classmethod
    def _draft_model(cls, method: str, value: dict[str, Any], k: int) -> SpeculativeConfig:
        model = value.get("model")
        if not isinstance(model, str) or not model:
            what = "the draft's folder, .gguf file" if method == "draft_model" else "the EAGLE head's folder"
            raise ConfigError(f"speculative_config.model: method {method} needs {what} or hub id, got {model!r}")
        stray = sorted(set(value) & set(_NGRAM_KEYS))
        if stray:
            raise ConfigError(f"speculative_config.{stray[0]} is for method ngram, not {method}")
        quantization = value.get("quantization")
        if quantization is not None:
            if method != "draft_model":  # a one-layer head: its weights stay in the target's dtype
                raise ConfigError(f"speculative_config.quantization is for method draft_model, not {method}")
            if quantization not in QUANTIZATION_METHODS:
                raise ConfigError(f"speculative_config.quantization must be one of "
                                  f"{', '.join(QUANTIZATION_METHODS)}, got {quantization!r}")
        return cls(method, k, 0, 0, model, quantization, _draft_tp(value))

    @classmethod
    def _mtp(cls, value: dict[str, Any], k: int) -> SpeculativeConfig:
        # The layers are the target's own: no draft to name or quantize, only where they run.
        stray = sorted(set(value) & {"model", "quantization"})
        if stray:
            raise ConfigError(f"speculative_config.{stray[0]}: method mtp drafts with the target's own "
                              "multi-token-prediction layers (read from the target's checkpoint); leave it unset")
        stray = sorted(set(value) & set(_NGRAM_KEYS))
        if stray:
            raise ConfigError(f"speculative_config.{stray[0]} is for method ngram, not mtp")
        return cls("mtp", k, 0, 0, draft_tensor_parallel_size=_draft_tp(value))

    def to_dict(self) -> dict[str, Any]:
        """vLLM's JSON keys of this method (parse gives this configuration back)."""
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            return {**out, "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}
        if self.method == "mtp":
            size = self.draft_tensor_parallel_size
            return out if size is None else {**out, "draft_tensor_parallel_size": size}
        optional = {"quantization": self.quantization, "draft_tensor_parallel_size": self.draft_tensor_parallel_size}
        return {**out, "model": self.model, **{k: v for k, v in optional.items() if v is not None}}


def _draft_tp(value: dict[str, Any]) -> int | None:
    size = value.get("draft_tensor_parallel_size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ConfigError(f"speculative_config.draft_tensor_parallel_size must be an integer >= 1, got {size!r}")
    return size


@dataclasses.dataclass
class SpecDecodeConfig(SubConfig):
    speculative_config: str | dict[str, Any] | None = None
    """Speculative decoding as vLLM's JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_min": 2, "prompt_lookup_max": 5}, or {"method": "draft_model", "model": PATH_OR_NAME,
    "num_speculative_tokens": 4} (a smaller model with the target's vocabulary), or {"method": "eagle"
    or "eagle3", "model": HEAD_FOLDER_OR_NAME, "num_speculative_tokens": 3} (an EAGLE head trained for
    the target), or {"method": "mtp", "num_speculative_tokens": 1} (a target that ships its own
    multi-token-prediction layers, MiMo's); default: off. With tensor_parallel_size N,
    "draft_tensor_parallel_size" (1 or N, default N) replicates the draft, head or MTP layer on every
    device (1) or splits it like the target."""
    speculative_auto_off: bool = False
    """Beyond vLLM: per step, skip verifying drafts when the measured acceptance and a fitted
    step-cost model say speculation costs more than it saves at the current batch size (probing
    now and then, so it switches back on). Only with speculative_config."""

    def validate(self) -> None:
        parsed = SpeculativeConfig.parse(self.speculative_config)
        # Kept as canonical JSON text: one form for the flag, the copies and the comparisons.
        self.speculative_config = None if parsed is None else json.dumps(parsed.to_dict())
        if self.speculative_auto_off and parsed is None:
            raise ConfigError("speculative_auto_off needs speculative_config (speculation is off)")

    @property
    def spec(self) -> SpeculativeConfig | None:
        """The parsed configuration; None: speculation off."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.spec
        return 0 if spec is None else spec.num_speculative_tokens
