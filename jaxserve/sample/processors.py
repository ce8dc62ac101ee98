"""Logits processors that can change the greedy choice: the structured-output token bitmask,
allowed tokens, min tokens, logit bias, penalties.

All take and return f32[R, V] and act per row, vectorised over the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.sample.policy import WITH_CONDS, SamplerPolicy


def _scatter_indices(token_ids: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """(row, column) index arrays for a sparse [R, W] id table; unused slots (-1) point past V.

    JAX scatters wrap negative indices like numpy, so -1 would hit token V-1; V is out of bounds
    and `mode='drop'` discards it.
    """
    rows = jnp.arange(token_ids.shape[0])[:, None]
    cols = jnp.where(token_ids >= 0, token_ids, vocab_size)
    return rows, cols


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array, use_bitmask: jax.Array | bool,
                        policy: SamplerPolicy = WITH_CONDS) -> jax.Array:
    """Structured outputs: token ``t`` of row ``r`` keeps its logit iff bit ``t % 32`` of word
    ``bitmask[r, t // 32]`` is set (llguidance's layout), else -inf. A row of all ones (-1) is
    unconstrained. Not applied when ``use_bitmask`` is False (with conds, its [R, V] pass is
    skipped)."""

    def on():
        r, v = logits.shape
        bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
        allowed = bits.reshape(r, -1)[:, :v] != 0
        return jnp.where(allowed, logits, -jnp.inf)

    return policy.select(jnp.asarray(use_bitmask, jnp.bool_), on, lambda: logits)


def apply_allowed_token_ids(logits: jax.Array, allowed_token_ids: jax.Array, has_allowed: jax.Array) -> jax.Array:
    """Rows with `has_allowed` keep only their listed tokens; every other logit becomes -inf."""
    vocab_size = logits.shape[-1]
    rows, cols = _scatter_indices(allowed_token_ids, vocab_size)
    allowed = jnp.zeros(logits.shape, jnp.bool_).at[rows, cols].set(True, mode="drop")
    keep = allowed | ~has_allowed[:, None]
    return jnp.where(keep, logits, -jnp.inf)


def apply_logit_bias(logits: jax.Array, bias_token_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """Add each row's sparse bias to the logits of its listed tokens."""
    rows, cols = _scatter_indices(bias_token_ids, logits.shape[-1])
    return logits.at[rows, cols].add(bias_values, mode="drop")


def min_tokens_rows(positions: jax.Array, min_tokens: jax.Array) -> jax.Array:
    """Rows that have generated fewer than their ``min_tokens`` outputs."""
    return positions < min_tokens


def apply_min_tokens(logits: jax.Array, positions: jax.Array, min_tokens: jax.Array,
                     stop_ids: jax.Array) -> jax.Array:
    """vLLM's min-tokens processor: a row short of its ``min_tokens`` outputs cannot sample its stop
    or EOS ids (-inf), so it never ends early instead of merely not stopping on them."""
    ids = jnp.where(min_tokens_rows(positions, min_tokens)[:, None], stop_ids, -1)
    rows, cols = _scatter_indices(ids, logits.shape[-1])
    return logits.at[rows, cols].set(-jnp.inf, mode="drop")


def restrictions_active(allowed_token_ids: jax.Array, has_allowed: jax.Array, bias_token_ids: jax.Array,
                        positions: jax.Array, min_tokens: jax.Array) -> jax.Array:
    """True if any row has an allowed-token list, a logit bias or a min_tokens still to reach."""
    return jnp.any(has_allowed) | jnp.any(bias_token_ids >= 0) | jnp.any(min_tokens_rows(positions, min_tokens))


def apply_restrictions(
    logits: jax.Array,
    allowed_token_ids: jax.Array,
    has_allowed: jax.Array,
    bias_token_ids: jax.Array,
    bias_values: jax.Array,
    positions: jax.Array,
    min_tokens: jax.Array,
    min_tokens_stop_ids: jax.Array,
    policy: SamplerPolicy = WITH_CONDS,
) -> jax.Array:
    """Allowed-token mask, min-tokens mask, then logit bias (vLLM's order); with conds skipped
    (three [R, V] passes) when no row uses any of them. Rows that use none are left unchanged."""

    def on():
        masked = apply_allowed_token_ids(logits, allowed_token_ids, has_allowed)
        masked = apply_min_tokens(masked, positions, min_tokens, min_tokens_stop_ids)
        return apply_logit_bias(masked, bias_token_ids, bias_values)

    return policy.skip_unless(
        lambda: restrictions_active(allowed_token_ids, has_allowed, bias_token_ids, positions, min_tokens),
        on, lambda: logits)


def penalties_active(presence: jax.Array, frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """True if any row has a penalty that changes its logits."""
    return jnp.any((presence != 0) | (frequency != 0) | (repetition != 1))


def penalize(
    logits: jax.Array,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    presence: jax.Array,
    frequency: jax.Array,
    repetition: jax.Array,
) -> jax.Array:
    """vLLM's penalties, unconditionally.

    repetition: tokens seen in the prompt or the output have positive logits divided by the
    penalty and non-positive ones multiplied (so p > 1 always discourages them);
    frequency: minus f * (times generated); presence: minus p * (generated at all).
    Frequency and presence count output tokens only.
    """
    counts = output_counts.astype(jnp.float32)
    generated = output_counts > 0
    rep = jnp.where(prompt_mask | generated, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * generated.astype(jnp.float32)


def apply_penalties(
    logits: jax.Array,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    presence: jax.Array,
    frequency: jax.Array,
    repetition: jax.Array,
    row_slots: jax.Array | None = None,
    policy: SamplerPolicy = WITH_CONDS,
    extra_outputs: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """`penalize`, skipped (with the reads of the [R, V] count and mask tables) when all are off.

    With ``row_slots``, ``output_counts``/``prompt_mask`` are the runner's per-slot tables and
    the rows are gathered inside the taken branch, so a batch without penalties never reads them.
    ``extra_outputs`` (ids i32[R, K], mask bool[R, K]): more output tokens per row, counted on top
    of the tables (a verified position's earlier drafts, which the tables do not hold yet).
    Neutral penalties (0, 0, 1) leave a row unchanged, so a cond-free policy always applies it.
    """

    def on():
        counts, mask = output_counts, prompt_mask
        if row_slots is not None:
            counts, mask = counts[row_slots], mask[row_slots]
        if extra_outputs is not None:
            ids, valid = extra_outputs
            counts = counts.at[jnp.arange(ids.shape[0])[:, None], ids].add(valid.astype(counts.dtype))
        return penalize(logits, counts, mask, presence, frequency, repetition)

    return policy.skip_unless(lambda: penalties_active(presence, frequency, repetition), on, lambda: logits)
