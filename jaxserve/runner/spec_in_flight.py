"""A speculating step's successor built before its verification is known: the device-side
correction of step N+1's inputs from step N's outputs (vLLM's async scheduling with
speculative decoding, where each running request books its bonus token and its K drafts as
placeholders).

The host builds N+1 as if every draft N verifies were accepted: a row that N verified with d
drafts continues at ``start + d + 1``, and its scheduled tokens (N's bonus token, then the K
drafts proposed after N) are all in flight (``ModelInputs.prev_rows`` >= 0). Inside the step,
before the forward, these functions move each such row back by the drafts N rejected and fill
its tokens from N's outputs, reading device arrays only, so the host never waits for N:

- ``rejected_per_row``: each row's rejected count, from N's emitted count and draft count at
  the row it had in N;
- ``shift_rows``: positions, slot mapping (every KV cache group's) and ``kv_lens`` moved back
  by it; the blocks are the ones the host booked (a superset: rejection only shortens a row);
- ``in_flight_ids``: the in-flight tokens read from N's [bonus, drafts] per row, the j-th
  in-flight token of a row taking column j.

Invariant (tested against ``build_step_arrays`` on the true tokens): for every row, shifting
the optimistic inputs by the true rejected counts and filling the in-flight ids gives exactly
the inputs the host would have built had it waited for N. Rows N did not verify (prefill
chunks, new requests, plain decodes) have a rejected count of 0 and keep their inputs.

The scheduler's side is ``SchedulerConfig.draft_placeholders``; the runner carries N's counts and
the drafts the EAGLE head proposed after N in ``DeviceState`` and calls :func:`correct_in_flight`
at the top of every step when :func:`overlaps_speculation` holds (the other proposers run on the
host after N's tokens are read, so their engines still collect N first).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.config.speculative import HEAD_METHODS
from jaxserve.runner.step_inputs import ModelInputs, StepArrays


def overlaps_speculation(config: EngineConfig) -> bool:
    """True if a speculating step overlaps with the next (vLLM's async scheduling with
    placeholders for drafts not yet known): async scheduling with an EAGLE/EAGLE-3/MTP head, whose
    drafts are proposed on the device right after each step, on one node."""
    spec = config.spec_decode_config.spec
    return (config.scheduler_config.async_scheduling and spec is not None and spec.method in HEAD_METHODS
            and not config.is_multi_node)


def rejected_drafts(num_emitted: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """The drafts a verifying step rejected per row: ``num_drafts`` verified, ``num_emitted``
    tokens emitted (accepted drafts + 1). Only a row with drafts rejects any (a row that did not
    sample may count 0 emitted)."""
    return jnp.where(num_drafts > 0, jnp.maximum(num_drafts - (num_emitted - 1), 0), 0).astype(jnp.int32)


def rejected_per_row(prev_rows: jax.Array, num_emitted: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """``prev_rows`` i32[R]: each row's row in step N (-1: not in N); ``num_emitted`` i32[R_N]
    and ``num_drafts`` i32[R_N]: N's tokens emitted per row (as ``spec_verify.verified_output``
    counts them) and drafts verified. Returns i32[R], the drafts N rejected for each row (0 for a
    row not in N or not verified there)."""
    at = jnp.maximum(prev_rows, 0)
    return jnp.where(prev_rows >= 0, rejected_drafts(num_emitted[at], num_drafts[at]), 0)


def token_rows(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """Each of ``num_tokens`` token's row; padding tokens past the last real one get R (the
    rows of ``query_start_loc`` i32[R+1] past ``num_seqs`` end where the real tokens end)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)


