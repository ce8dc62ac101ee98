"""The runner's view of the requests it holds, and the padded numpy inputs of one step.

``CachedRequestState`` mirrors what the scheduler told the runner (tokens, blocks, computed count)
plus the runner's own bookkeeping: a persistent *slot* (the request's row in the device-resident
penalty tables) and the seed its draws use. ``build_step_arrays`` turns one ``SchedulerOutput`` into
fixed-shape arrays for a token bucket; the caller packs them into one transfer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: Any
    block_ids: list[int]
    num_computed_tokens: int
    slot: int
    seed: int
    # (token ids, logprobs, rank of the actual token) per prompt position, filled chunk by chunk
    prompt_logprobs_rows: list | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]


@dataclasses.dataclass
class StepPlan:
    """What the host needs after the step: which rows sample, and for whom."""

    req_ids: list[str]
    num_tokens: int  # real (unpadded) tokens
    token_bucket: int
    samples: list[bool]  # row i produces a token this step (its prompt/recompute is complete)
    want_logprobs: bool  # some sampling row asked for logprobs


class SlotAllocator:
    """Persistent rows of the penalty tables; ``padding_slot`` (== capacity) is never handed out."""

    def __init__(self, capacity: int):
        self.padding_slot = capacity
        self._free = list(range(capacity - 1, -1, -1))

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free request slot: more running requests than max_num_seqs")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)


def build_step_arrays(
    states: list[CachedRequestState],
    num_scheduled: list[int],
    new_slots: set[int],
    token_bucket: int,
    num_rows: int,
    max_blocks_per_seq: int,
    block_size: int,
    padding_slot: int,
    prev_row_of: dict[str, int] | None = None,
) -> tuple[dict[str, np.ndarray], list[bool]]:
    """Model and attention inputs for one step (sampling arrays are added by the caller).

    With async scheduling a decode row's input token may still be in flight: it is the token the
    request sampled in the previous step, at row ``prev_row_of[req_id]`` of that step's output.
    ``prev_rows[t]`` names that row (-1: the token is in ``input_ids``) and the step reads it on
    the device.
    """
    t_pad, r_pad = token_bucket, num_rows
    input_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_mapping = np.full(t_pad, -1, np.int32)
    token_slots = np.full(t_pad, padding_slot, np.int32)
    token_is_output = np.zeros(t_pad, np.bool_)
    prev_rows = np.full(t_pad, -1, np.int32)
    block_tables = np.zeros((r_pad, max_blocks_per_seq), np.int32)
    kv_lens = np.zeros(r_pad, np.int32)
    query_start_loc = np.zeros(r_pad + 1, np.int32)
    logits_indices = np.zeros(r_pad, np.int32)
    row_slots = np.full(r_pad, padding_slot, np.int32)
    reset_slots = np.full(r_pad, padding_slot, np.int32)
    samples = []
    t = 0
    for r, (st, n) in enumerate(zip(states, num_scheduled)):
        start = st.num_computed_tokens
        pos = np.arange(start, start + n, dtype=np.int32)
        if n == 1:  # a decode step: no need to build the whole token list
            if start < st.num_tokens:
                input_ids[t] = st.token_at(start)
            else:  # sampled by the step still running
                prev_rows[t] = prev_row_of[st.req_id]
        else:
            all_ids = st.prompt_token_ids + st.output_token_ids if start + n > st.num_prompt_tokens else st.prompt_token_ids
            input_ids[t : t + n] = all_ids[start : start + n]
        positions[t : t + n] = pos
        blocks = np.asarray(st.block_ids, np.int32)
        slot_mapping[t : t + n] = blocks[pos // block_size] * block_size + pos % block_size
        token_slots[t : t + n] = st.slot
        token_is_output[t : t + n] = pos >= st.num_prompt_tokens
        block_tables[r, : len(blocks)] = blocks
        kv_lens[r] = start + n
        t += n
        query_start_loc[r + 1] = t
        logits_indices[r] = t - 1
        row_slots[r] = st.slot
        if st.slot in new_slots:
            reset_slots[r] = st.slot
        samples.append(start + n >= st.num_tokens)
    query_start_loc[len(states) + 1 :] = t
    arrays = {
        "input_ids": input_ids,
        "prev_rows": prev_rows,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "token_slots": token_slots,
        "token_is_output": token_is_output,
        "block_tables": block_tables,
        "kv_lens": kv_lens,
        "query_start_loc": query_start_loc,
        "num_seqs": np.asarray([len(states)], np.int32),
        "logits_indices": logits_indices,
        "row_slots": row_slots,
        "reset_slots": reset_slots,
    }
    return arrays, samples
