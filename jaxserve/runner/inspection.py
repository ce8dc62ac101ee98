"""Read-only views of the runner's step for researchers: its inputs and its compiled program.

``StepInputs``: the packed host buffer of the last launched step, decoded with the very layout
the step was compiled for (``packing.decode``) into the typed ``StepArrays`` the step read, so
what is shown is what the device received.
``StepProgram``: a step variant as text (jaxpr, StableHLO, XLA's optimized HLO) with XLA's cost
and memory analyses of the executable the engine runs. Neither changes the runner's state: the
program is the one compiled at warm-up (compiled now only under ``enforce_eager``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxserve.runner.compilation import StepVariant
from jaxserve.runner.packing import PackLayout, decode
from jaxserve.runner.step_inputs import ModelInputs, SamplingInputs, StepArrays

# The fields of XLA's memory analysis, in bytes, under the names it gives them.
_MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                  "temp_size_in_bytes", "generated_code_size_in_bytes")


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """What the runner keeps of its last launch: the buffer, its layout, the rows' requests."""

    buffer: np.ndarray
    layout: PackLayout
    bucket: int
    num_tokens: int
    req_ids: tuple[str, ...]
    block_size: int


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's host inputs by name. Rows ``>= num_seqs`` and tokens ``>= num_tokens`` are
    padding; row ``i`` is request ``req_ids[i]``, owning tokens ``query_start_loc[i]:[i + 1]``."""

    bucket: int  # padded token count (the compiled program's shape)
    num_tokens: int  # scheduled tokens
    req_ids: tuple[str, ...]
    arrays: StepArrays[np.ndarray]  # the step's typed inputs, numpy
    layout: PackLayout  # where each array lies in the one int32 buffer
    block_size: int  # tokens per KV page: slot = block_tables[row, pos // block_size] * block_size + pos % block_size

    @property
    def model(self) -> ModelInputs[np.ndarray]:
        """Model and attention inputs: ``input_ids``, ``positions``, ``slot_mapping`` ..."""
        return self.arrays.model

    @property
    def sampling(self) -> SamplingInputs:
        """Per-row sampling parameters: ``temperature``, ``top_k``, ``seeds`` ..."""
        return self.arrays.sampling

    @property
    def packed_words(self) -> int:
        return self.layout.total

    def __getitem__(self, name: str) -> np.ndarray:
        """An input by name (``inputs["positions"]``): a model one, a sampling one or a step flag."""
        for group in (self.model, self.sampling, self.arrays):
            if name in {f.name for f in dataclasses.fields(group)}:
                return getattr(group, name)
        raise KeyError(name)

    def request_view(self, req_id: str) -> dict[str, Any]:
        """Request ``req_id``'s slice of the step: its tokens' positions, ids and KV slots, its
        context length and the pages its block table row uses."""
        i = self.req_ids.index(req_id)
        m = self.model
        qsl, kv_len = m.query_start_loc, int(m.kv_lens[i])
        tokens = slice(int(qsl[i]), int(qsl[i + 1]))
        pages = -(-kv_len // self.block_size)
        return {"row": i, "tokens": (tokens.start, tokens.stop), "positions": m.positions[tokens],
                "input_ids": m.input_ids[tokens], "slot_mapping": m.slot_mapping[tokens],
                "kv_len": kv_len, "blocks": m.block_tables[i, :pages]}


def decode_step(packed: PackedStep) -> StepInputs:
    arrays = decode(packed.buffer, packed.layout)
    return StepInputs(packed.bucket, packed.num_tokens, packed.req_ids, arrays, packed.layout, packed.block_size)


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """A compiled step variant, as the engine runs it."""

    variant: str  # StepVariant.name: the bucket, "-decode" for the decode-only variant ...
    bucket: int
    jaxpr: str
    stablehlo: str  # the lowered module handed to XLA
    hlo: str  # XLA's optimized HLO (after fusion): what executes
    cost: Mapping[str, float]  # XLA's cost analysis: "flops", "bytes accessed", ...
    memory: Mapping[str, int]  # XLA's memory analysis: argument, output, alias, temp, code bytes

    @property
    def flops(self) -> float:
        return float(self.cost.get("flops", 0.0))

    @property
    def bytes_accessed(self) -> float:
        return float(self.cost.get("bytes accessed", 0.0))


def step_program(steps, variant: StepVariant) -> StepProgram:
    """``steps``: the runner's ``CompiledSteps``. The jaxpr and StableHLO are traced again (no
    compile); the HLO and analyses come from the executable the engine runs."""
    traced = steps.traced(variant)
    executable = steps.get(variant)
    return StepProgram(variant.name, variant.bucket, str(traced.jaxpr), steps.lowered(variant, traced).as_text(),
                       executable.as_text(), _cost_dict(executable.cost_analysis()),
                       _memory_dict(executable.memory_analysis()))


def _cost_dict(cost: Any) -> dict[str, float]:
    """JAX gives one dict (or, in older releases, a list with one dict per device program)."""
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return {k: float(v) for k, v in (cost or {}).items()}


def _memory_dict(memory: Any | None) -> dict[str, int]:
    return {f: int(getattr(memory, f)) for f in _MEMORY_FIELDS if memory is not None and hasattr(memory, f)}


def find_variant(variants: list[StepVariant], bucket: int, decode_only: bool = False) -> StepVariant:
    """The compiled variant of ``bucket`` (on a GPU, its greedy sampler program)."""
    matching = [v for v in variants if v.bucket == bucket and v.decode_only == decode_only]
    if not matching:
        buckets = sorted({v.bucket for v in variants if v.decode_only == decode_only})
        kind = "decode-only " if decode_only else ""
        raise ValueError(f"no {kind}step variant for bucket {bucket}; compiled buckets: {buckets}")
    return next((v for v in matching if v.all_greedy), matching[0])
