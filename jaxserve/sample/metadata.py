"""Per-row sampling parameters as fixed-shape arrays, and the host-side builder that fills them.

The sampler runs inside the runner's compiled step, so every array here has a static shape:
`R` rows (the padded request bucket) and, for the two sparse per-request lists, a static width:

* `bias_token_ids` / `bias_values`: `[R, B]`, `B = max_logit_bias` (default 64). A dense
  `[R, V]` bias would move R*V floats host->device every step (256 x 151936 x 4 B = 155 MB);
  the sparse form moves R*B pairs (256 x 64 x 8 B = 128 KB) and is scattered on device.
  Unused slots hold token id -1 and value 0.
* `allowed_token_ids`: `[R, A]`, `A = max_allowed_tokens` (default 256), plus `has_allowed[R]`.
  The boolean `[R, V]` mask is built on device from these ids. Unused slots hold -1.

A request whose `logit_bias` or `allowed_token_ids` is longer than its width is rejected by
`validate_sampling_params` with a ValueError naming the field: raise both widths in the config
(one more compile-time constant, a few KB more per step) rather than truncating silently.

This module is numpy + stdlib only: the engine validates requests with it before anything runs.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import numpy as np

DEFAULT_MAX_LOGIT_BIAS = 64
DEFAULT_MAX_ALLOWED_TOKENS = 256

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them would overflow.
SAMPLING_EPS = 1e-5

# Duck-typed SamplingParams fields and the value an object without the attribute (or with None)
# gets. These are vLLM's defaults; `seed` None means "the engine picks one".
PARAM_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "seed": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "logprobs": None,
}


class SamplingMetadata(NamedTuple):
    """One row per request; padding rows are greedy with every option off.

    temperature: f32[R]          < SAMPLING_EPS => greedy
    top_k: i32[R]                0 => off (all V tokens)
    top_p: f32[R]                1.0 => off
    min_p: f32[R]                0.0 => off
    presence_penalty: f32[R]     0.0 => off
    frequency_penalty: f32[R]    0.0 => off
    repetition_penalty: f32[R]   1.0 => off
    seeds: u32[R]                every row has one; the draw key is fold_in(PRNGKey(seed), position)
    positions: i32[R]            output tokens generated so far by this request
    bias_token_ids: i32[R, B]    -1 => unused slot
    bias_values: f32[R, B]       added to the logit of the matching token
    allowed_token_ids: i32[R, A] -1 => unused slot
    has_allowed: bool[R]         True => only `allowed_token_ids` may be sampled
    """

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    presence_penalty: Any
    frequency_penalty: Any
    repetition_penalty: Any
    seeds: Any
    positions: Any
    bias_token_ids: Any
    bias_values: Any
    allowed_token_ids: Any
    has_allowed: Any

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> "SamplingMetadata":
        """Wrap the builder's dict (numpy, or the same dict after one device transfer)."""
        return cls(**{name: arrays[name] for name in cls._fields})


def padding_arrays(num_rows: int, max_logit_bias: int, max_allowed_tokens: int) -> dict[str, np.ndarray]:
    """All-padding arrays: greedy rows with every option at its neutral value."""
    r = num_rows
    return {
        "temperature": np.zeros(r, np.float32),
        "top_k": np.zeros(r, np.int32),
        "top_p": np.ones(r, np.float32),
        "min_p": np.zeros(r, np.float32),
        "presence_penalty": np.zeros(r, np.float32),
        "frequency_penalty": np.zeros(r, np.float32),
        "repetition_penalty": np.ones(r, np.float32),
        "seeds": np.zeros(r, np.uint32),
        "positions": np.zeros(r, np.int32),
        "bias_token_ids": np.full((r, max_logit_bias), -1, np.int32),
        "bias_values": np.zeros((r, max_logit_bias), np.float32),
        "allowed_token_ids": np.full((r, max_allowed_tokens), -1, np.int32),
        "has_allowed": np.zeros(r, np.bool_),
    }


def param(params: Any, name: str) -> Any:
    """A SamplingParams-like field, or its default when absent or None."""
    value = getattr(params, name, None)
    return PARAM_DEFAULTS[name] if value is None else value


def _fail(field: str, message: str) -> None:
    raise ValueError(f"{field}: {message}")


