"""Per-row sampling parameters as fixed-shape arrays, and the table that fills them.

The sampler runs inside the runner's compiled step, so every array here has a static shape:
`R` rows (the padded request bucket) and, for the two sparse per-request lists, a static width:

* `bias_token_ids` / `bias_values`: `[R, B]`, `B = max_logit_bias`. A dense `[R, V]` bias would
  move R*V floats host->device every step; the sparse form moves R*B pairs, scattered on device.
  Unused slots hold token id -1 and value 0.
* `allowed_token_ids`: `[R, A]`, `A = max_allowed_tokens`, plus `has_allowed[R]`. The boolean
  `[R, V]` mask is built on device from these ids. Unused slots hold -1.
* `min_tokens_stop_ids`: `[R, S]`, `S = MAX_MIN_TOKENS_STOP_IDS`, plus `min_tokens[R]`: the stop
  and EOS ids masked out while the row has generated fewer than `min_tokens` tokens (vLLM's
  min-tokens logits processor). Filled only for a request with `min_tokens`; unused slots hold -1.

A request whose `logit_bias`, `allowed_token_ids` or (with `min_tokens`) stop ids are longer than
their width is refused by the engine's input processor (``InvalidRequestError`` naming the
field) rather than truncated.

Rows are filled in one place, ``SamplingTable.set_row``: the runner writes a request's row when
it is admitted and gathers a step's rows by slot; ``sampling_arrays`` builds arrays for a plain
list of requests (tests, the sampler benchmark) through the same table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxserve.core.sampling_params import SAMPLING_EPS, SamplingParams

DEFAULT_MAX_LOGIT_BIAS = 64
DEFAULT_MAX_ALLOWED_TOKENS = 256
# Stop plus EOS ids a min_tokens request may mask (Llama 3 alone has three EOS ids).
MAX_MIN_TOKENS_STOP_IDS = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
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
    min_tokens: i32[R]           0 => off; while positions < min_tokens, `min_tokens_stop_ids` are masked
    min_tokens_stop_ids: i32[R, S] -1 => unused slot
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
    min_tokens: Any
    min_tokens_stop_ids: Any

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> SamplingMetadata:
        """Wrap a table's dict (numpy, or the same dict after one device transfer)."""
        return cls(**{name: arrays[name] for name in cls.fields()})


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
        "min_tokens": np.zeros(r, np.int32),
        "min_tokens_stop_ids": np.full((r, MAX_MIN_TOKENS_STOP_IDS), -1, np.int32),
    }


def _row_seed(params: SamplingParams, engine_seed: int | None) -> int:
    """The request's own seed, else the one the engine drew for it; taken modulo 2**32.

    Greedy rows never draw, so they may have neither (they get 0).
    """
    seed = engine_seed if params.seed is None else params.seed
    if seed is None:
        if params.temperature < SAMPLING_EPS:
            return 0
        raise ValueError("an unseeded random request needs the seed the engine drew for it")
    return int(seed) & 0xFFFFFFFF


class SamplingTable:
    """Each slot's sampling row, written once when its request is admitted.

    A step's arrays are then one gather by the rows' slots (plus this step's positions) instead
    of a per-request fill. Row ``num_slots`` is the padding slot and keeps the neutral values.
    """

    def __init__(self, num_slots: int, max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS,
                 max_allowed_tokens: int = DEFAULT_MAX_ALLOWED_TOKENS):
        self.padding_slot = num_slots
        self.max_logit_bias = max_logit_bias
        self.max_allowed_tokens = max_allowed_tokens
        self._blank = padding_arrays(1, max_logit_bias, max_allowed_tokens)
        self.arrays = padding_arrays(num_slots + 1, max_logit_bias, max_allowed_tokens)

    def set_row(self, slot: int, params: SamplingParams, seed: int | None) -> None:
        """Slot ``slot`` now samples with ``params``; ``seed`` is used when ``params.seed`` is None.

        ``params`` must already be validated for this engine (widths, vocabulary)."""
        a = self.arrays
        for name, blank in self._blank.items():
            a[name][slot] = blank[0]  # a shorter bias or allowed list leaves no stale ids
        a["temperature"][slot] = params.temperature
        # vLLM's -1 and 0 both mean off; anything past int32 is "all tokens" too (and would overflow)
        a["top_k"][slot] = min(max(params.top_k, 0), np.iinfo(np.int32).max)
        for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            a[name][slot] = getattr(params, name)
        a["seeds"][slot] = _row_seed(params, seed)
        bias = params.logit_bias or {}
        a["bias_token_ids"][slot, : len(bias)] = list(bias.keys())
        a["bias_values"][slot, : len(bias)] = list(bias.values())
        if params.allowed_token_ids is not None:
            a["allowed_token_ids"][slot, : len(params.allowed_token_ids)] = params.allowed_token_ids
            a["has_allowed"][slot] = True
        if params.min_tokens:
            stop_ids = params.all_stop_token_ids
            a["min_tokens"][slot] = min(params.min_tokens, np.iinfo(np.int32).max)
            a["min_tokens_stop_ids"][slot, : len(stop_ids)] = stop_ids

    def gather(self, row_slots: np.ndarray, positions: Sequence[int]) -> dict[str, np.ndarray]:
        """Arrays for rows whose slots are ``row_slots`` (padding rows: the padding slot);
        ``positions[i]`` is row i's number of generated output tokens. Freshly allocated: on a
        CPU a device array may alias its numpy source, so no buffer is reused between steps."""
        out = {name: arr[row_slots] for name, arr in self.arrays.items()}
        out["positions"][: len(positions)] = positions
        return out

    def all_greedy(self, row_slots: np.ndarray) -> bool:
        """Whether every row of ``row_slots`` is greedy, read from the table's f32 temperatures as
        the device reads them (one vectorised compare, not a loop over requests)."""
        return bool(np.all(self.arrays["temperature"][row_slots] < SAMPLING_EPS))

    def padding(self, num_rows: int) -> dict[str, np.ndarray]:
        """All-padding arrays of this table's widths (for warm-up compiles)."""
        return self.gather(np.full(num_rows, self.padding_slot, np.int32), [])


def sampling_arrays(
    params_list: Sequence[SamplingParams | None],
    num_rows: int,
    *,
    positions: Sequence[int],
    seeds: Sequence[int | None] | None = None,
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS,
    max_allowed_tokens: int = DEFAULT_MAX_ALLOWED_TOKENS,
) -> dict[str, np.ndarray]:
    """Arrays for ``params_list`` in rows ``0..len-1`` (None: a padding row), padded to
    ``num_rows``, built through a ``SamplingTable`` (tests and the sampler benchmark)."""
    if len(params_list) > num_rows:
        raise ValueError(f"{len(params_list)} requests do not fit in {num_rows} rows")
    if len(positions) != len(params_list) or (seeds is not None and len(seeds) != len(params_list)):
        raise ValueError("positions (and seeds, if given) need one entry per request")
    table = SamplingTable(len(params_list), max_logit_bias, max_allowed_tokens)
    row_slots = np.full(num_rows, table.padding_slot, np.int32)
    for slot, params in enumerate(params_list):
        if params is not None:
            table.set_row(slot, params, None if seeds is None else seeds[slot])
            row_slots[slot] = slot
    return table.gather(row_slots, positions)
