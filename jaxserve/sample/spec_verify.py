"""Drafts verified inside the compiled step, for a point-mass (n-gram) proposer.

A row with d drafts is scored at its d+1 last scheduled positions, laid end to end over the step
(every draft is a scheduled token, so a step of T tokens has at most T such positions, and never
more than R*(K+1)); each position becomes one row of the ordinary sampler (``position_rows``: its
request's row gathered, ``positions`` advanced by j, so min-tokens and the draw keys
``fold_in(seed, generated + j)`` are those of a plain step at that point). The sampler then draws
``x_j`` from the target's processed distribution ``p_j`` (greedy rows: its argmax), and
``verify_point_mass`` keeps the drafts while ``x_j == d_j`` and emits ``x_a`` at the first
mismatch ``a`` (or the bonus ``x_K``).

This is exactly the rejection rule of ``rejection_sampler.rejection_sample`` when the proposal is
a point mass q = onehot(d): the draft is accepted with probability ``p(d)`` (= min(1, p(d)/q(d))),
and on a rejection ``x`` is distributed as p without d, renormalised, which is ``norm(max(p - q,
0))``. So every emitted token keeps the target's distribution; greedy output equals plain greedy,
and a seeded row draws each token with the key a plain step would use. The logprobs of position j
are those of ``x_j``, the emitted token there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sample.metadata import SamplingMetadata
from jaxserve.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID
from jaxserve.sample.sampler import SamplerOutput


def position_rows(md: SamplingMetadata, rows: jax.Array, offsets: jax.Array) -> SamplingMetadata:
    """The sampler's rows of the scored positions: position p is request row ``rows[p]``, ``offsets[p]``
    generated tokens later (its j)."""
    gathered = jax.tree.map(lambda x: x[rows], md)
    return dataclasses.replace(gathered, positions=gathered.positions + offsets)


def earlier_drafts(draft_token_ids: jax.Array, rows: jax.Array, offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each scored position's earlier drafts, as the sampler's ``extra_outputs``: position p (row
    ``rows[p]``, j = ``offsets[p]``) is sampled as if ``d_0 .. d_{j-1}`` were generated, which they
    are whenever p's token is emitted (the accepted prefix is exactly those drafts). Returns the
    row's drafts i32[P, K] and which of them count bool[P, K]."""
    k = draft_token_ids.shape[1]
    return draft_token_ids[rows], jnp.arange(k, dtype=jnp.int32)[None, :] < offsets[:, None]


def expand_rows(md: SamplingMetadata, k1: int) -> SamplingMetadata:
    """Every row at ``k1`` positions (row r's at ``r*k1 .. r*k1 + k1-1``)."""
    r = md.positions.shape[0]
    return position_rows(md, jnp.repeat(jnp.arange(r), k1), jnp.tile(jnp.arange(k1, dtype=jnp.int32), r))


def verify_point_mass(sampled: jax.Array, draft_token_ids: jax.Array,
                      num_draft_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``sampled`` [R, K+1]: the target's token at each position; ``draft_token_ids`` [R, K];
    ``num_draft_tokens`` [R] (0..K valid). Returns the emitted ids [R, K+1] (accepted drafts, then
    the target's token, then ``PLACEHOLDER_TOKEN_ID``) and how many per row [R] (1..K+1)."""
    r, k1 = sampled.shape
    pos = jnp.arange(k1, dtype=jnp.int32)
    drafts = jnp.concatenate([draft_token_ids.astype(jnp.int32), jnp.full((r, 1), -1, jnp.int32)], axis=1)
    accept = (drafts == sampled) & (pos[None, :] < num_draft_tokens[:, None])
    # Position K is never accepted, so argmin finds the first rejection in every row.
    num_accepted = jnp.argmin(accept, axis=1).astype(jnp.int32)
    out = jnp.where(pos[None, :] <= num_accepted[:, None], sampled, PLACEHOLDER_TOKEN_ID)
    return out, num_accepted + 1


def verified_output(out: SamplerOutput, flat_index: jax.Array, draft_token_ids: jax.Array,
                    num_draft_tokens: jax.Array) -> tuple[SamplerOutput, jax.Array]:
    """The sampler's output over the scored positions, verified and shaped per request:
    ``sampled_token_ids`` [R, K+1] (placeholders past the emitted ones), logprobs [R, K+1, L],
    ranks [R, K+1]; and the number emitted per row [R]. ``flat_index`` [R, K+1]: row r's position j
    among the scored ones (any of the row's for j past its drafts: never emitted)."""
    tokens, num = verify_point_mass(out.sampled_token_ids[flat_index], draft_token_ids, num_draft_tokens)
    return SamplerOutput(tokens, out.logprobs[flat_index], out.logprob_token_ids[flat_index],
                         out.sampled_token_rank[flat_index]), num
