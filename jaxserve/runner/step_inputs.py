"""One step's inputs as typed, registered pytrees: what ``prepare`` builds and the step reads.

``StepArrays`` composes the groups: ``ModelInputs`` (tokens and attention metadata, one row per
scheduled request), the sampler's ``SamplingMetadata`` (one row per request, from
``jaxserve.sample.metadata``) and the step's flags. All are frozen dataclasses registered with
``jax.tree_util.register_dataclass``, so the same type holds numpy arrays on the host and traced
arrays inside the compiled step: :mod:`.packing` walks the fields to lay the leaves end to end in
one int32 buffer (one host transfer) and rebuilds the very dataclasses from it inside the step,
and the inspection view decodes them by name. Nothing changes a built ``StepArrays``: a flag that
joins later (``use_bitmask`` at launch) goes in with ``dataclasses.replace``.

Adding an input is a one-line change here: declare the field (typed, shape in its comment) in its
group, or a new group as a field of ``StepArrays``; packing, unpacking, the compiled layout and the
inspection view follow the fields. Its value is then filled where the group is built
(``build_step_arrays`` for ``ModelInputs``, which also builds the padding steps of warm-up; a new
group in ``ModelRunner._prepare_inputs`` and ``_padding_inputs``), and read in ``ModelRunner._step``.
Shapes: ``T`` the step's token bucket, ``R`` its rows, ``P`` the block-table width.
"""

from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

import jax
import numpy as np

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.sample.metadata import SamplingMetadata

# The leaves' type: numpy on the host (``prepare`` builds ``StepArrays[np.ndarray]``, inspection
# decodes one), jax arrays inside the compiled step (``StepArrays[jax.Array]``).
Array = TypeVar("Array", np.ndarray, jax.Array)

# The sampler's per-row arrays: already a registered dataclass of the sample layer.
SamplingInputs = SamplingMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelInputs(Generic[Array]):
    """Model and attention inputs. Row ``r`` owns tokens ``query_start_loc[r]:[r + 1]``; rows
    ``>= num_seqs`` and tokens past the last row's are padding."""

    input_ids: Array  # i32[T] token ids known to the host (0 where in flight or padding)
    prev_rows: Array  # i32[T] row of the previous step's sampled token to read instead; -1: none
    positions: Array  # i32[T] each token's position in its sequence
    slot_mapping: Array  # i32[T] KV slot each token writes; -1: nowhere (padding)
    token_slots: Array  # i32[T] each token's request slot (penalty tables); padding slot for padding
    token_is_output: Array  # bool[T] the token is an output token (counted by the penalties)
    block_tables: Array  # i32[R, P] each row's KV pages
    kv_lens: Array  # i32[R] context length after this step; 0 for padding rows
    query_start_loc: Array  # i32[R + 1] cumulative scheduled tokens per row
    num_seqs: Array  # i32[1] rows holding a request
    logits_indices: Array  # i32[R] each row's last scheduled token (where it samples)
    row_slots: Array  # i32[R] each row's request slot (sampling and penalty rows)
    # Several KV cache groups (hybrid attention): every group's block tables and slot mappings
    # (``block_tables`` and ``slot_mapping`` above are group 0's); None with one group.
    group_block_tables: Array | None = None  # i32[G, R, P]
    group_slot_mapping: Array | None = None  # i32[G, T]

    def attention_metadata(self: ModelInputs[jax.Array]) -> AttentionMetadata:
        return AttentionMetadata(positions=self.positions, slot_mapping=self.slot_mapping,
                                 block_tables=self.block_tables, kv_lens=self.kv_lens,
                                 query_start_loc=self.query_start_loc, num_seqs=self.num_seqs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecInputs(Generic[Array]):
    """Speculative decoding (K drafts at most, static): where each row is scored and what it
    verifies. A row's drafts are its last ``num_draft_tokens`` scheduled tokens; it is scored at
    its last d+1 tokens, the rows' positions laid end to end (``P = min(T, R*(K+1))`` of them: each
    is a scheduled token)."""

    logits_indices: Array  # i32[P] each scored position's token; 0 for padding
    position_rows: Array  # i32[P] its row
    position_offsets: Array  # i32[P] its j (0 at the row's last known token)
    flat_index: Array  # i32[R, K+1] row r's position j among the P (its last one past its drafts)
    draft_token_ids: Array  # i32[R, K] the drafts (0 past num_draft_tokens)
    num_draft_tokens: Array  # i32[R] 0..K


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepArrays(Generic[Array]):
    """Everything one compiled step reads besides the device state and the structured-output
    bitmask (which stays a separate argument, often an on-device constant)."""

    model: ModelInputs[Array]
    sampling: SamplingInputs
    need_logprobs: Array  # bool[1] some sampling row asks for logprobs
    use_bitmask: Array  # bool[1] the bitmask argument holds real masks (set at launch)
    lora_slot_ids: Array | None = None  # i32[T] each token's adapter slot, -1: the base model; None without LoRA
    spec: SpecInputs[Array] | None = None  # None: speculative decoding off
    mrope_positions: Array | None = None  # i32[3, T] (t, h, w) rotary positions of an M-RoPE model; None otherwise

    @property
    def num_rows(self) -> int:
        return int(self.model.row_slots.shape[0])

    @property
    def num_mask_rows(self) -> int:
        """The structured-output bitmask's rows: one per row, or per verified position (speculative)."""
        return self.num_rows if self.spec is None else int(self.spec.logits_indices.shape[0])


def flag(value: bool) -> np.ndarray:
    """A step flag as the packed layout holds it: a bool[1] leaf."""
    return np.asarray([value], np.bool_)
