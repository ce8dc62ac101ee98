"""Per-slot penalty tables kept on the device between steps.

Each request owns a slot (its row): ``output_counts`` counts how often it generated each token,
``prompt_mask`` marks the tokens of its prompt. A row holds the whole prompt and every output of
the request in its slot, whatever the prefix cache served and across preemption:

* when a request that uses penalties is admitted into its slot (first schedule, or resumed after
  preemption), ``write_penalty_row`` replaces the row with the tokens the model will not be fed:
  those whose KV the prefix cache already holds (``num_computed_tokens`` of them);
* every compiled step adds the tokens it feeds (``update_penalty_tables``): the rest of the
  prompt, recomputed outputs, and each new output as the next step's input;
* speculative drafts are fed to the padding slot instead (they may be rejected); after the
  verification the step adds the accepted ones (``add_accepted_drafts``), and while sampling a
  verified position counts the drafts before it on top of the row (``spec_verify.earlier_drafts``).

So by the time a row samples, all of its earlier tokens are counted exactly once. Rows of requests
without penalties are never written from the host and hold whatever their slot accumulated; the
sampler leaves their logits unchanged whatever the row holds. Row ``num_slots`` is the padding
slot, written by padding tokens and never read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.core.sampling_params import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyTables:
    output_counts: jax.Array  # i32[S + 1, V]
    prompt_mask: jax.Array  # bool[S + 1, V]

    @classmethod
    def zeros(cls, num_slots: int, vocab_size: int) -> PenaltyTables:
        shape = (num_slots + 1, vocab_size)
        return cls(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.bool_))


def uses_penalties(params: SamplingParams) -> bool:
    """True if the request's repetition, frequency or presence penalty changes its logits."""
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


def update_penalty_tables(tables: PenaltyTables, *, token_slots: jax.Array, input_ids: jax.Array,
                          token_is_output: jax.Array) -> PenaltyTables:
    """Add this step's tokens: prompt positions set the prompt mask, output positions (including
    recomputed ones after a preemption) add to the counts."""
    counts = tables.output_counts.at[token_slots, input_ids].add(token_is_output.astype(jnp.int32))
    prompt_mask = tables.prompt_mask.at[token_slots, input_ids].max(~token_is_output)
    return PenaltyTables(counts, prompt_mask)


def add_accepted_drafts(tables: PenaltyTables, row_slots: jax.Array, draft_token_ids: jax.Array,
                        num_accepted: jax.Array) -> PenaltyTables:
    """Count each row's accepted drafts as outputs: row r (slot ``row_slots[r]``) accepted its
    first ``num_accepted[r]`` of ``draft_token_ids[r]`` (i32[R, K]). The emitted token after them
    is counted when the next step feeds it, as without speculation."""
    k = draft_token_ids.shape[1]
    accepted = jnp.arange(k, dtype=jnp.int32)[None, :] < num_accepted[:, None]
    counts = tables.output_counts.at[row_slots[:, None], draft_token_ids].add(accepted.astype(jnp.int32))
    return PenaltyTables(counts, tables.prompt_mask)


def write_penalty_row(tables: PenaltyTables, slot: jax.Array, token_ids: jax.Array,
                      token_is_output: jax.Array) -> PenaltyTables:
    """Replace row ``slot`` with the counts and prompt mask of ``token_ids`` (i32[L], -1 unused).

    Fixed shapes (a scalar slot, L tokens), so one compiled program serves every admission.
    """
    vocab_size = tables.output_counts.shape[1]
    valid = token_ids >= 0
    output_cols = jnp.where(valid & token_is_output, token_ids, vocab_size)  # V: out of bounds, dropped
    prompt_cols = jnp.where(valid & ~token_is_output, token_ids, vocab_size)
    counts_row = jnp.zeros((1, vocab_size), jnp.int32).at[0, output_cols].add(1, mode="drop")
    mask_row = jnp.zeros((1, vocab_size), jnp.bool_).at[0, prompt_cols].set(True, mode="drop")
    counts = jax.lax.dynamic_update_slice(tables.output_counts, counts_row, (slot, 0))
    prompt_mask = jax.lax.dynamic_update_slice(tables.prompt_mask, mask_row, (slot, 0))
    return PenaltyTables(counts, prompt_mask)
