"""The speculative-decoding rejection sampler (vLLM's ``v1/sample/rejection_sampler.py``).

The target scores K+1 positions per request: after its last known token and after each of its
K drafts. Position i accepts draft ``d_i``
  * greedy rows: when ``d_i`` is the target's argmax there (so output equals plain greedy);
  * random rows: with probability ``min(1, p_i(d_i) / q_i(d_i))`` (Leviathan et al. 2023, Chen et
    al. 2023), where p is the target's processed distribution and q the proposer's. An n-gram
    proposer is a point mass (q(d) = 1).
At the first rejected position the token is drawn from ``norm(max(p - q, 0))`` instead; when every
draft is accepted, a bonus token is drawn from p at position K. Every emitted token is then
distributed exactly as the target's own sample. Rows with fewer than K drafts treat the missing
ones as rejected with q = 0, so their "recovered" token is a plain draw from p: one code path.
Every shape is static (K is fixed at compile time); randomness comes from one key per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PLACEHOLDER_TOKEN_ID = -1  # the output's padding after the last emitted token


def rejection_sample(target_logits: jax.Array, draft_token_ids: jax.Array,
                     num_draft_tokens: jax.Array, greedy: jax.Array, keys: jax.Array,
                     draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Verify the drafts of R rows.

    ``target_logits`` [R, K+1, V]: processed logits (temperature, truncation applied) at the K+1
    positions; ``draft_token_ids`` [R, K] int32; ``num_draft_tokens`` [R] (0..K valid drafts,
    the rest ignored); ``greedy`` [R] bool; ``keys`` [R] PRNG keys (one per row, so a seeded row
    is reproducible); ``draft_probs`` [R, K, V] or None for a point-mass proposer (n-gram).
    Returns the output ids [R, K+1] (the accepted drafts, then one drawn token, then
    ``PLACEHOLDER_TOKEN_ID``) and the number emitted per row [R] (1..K+1).
    """
    r, k1, v = target_logits.shape
    pos = jnp.arange(k1, dtype=jnp.int32)
    drafts = jnp.concatenate(
        [draft_token_ids.astype(jnp.int32), jnp.zeros((r, 1), jnp.int32)], axis=1)  # [R, K+1]
    valid = pos[None, :] < num_draft_tokens[:, None]
    target_probs = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    p_d = jnp.take_along_axis(target_probs, drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q = jax.nn.one_hot(drafts, v, dtype=jnp.float32)
        q_d = jnp.ones((r, k1), jnp.float32)
    else:
        q = jnp.concatenate([draft_probs.astype(jnp.float32), jnp.zeros((r, 1, v), jnp.float32)], axis=1)
        q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    q = q * valid[..., None]  # a missing draft has q = 0: its residual is p itself

    split = jax.vmap(lambda key: jax.random.split(key, 2))(keys)
    uniform = jax.vmap(lambda key: jax.random.uniform(key, (k1,)))(split[:, 0])
    argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [R, K+1], first maximum
    accept = jnp.where(greedy[:, None], drafts == argmax, uniform * q_d < p_d) & valid
    # Leading accepted drafts: position K is never valid, so there is always a first rejection.
    num_accepted = jnp.argmin(accept, axis=1).astype(jnp.int32)

    p_at = jnp.take_along_axis(target_probs, num_accepted[:, None, None], axis=1)[:, 0]
    q_at = jnp.take_along_axis(q, num_accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    # p == q on the support leaves nothing to draw from (then a rejection had probability 0).
    residual = jnp.where(total > 0, residual, p_at)
    drawn = jax.vmap(jax.random.categorical)(split[:, 1], jnp.log(residual)).astype(jnp.int32)
    chosen = jnp.where(greedy, jnp.take_along_axis(argmax, num_accepted[:, None], axis=1)[:, 0], drawn)

    out = jnp.where(pos[None, :] < num_accepted[:, None], drafts, PLACEHOLDER_TOKEN_ID)
    out = jnp.where(pos[None, :] == num_accepted[:, None], chosen[:, None], out)
    return out, num_accepted + 1
