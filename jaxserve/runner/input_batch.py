"""The runner's view of the requests it holds, and the padded numpy inputs of one step.

``CachedRequestState`` mirrors what the scheduler told the runner (tokens, computed count) plus
a persistent *slot*: the request's row in ``PersistentBatch`` (block table, tokens), in the
sampling table (parameters, the seed its draws use) and in the device-resident penalty tables.
``build_step_arrays`` turns one ``SchedulerOutput`` into the step's fixed-shape ``ModelInputs``
for a token bucket, gathering from the slot-indexed tables of ``PersistentBatch``; the caller
packs them into one transfer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxserve.runner.step_inputs import ModelInputs, SpecInputs


@dataclasses.dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: Any
    num_computed_tokens: int
    slot: int
    # (token ids, logprobs, rank of the actual token) per prompt position, filled chunk by chunk
    prompt_logprobs_rows: list | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


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


class PersistentBatch:
    """Host-side tables indexed by slot that outlive a step (vLLM's persistent ``InputBatch``).

    Each running request owns one slot (see ``SlotAllocator``); its row holds every token the
    host knows (prompt, then outputs), and its block table. Rows are written when a request is
    admitted and appended to as it grows, so a step's inputs are a few vectorised gathers over
    the scheduled slots instead of per-request Python. Invariants: ``num_tokens[s]`` counts the
    tokens in ``token_ids[s]`` (a token still in flight under async scheduling is not there yet);
    ``block_tables[g, s, :num_blocks[g, s]]`` is the request's block list in KV cache group ``g``
    (``block_table``: group 0's); the padding slot's rows stay all zeros (block 0 is the null block).
    """

    def __init__(self, num_slots: int, max_model_len: int, max_blocks_per_seq: int, num_groups: int = 1):
        rows = num_slots + 1  # + the padding slot
        # one spare column: a request at max_model_len still samples a last token into its row
        self.token_ids = np.zeros((rows, max_model_len + 1), np.int32)
        self.num_tokens = np.zeros(rows, np.int32)
        self.num_prompt_tokens = np.zeros(rows, np.int32)
        self.block_tables = np.zeros((num_groups, rows, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros((num_groups, rows), np.int32)

    @property
    def num_groups(self) -> int:
        return int(self.block_tables.shape[0])

    @property
    def block_table(self) -> np.ndarray:
        """Group 0's block tables ``[rows, P]`` (the only group of a full-attention model)."""
        return self.block_tables[0]

    def add_request(self, slot: int, prompt_token_ids: list[int], output_token_ids: list[int],
                    block_ids: tuple[list[int], ...]) -> None:
        p, o = len(prompt_token_ids), len(output_token_ids)
        self.token_ids[slot, :p] = prompt_token_ids
        self.token_ids[slot, p : p + o] = output_token_ids
        self.num_tokens[slot] = p + o
        self.num_prompt_tokens[slot] = p
        self.block_tables[:, slot] = 0
        self.num_blocks[:, slot] = 0
        self.append_blocks(slot, block_ids)

    def append_blocks(self, slot: int, block_ids: tuple[list[int], ...]) -> None:
        """Each group's new block ids (one list per group)."""
        for g, ids in enumerate(block_ids):
            n = int(self.num_blocks[g, slot])
            self.block_tables[g, slot, n : n + len(ids)] = ids
            self.num_blocks[g, slot] = n + len(ids)

    def append_tokens(self, slots: list[int], tokens: list[int]) -> None:
        """One new token for each of ``slots`` (distinct), as one scatter."""
        if not slots:
            return
        rows = np.asarray(slots, np.intp)
        n = self.num_tokens[rows]
        self.token_ids[rows, n] = tokens
        self.num_tokens[rows] = n + 1


def build_step_arrays(
    batch: PersistentBatch,
    slots: list[int],
    starts: list[int],
    num_scheduled: list[int],
    prev_rows: list[int],
    token_bucket: int,
    num_rows: int,
    block_size: int,
    padding_slot: int,
    num_drafts: list[int] | None = None,
    drafts_in_flight: list[bool] | None = None,
) -> tuple[ModelInputs[np.ndarray], list[bool]]:
    """Model and attention inputs for one step (sampling arrays are added by the caller).

    Row ``r`` is the request in slot ``slots[r]``, scheduled for ``num_scheduled[r]`` tokens from
    position ``starts[r]``. With async scheduling a decode row's input token may still be in
    flight: it is the token that request sampled in the previous step, at row ``prev_rows[r]`` of
    that step's output (-1: none), and the step reads it on the device. Returns the arrays and,
    per row, whether it samples (its prompt, or its recomputation after preemption, is complete).
    ``num_drafts[r]``: speculative drafts the row verifies, written by the caller into its token
    row right after its known tokens (not counted in ``num_tokens``), unless
    ``drafts_in_flight[r]``: then they are placeholders for drafts proposed on the device after
    the previous step (``jaxserve.runner.spec_in_flight``), in flight like the row's other tokens
    past its known ones, and not written. Either way a row's drafts are its last ``num_drafts[r]``
    scheduled tokens.
    """
    t_pad, r_pad = token_bucket, num_rows
    r = len(slots)
    slot = np.asarray(slots, np.int32).reshape(r)
    start = np.asarray(starts, np.int32).reshape(r)
    n = np.asarray(num_scheduled, np.int32).reshape(r)
    query_start_loc = np.zeros(r_pad + 1, np.int32)
    np.cumsum(n, out=query_start_loc[1 : r + 1])
    total = int(query_start_loc[r])
    query_start_loc[r + 1 :] = total
    row = np.repeat(np.arange(r, dtype=np.int32), n)  # each token's row
    pos = start[row] + np.arange(total, dtype=np.int32) - query_start_loc[row]
    tok_slot = slot[row]

    input_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_mapping = np.full(t_pad, -1, np.int32)
    token_slots = np.full(t_pad, padding_slot, np.int32)
    token_is_output = np.zeros(t_pad, np.bool_)
    in_flight = np.full(t_pad, -1, np.int32)
    group_tables = np.zeros((batch.num_groups, r_pad, batch.block_tables.shape[2]), np.int32)
    group_tables[:, :r] = batch.block_tables[:, slot]
    block_tables = group_tables[0]

    known_len = batch.num_tokens[tok_slot]
    drafts = None if num_drafts is None else np.asarray(num_drafts, np.int32).reshape(r)
    if drafts is not None:
        written = drafts if drafts_in_flight is None else np.where(np.asarray(drafts_in_flight, np.bool_), 0, drafts)
        known_len = known_len + written[row]
    known = pos < known_len
    input_ids[:total] = np.where(known, batch.token_ids[tok_slot, pos], 0)
    if not known.all():
        prev = np.asarray(prev_rows, np.int32).reshape(r)[row]
        if (prev[~known] < 0).any():
            raise RuntimeError("a scheduled token is neither known to the host nor in flight")
        in_flight[:total] = np.where(known, -1, prev)
    positions[:total] = pos
    group_slots = np.full((batch.num_groups, t_pad), -1, np.int32)
    group_slots[:, :total] = group_tables[:, row, pos // block_size] * block_size + pos % block_size
    slot_mapping[:total] = group_slots[0, :total]
    token_slots[:total] = tok_slot
    if drafts is not None:  # drafts may be rejected: the step counts the accepted ones itself
        is_draft = np.arange(total, dtype=np.int32) - query_start_loc[row] >= (n - drafts)[row]
        token_slots[:total] = np.where(is_draft, padding_slot, tok_slot)
    token_is_output[:total] = pos >= batch.num_prompt_tokens[tok_slot]

    kv_lens = np.zeros(r_pad, np.int32)
    kv_lens[:r] = start + n
    logits_indices = np.zeros(r_pad, np.int32)
    logits_indices[:r] = query_start_loc[1 : r + 1] - 1
    row_slots = np.full(r_pad, padding_slot, np.int32)
    row_slots[:r] = slot
    samples = (start + n >= batch.num_tokens[slot]).tolist()
    arrays = ModelInputs(
        input_ids=input_ids, prev_rows=in_flight, positions=positions, slot_mapping=slot_mapping,
        token_slots=token_slots, token_is_output=token_is_output, block_tables=block_tables, kv_lens=kv_lens,
        query_start_loc=query_start_loc, num_seqs=np.asarray([r], np.int32), logits_indices=logits_indices,
        row_slots=row_slots, **({} if batch.num_groups == 1 else
                                dict(group_block_tables=group_tables, group_slot_mapping=group_slots)))
    return arrays, samples


def group_block_ids(block_ids: list[int] | tuple[list[int], ...], num_groups: int) -> tuple[list[int], ...]:
    """A request's block ids per KV cache group: a ``KVCacheManager``'s list is the one group's, a
    ``HybridKVCacheManager``'s tuple has one list per group (ids its sliding windows replaced by
    the null block stay in the runner's tables, never read: outside the window)."""
    groups = block_ids if isinstance(block_ids, tuple) else (block_ids,)
    if len(groups) != num_groups:
        raise RuntimeError(f"block ids for {len(groups)} KV cache groups, the runner keeps {num_groups}")
    return groups


def write_drafts(batch: PersistentBatch, slots: list[int], drafts: list[list[int]]) -> None:
    """Each row's drafts into its token row after its known tokens (overwritten as it grows)."""
    for slot, d in zip(slots, drafts):
        if d:
            n = int(batch.num_tokens[slot])
            batch.token_ids[slot, n : n + len(d)] = d


def build_spec_inputs(query_start_loc: np.ndarray, drafts: list[list[int]], num_rows: int,
                      k: int, token_bucket: int) -> SpecInputs[np.ndarray]:
    """Where each row is scored (its last d+1 scheduled tokens, the rows end to end) and its
    drafts, padded to K; padding positions score token 0 for row 0, padding rows verify nothing."""
    r = len(drafts)
    num = np.zeros(num_rows, np.int32)
    num[:r] = [len(d) for d in drafts]
    ids = np.zeros((num_rows, k), np.int32)
    for i, d in enumerate(drafts):
        ids[i, : len(d)] = d
    p_pad = min(token_bucket, num_rows * (k + 1))
    per_row = num[:r] + 1
    start = np.zeros(num_rows, np.int32)
    start[1:r] = np.cumsum(per_row[:-1])
    total = int(per_row.sum())
    row = np.repeat(np.arange(r, dtype=np.int32), per_row)
    offset = np.arange(total, dtype=np.int32) - start[row]
    last = query_start_loc[1 : r + 1] - 1
    indices = np.zeros(p_pad, np.int32)
    indices[:total] = last[row] - num[row] + offset
    rows = np.zeros(p_pad, np.int32)
    rows[:total] = row
    offsets = np.zeros(p_pad, np.int32)
    offsets[:total] = offset
    j = np.arange(k + 1, dtype=np.int32)
    flat = start[:, None] + np.minimum(j[None, :], num[:, None])
    return SpecInputs(logits_indices=indices, position_rows=rows, position_offsets=offsets,
                      flat_index=flat.astype(np.int32), draft_token_ids=ids, num_draft_tokens=num)
