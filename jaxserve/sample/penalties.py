"""Per-slot penalty tables kept on the device between steps.

Each request owns a slot (its row): ``output_counts`` counts how often it generated each token,
``prompt_mask`` marks the tokens of its prompt. The compiled step feeds every scheduled token
into its request's row; the sampler's repetition, frequency and presence penalties read them.
Row ``num_slots`` is the padding slot, written by padding tokens and never read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyTables:
    output_counts: jax.Array  # i32[S + 1, V]
    prompt_mask: jax.Array  # bool[S + 1, V]

    @classmethod
    def zeros(cls, num_slots: int, vocab_size: int) -> "PenaltyTables":
        shape = (num_slots + 1, vocab_size)
        return cls(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.bool_))


def update_penalty_tables(tables: PenaltyTables, *, reset_slots: jax.Array, token_slots: jax.Array,
                          input_ids: jax.Array, token_is_output: jax.Array, cond_free: bool = False) -> PenaltyTables:
    """Clear the rows of ``reset_slots`` (new requests), then add this step's tokens.

    Prompt positions set the prompt mask, output positions (including recomputed ones after a
    preemption) add to the counts. By the time a row samples, all of its earlier outputs have
    been fed back as inputs, so the counts are exact without any host-side bookkeeping.
    ``cond_free`` (static): clear without a data-dependent loop (the GPU step).
    """
    clear = _clear_slots_scatter if cond_free else _clear_slots
    counts, prompt_mask = clear(tables.output_counts, tables.prompt_mask, reset_slots)
    counts = counts.at[token_slots, input_ids].add(token_is_output.astype(jnp.int32))
    prompt_mask = prompt_mask.at[token_slots, input_ids].max(~token_is_output)
    return PenaltyTables(counts, prompt_mask)


def _clear_slots(counts: jax.Array, prompt_mask: jax.Array, reset_slots: jax.Array):
    """Zero the rows of ``reset_slots`` (new requests first, then the padding slot).

    A loop that stops at the first padding entry: most steps admit no request and pay nothing,
    where a scatter of [R, V] zeros would write the whole update every step.
    """
    padding_slot = counts.shape[0] - 1
    n, v = reset_slots.shape[0], counts.shape[1]

    def more(carry):
        i = carry[0]
        return (i < n) & (reset_slots[jnp.minimum(i, n - 1)] != padding_slot)

    def clear(carry):
        i, c, m = carry
        row = (reset_slots[i], 0)
        c = jax.lax.dynamic_update_slice(c, jnp.zeros((1, v), c.dtype), row)
        m = jax.lax.dynamic_update_slice(m, jnp.zeros((1, v), m.dtype), row)
        return i + 1, c, m

    _, counts, prompt_mask = jax.lax.while_loop(more, clear, (jnp.int32(0), counts, prompt_mask))
    return counts, prompt_mask


def _clear_slots_scatter(counts: jax.Array, prompt_mask: jax.Array, reset_slots: jax.Array):
    """``_clear_slots`` as one scatter: padding entries point past the table and are dropped, so
    only the new requests' rows are written, and no loop condition is read on the host."""
    rows = jnp.where(reset_slots == counts.shape[0] - 1, counts.shape[0], reset_slots)
    return counts.at[rows].set(0, mode="drop"), prompt_mask.at[rows].set(False, mode="drop")
