"""The EAGLE head's catch-up inputs over a target step, from the step's device outputs: what
``EagleProposer.propose`` builds on the host from each row's known tokens after the step, built
without them, so that the head can run right after the step, before the host reads its tokens
(what overlapping a speculating step with the next needs from the EAGLE/EAGLE-3/MTP
proposers; run inside ``EagleProposer.propose_on_device``'s program).

The head's input at position p is the token at p + 1. A row scheduled ``count`` tokens from
``start`` that verified d drafts and emitted e tokens (accepted drafts and one) rejected
``d - (e - 1)`` of them; its first ``valid = count - rejected`` positions are caught up (a row
without drafts: all of them). Position j < valid - 1 reads the step's own token at j + 1 (an
accepted draft, or the next prompt token of a prefill chunk); the last valid one reads the row's
last emitted token if it sampled, else the known token after its chunk (``next_known``, which
the host has: a chunk that does not sample ends inside the prompt or the recomputed tokens).
Positions past ``valid`` write nothing (slot -1, id 0). A sampling row with a valid position
proposes from its last one, unless it is dead (its request left) or skipped (the head missed
its earlier positions: ``EagleProposer.blind``), whose rows the host leaves out altogether.

Invariant (tested against ``EagleProposer.propose`` on the true tokens): the ids, slots,
logits indices and proposing flags are the host's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.runner.spec_in_flight import rejected_drafts, token_rows


def head_catch_up(input_ids: jax.Array, slot_mapping: jax.Array, query_start_loc: jax.Array,
                  emitted: jax.Array, num_emitted: jax.Array, num_drafts: jax.Array, samples: jax.Array,
                  next_known: jax.Array, live: jax.Array, skip: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The step's ``input_ids``/``slot_mapping`` i32[T] (as it ran: in-flight tokens filled,
    positions corrected) and ``query_start_loc`` i32[R+1]; its verified output ``emitted``
    i32[R, K+1] and ``num_emitted`` i32[R] (0 where it did not sample); ``num_drafts`` i32[R] verified per row; per row,
    ``samples`` (it sampled), ``next_known`` (the token after a non-sampling row's chunk),
    ``live`` and ``skip`` (bool[R]). Returns the head's ids and slots i32[T], logits indices
    i32[R] and proposing flags bool[R]."""
    num_tokens, num_rows = input_ids.shape[0], num_drafts.shape[0]
    count = query_start_loc[1:] - query_start_loc[:-1]
    valid = jnp.where(skip, 0, jnp.maximum(count - rejected_drafts(num_emitted, num_drafts), 0))
    row = token_rows(query_start_loc, num_tokens)
    at = jnp.minimum(row, num_rows - 1)
    j = jnp.arange(num_tokens, dtype=jnp.int32) - query_start_loc[at]
    inside = (row < num_rows) & (j < valid[at])
    last_emitted = jnp.take_along_axis(emitted, jnp.maximum(num_emitted - 1, 0)[:, None], axis=1)[:, 0]
    tail = jnp.where(samples, last_emitted, next_known)
    following = jnp.concatenate([input_ids[1:], jnp.zeros(1, input_ids.dtype)])
    ids = jnp.where(j == valid[at] - 1, tail[at], following)
    proposing = samples & live & (valid > 0)
    logits_indices = jnp.where(proposing, query_start_loc[:-1] + valid - 1, 0)
    return jnp.where(inside, ids, 0), jnp.where(inside, slot_mapping, -1), logits_indices, proposing