def shift_rows(x: ModelInputs[jax.Array], rejected: jax.Array, block_size: int) -> ModelInputs[jax.Array]:
    """``x`` with each row's tokens moved ``rejected[r]`` positions back: positions, slot mapping
    (read again from the row's block table at the new position, for every KV cache group) and
    ``kv_lens``. Padding tokens keep slot -1 and padding rows ``kv_lens`` 0."""
    num_rows = x.kv_lens.shape[0]
    row = token_rows(x.query_start_loc, x.positions.shape[0])
    real = row < x.num_seqs[0]
    at = jnp.minimum(row, num_rows - 1)
    positions = x.positions - jnp.where(real, rejected[at], 0)

    def slots(tables: jax.Array) -> jax.Array:  # tables: [R, P]
        page = jnp.take_along_axis(tables[at], (positions // block_size)[:, None], axis=1)[:, 0]
        return jnp.where(real, page * block_size + positions % block_size, -1)

    group_slots = None
    if x.group_block_tables is not None:
        group_slots = jax.vmap(slots)(x.group_block_tables)
    live = jnp.arange(num_rows) < x.num_seqs[0]
    return dataclasses.replace(
        x, positions=jnp.where(real, positions, x.positions), slot_mapping=slots(x.block_tables),
        kv_lens=jnp.where(live, x.kv_lens - rejected, x.kv_lens), group_slot_mapping=group_slots)


def in_flight_ids(x: ModelInputs[jax.Array], prev_tokens: jax.Array) -> jax.Array:
    """``x.input_ids`` with every in-flight token (``prev_rows`` >= 0) read from
    ``prev_tokens`` i32[R_N, K+1] (step N's bonus token, then the drafts proposed after N, per
    row of N): the j-th in-flight token of a row reads column j of its row of N."""
    row = token_rows(x.query_start_loc, x.input_ids.shape[0])
    flying = x.prev_rows >= 0
    seen = jnp.cumsum(flying.astype(jnp.int32))  # in-flight tokens up to and including each one
    row_start = x.query_start_loc[jnp.minimum(row, x.kv_lens.shape[0])]
    before_row = jnp.concatenate([jnp.zeros(1, jnp.int32), seen])[row_start]  # in-flight before the row
    column = jnp.clip(seen - 1 - before_row, 0, prev_tokens.shape[1] - 1)
    read = prev_tokens[jnp.maximum(x.prev_rows, 0), column]
    return jnp.where(flying, read, x.input_ids)


def row_prev_rows(x: ModelInputs[jax.Array]) -> jax.Array:
    """Each row's row in step N (-1: none, and for padding rows), read at its last scheduled
    token: that is in flight whenever any of the row's tokens is (a row resumed after preemption
    has its known tokens first, then the one N sampled)."""
    num_rows = x.kv_lens.shape[0]
    last = jnp.maximum(x.query_start_loc[1:] - 1, 0)
    live = jnp.arange(num_rows) < x.num_seqs[0]
    return jnp.where(live, x.prev_rows[last], -1).astype(jnp.int32)


def in_flight_drafts(draft_token_ids: jax.Array, prev_rows: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """``draft_token_ids`` i32[R, K] with each placeholder (``DRAFT_PLACEHOLDER``, -1: proposed
    after step N, still on the device) read from ``prev_tokens`` i32[R_N, K+1] at its row of N:
    draft j is the row's in-flight token j + 1 (its bonus token is the first)."""
    k = draft_token_ids.shape[1]
    read = prev_tokens[jnp.maximum(prev_rows, 0)][:, 1:k + 1]
    return jnp.where((draft_token_ids < 0) & (prev_rows >= 0)[:, None], read, draft_token_ids)


def correct_in_flight(inputs: StepArrays[jax.Array], prev_tokens: jax.Array, num_emitted: jax.Array,
                      num_drafts: jax.Array, block_size: int) -> StepArrays[jax.Array]:
    """A step built as if every draft of step N were accepted, made the step the host would
    have built after N: rows moved back by N's rejected drafts (:func:`shift_rows`), in-flight
    ids and drafts filled from ``prev_tokens`` (N's bonus token and the drafts proposed after
    it, per row of N), and each row's generated-token count (the sampler's draw key) lowered by
    its rejected drafts. ``num_emitted``/``num_drafts`` i32[R_N]: N's per row. The result reads
    nothing in flight any more (``prev_rows`` all -1)."""
    x = inputs.model
    prev_rows = row_prev_rows(x)
    rejected = rejected_per_row(prev_rows, num_emitted, num_drafts)
    model = dataclasses.replace(shift_rows(x, rejected, block_size), input_ids=in_flight_ids(x, prev_tokens),
                                prev_rows=jnp.full_like(x.prev_rows, -1))
    sampling = dataclasses.replace(inputs.sampling, positions=inputs.sampling.positions - rejected)
    spec = inputs.spec
    if spec is not None:
        spec = dataclasses.replace(spec, draft_token_ids=in_flight_drafts(spec.draft_token_ids, prev_rows,
                                                                           prev_tokens))
    return dataclasses.replace(inputs, model=model, sampling=sampling, spec=spec)
