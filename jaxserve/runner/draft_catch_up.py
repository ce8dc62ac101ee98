"""The draft model's catch-up after a verifying step, from the step's device outputs: what
``DraftModelProposer.propose`` feeds the draft on the host from each row's known tokens, built
without them, so that the draft can run right after the step, before the host reads its tokens
(the piece overlapping a speculating step with the next needs from the draft-model proposer;
not wired in yet).

A row that ran from position ``s`` (its last known token) with d drafts and accepted a of them
knows ``s + a + 2`` tokens after the step: the drafts it accepted and one more token. The draft
proposed those d drafts from KV up to ``s`` and fed its own first K-1 drafts at ``s + 1 ..``,
so its KV stays valid through the accepted ones among them, ``keep = min(a, K - 1)``; it then
catches up over ``a - keep + 1`` tokens, one or two (the last accepted draft when all K were,
then the target's token), at ``s + 1 + keep ..``, and proposes from the last of them, its
decode loop starting at ``s + a + 2``. So the catch-up has a fixed shape, two tokens a row, the
second masked when unused: one compiled program, no host read of the accepted count.

Invariant (tested against ``DraftModelProposer.propose`` on the true tokens): the positions and
tokens it catches up and where its decode loop starts are the host's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def draft_catch_up(starts: jax.Array, emitted: jax.Array, num_emitted: jax.Array, k: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``starts`` i32[R]: each verifying row's first position in the step (its last known
    token); ``emitted`` i32[R, K+1] and ``num_emitted`` i32[R]: the step's verified output (a + 1
    tokens). Returns the catch-up's ids and positions i32[R, 2], which of the two are real
    bool[R, 2] (the first always), and the decode loop's first position i32[R]."""
    accepted = num_emitted - 1
    keep = jnp.minimum(accepted, k - 1)
    column = keep[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]  # emitted[keep], emitted[keep + 1]
    real = column <= accepted[:, None]
    ids = jnp.take_along_axis(emitted, jnp.minimum(column, emitted.shape[1] - 1), axis=1)
    positions = starts[:, None] + 1 + column
    return jnp.where(real, ids, 0), jnp.where(real, positions, 0), real, starts + accepted + 2