def _check_range(params: Any, field: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """The float value of `field`, or a ValueError naming it (NaN fails every comparison)."""
    value = float(param(params, field))
    above_lo = value > lo if lo_open else value >= lo
    if not (above_lo and value <= hi):
        bracket = "(" if lo_open else "["
        _fail(field, f"must be in {bracket}{lo}, {hi}], got {value}")
    return value


def _check_token_id(field: str, token_id: Any, vocab_size: int) -> int:
    if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
        _fail(field, f"token ids must be integers, got {token_id!r}")
    if not 0 <= int(token_id) < vocab_size:
        _fail(field, f"token id {int(token_id)} is outside the vocabulary [0, {vocab_size})")
    return int(token_id)


def _check_logit_bias(params: Any, vocab_size: int, max_logit_bias: int) -> None:
    bias = param(params, "logit_bias")
    if not bias:
        return
    if len(bias) > max_logit_bias:
        _fail("logit_bias", f"{len(bias)} entries exceed the static width max_logit_bias={max_logit_bias}")
    for token_id, value in bias.items():
        _check_token_id("logit_bias", token_id, vocab_size)
        if not math.isfinite(float(value)):
            _fail("logit_bias", f"bias for token {token_id} must be finite, got {value}")


def _check_allowed_token_ids(params: Any, vocab_size: int, max_allowed_tokens: int) -> None:
    allowed = getattr(params, "allowed_token_ids", None)
    if allowed is None:
        return
    if len(allowed) == 0:
        _fail("allowed_token_ids", "must not be empty (no token could be sampled)")
    if len(allowed) > max_allowed_tokens:
        _fail(
            "allowed_token_ids",
            f"{len(allowed)} ids exceed the static width max_allowed_tokens={max_allowed_tokens}",
        )
    for token_id in allowed:
        _check_token_id("allowed_token_ids", token_id, vocab_size)


def _check_integer(params: Any, field: str) -> int:
    value = param(params, field)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        _fail(field, f"must be an integer, got {value!r}")
    return int(value)


def validate_sampling_params(
    params: Any,
    *,
    vocab_size: int,
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS,
    max_allowed_tokens: int = DEFAULT_MAX_ALLOWED_TOKENS,
    max_num_logprobs: int | None = None,
) -> None:
    """Raise ValueError('<field>: ...') if the sampler cannot honour `params` as given.

    Ranges follow vLLM's SamplingParams checks. Call it when a request is admitted, so that a bad
    request fails alone instead of inside a batched step.
    """
    _check_range(params, "temperature", 0.0, math.inf)
    top_k = _check_integer(params, "top_k")
    if top_k < -1:
        _fail("top_k", f"must be -1 or 0 (off) or positive, got {top_k}")
    _check_range(params, "top_p", 0.0, 1.0, lo_open=True)
    _check_range(params, "min_p", 0.0, 1.0)
    _check_range(params, "presence_penalty", -2.0, 2.0)
    _check_range(params, "frequency_penalty", -2.0, 2.0)
    _check_range(params, "repetition_penalty", 0.0, math.inf, lo_open=True)
    seed = getattr(params, "seed", None)
    if seed is not None:
        _check_integer(params, "seed")
    _check_logit_bias(params, vocab_size, max_logit_bias)
    _check_allowed_token_ids(params, vocab_size, max_allowed_tokens)
    logprobs = getattr(params, "logprobs", None)
    if logprobs is not None:
        n = _check_integer(params, "logprobs")
        limit = math.inf if max_num_logprobs is None else max_num_logprobs
        if not 0 <= n <= limit:
            _fail("logprobs", f"must be in [0, {max_num_logprobs}] (max_num_logprobs), got {n}")


def _row_seed(params: Any, engine_seed: int | None, row: int) -> int:
    """The request's own seed, else the one the engine drew for it; taken modulo 2**32.

    Greedy rows never draw, so they may have neither (they get 0).
    """
    seed = getattr(params, "seed", None)
    seed = engine_seed if seed is None else seed
    if seed is None and float(param(params, "temperature")) < SAMPLING_EPS:
        return 0
    if seed is None:
        _fail("seed", f"row {row} has no seed: pass seeds= with one drawn by the engine for unseeded requests")
    return int(seed) & 0xFFFFFFFF


def _fill_row(arrays: dict[str, np.ndarray], row: int, params: Any, seed: int, position: int) -> None:
    top_k = int(param(params, "top_k"))
    arrays["temperature"][row] = param(params, "temperature")
    # vLLM's -1 and 0 both mean off; anything past int32 is "all tokens" too (and would overflow)
    arrays["top_k"][row] = min(max(top_k, 0), np.iinfo(np.int32).max)
    for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        arrays[name][row] = param(params, name)
    arrays["seeds"][row] = seed
    arrays["positions"][row] = position
    bias = param(params, "logit_bias") or {}
    arrays["bias_token_ids"][row, : len(bias)] = list(bias.keys())
    arrays["bias_values"][row, : len(bias)] = list(bias.values())
    allowed = getattr(params, "allowed_token_ids", None)
    if allowed is not None:
        arrays["allowed_token_ids"][row, : len(allowed)] = list(allowed)
        arrays["has_allowed"][row] = True


def build_sampling_arrays(
    params_list: Sequence[Any],
    num_rows: int,
    *,
    positions: Sequence[int],
    seeds: Sequence[int | None] | None = None,
    vocab_size: int,
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS,
    max_allowed_tokens: int = DEFAULT_MAX_ALLOWED_TOKENS,
    max_num_logprobs: int | None = None,
) -> dict[str, np.ndarray]:
    """Numpy arrays for SamplingMetadata, keyed by field name, `num_rows` rows.

    Row i comes from `params_list[i]` (a SamplingParams-like object, or None for an empty slot);
    rows past `len(params_list)` are padding. `positions[i]` is row i's number of generated output
    tokens; `seeds[i]` is used when `params_list[i].seed` is None. Every array is freshly allocated:
    on CPU a device array may alias its numpy source, so buffers are never reused between steps.
    """
    if len(params_list) > num_rows:
        _fail("num_rows", f"{len(params_list)} requests do not fit in {num_rows} rows")
    if len(positions) != len(params_list):
        _fail("positions", f"expected {len(params_list)} positions, got {len(positions)}")
    if seeds is not None and len(seeds) != len(params_list):
        _fail("seeds", f"expected {len(params_list)} seeds, got {len(seeds)}")
    arrays = padding_arrays(num_rows, max_logit_bias, max_allowed_tokens)
    for row, params in enumerate(params_list):
        if params is None:
            continue
        validate_sampling_params(params, vocab_size=vocab_size, max_logit_bias=max_logit_bias,
                                 max_allowed_tokens=max_allowed_tokens, max_num_logprobs=max_num_logprobs)
        seed = _row_seed(params, None if seeds is None else seeds[row], row)
        _fill_row(arrays, row, params, seed, int(positions[row]))
    return arrays


class SamplingTable:
    """Each slot's sampling row, written once when its request is admitted.

    A step's arrays are then one gather by the rows' slots (plus this step's positions) instead
    of a per-request fill. Row ``num_slots`` is the padding slot and keeps the neutral values.
    """

    def __init__(self, num_slots: int, max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS,
                 max_allowed_tokens: int = DEFAULT_MAX_ALLOWED_TOKENS):
        self._blank = padding_arrays(1, max_logit_bias, max_allowed_tokens)
        self.arrays = padding_arrays(num_slots + 1, max_logit_bias, max_allowed_tokens)

    def set_row(self, slot: int, params: Any, seed: int | None) -> None:
        """Slot ``slot`` now samples with ``params``; ``seed`` is used when ``params.seed`` is None."""
        for name, blank in self._blank.items():
            self.arrays[name][slot] = blank[0]  # a shorter bias or allowed list leaves no stale ids
        _fill_row(self.arrays, slot, params, _row_seed(params, seed, slot), 0)

    def gather(self, row_slots: np.ndarray, positions: Sequence[int]) -> dict[str, np.ndarray]:
        """Arrays for rows whose slots are ``row_slots`` (padding rows: the padding slot)."""
        out = {name: arr[row_slots] for name, arr in self.arrays.items()}
        out["positions"][: len(positions)] = positions
        return out


class SamplingMetadataBuilder:
    """Holds the static widths of one engine configuration; builds and validates with them."""

    def __init__(
        self,
        *,
        vocab_size: int,
        max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS,
        max_allowed_tokens: int = DEFAULT_MAX_ALLOWED_TOKENS,
        max_num_logprobs: int | None = None,
    ):
        self.vocab_size = vocab_size
        self.max_logit_bias = max_logit_bias
        self.max_allowed_tokens = max_allowed_tokens
        self.max_num_logprobs = max_num_logprobs

    def validate(self, params: Any) -> None:
        """Raise ValueError('<field>: ...') for a request this configuration cannot sample."""
        validate_sampling_params(
            params,
            vocab_size=self.vocab_size,
            max_logit_bias=self.max_logit_bias,
            max_allowed_tokens=self.max_allowed_tokens,
            max_num_logprobs=self.max_num_logprobs,
        )

    def build(
        self,
        params_list: Sequence[Any],
        num_rows: int,
        *,
        positions: Sequence[int],
        seeds: Sequence[int | None] | None = None,
    ) -> dict[str, np.ndarray]:
        """See `build_sampling_arrays`."""
        return build_sampling_arrays(
            params_list,
            num_rows,
            positions=positions,
            seeds=seeds,
            vocab_size=self.vocab_size,
            max_logit_bias=self.max_logit_bias,
            max_allowed_tokens=self.max_allowed_tokens,
            max_num_logprobs=self.max_num_logprobs,
        )

    def padding(self, num_rows: int) -> dict[str, np.ndarray]:
        """All-padding arrays of this configuration's shapes (for warm-up compiles)."""
        return padding_arrays(num_rows, self.max_logit_bias, self.max_allowed_tokens)
