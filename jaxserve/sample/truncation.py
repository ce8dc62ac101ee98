"""Top-k, min-p and top-p as one per-row logit threshold.

Each of the three keeps a prefix of the row's tokens sorted by logit, so together they keep a
prefix too, and the prefix is "every token whose logit >= the last kept one". We therefore find a
threshold per row on a *sorted view* and mask the row in vocabulary order with `>=`: no scatter of
a sorted mask back to vocabulary order. Ties with the threshold are kept (as vLLM's top-k keeps
ties with its k-th value).

Semantics follow vLLM V1 (applied to temperature-scaled logits): min-p first (drop tokens with
p < min_p * p_max), then top-k, then top-p on the distribution renormalised over what survived
(keep the smallest prefix whose mass reaches top_p; the most likely token always stays).

A full sort of V per row is the expensive part. The fast path sorts only the top `cap` logits
(`lax.top_k`), which decides a row whenever its prefix ends inside them: top_k <= cap, or min-p /
top-p cut within the top `cap` (usual for peaked LM distributions), or no truncation at all.
Only if some random row is undecided does `lax.cond` run the full sort, and decided rows keep
their fast-path threshold, so a row's result never depends on whether a batch mate needed it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.sample.policy import WITH_CONDS, SamplerPolicy

# Static size of the partial sort. 256 covers the usual top_k settings (20..100; HF's default 50)
# and the nucleus of a peaked distribution, far cheaper than the full sort (docs/benchmarks.md,
# "The sampler"); 64 saves little more and sends top_k in (64, 256] to the sort.
DEFAULT_TOP_K_CAP = 256


def top_k_sorted(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k`, kept a real partial sort.

    XLA lowers top_k to sort + slice and pattern-matches that back into a TopK kernel; when the
    slice is fused into its consumers first, the match fails and a full sort of V runs instead
    (an order of magnitude slower on the CPU). The barrier keeps the slice intact. It also holds
    ``x``: a barrier over exactly the top-k pair is folded onto the TopK op itself, which XLA:CPU's
    TopK decomposer then fails on (a crash) in a program partitioned over several devices.
    """
    values, ids, _ = lax.optimization_barrier((*lax.top_k(x, k), x))
    return values, ids


# Widest top-k XLA:GPU runs as its TopK kernel; a wider one becomes a sort of the whole row.
GPU_TOP_K_KERNEL_MAX = 16


def top_k_in_rounds(x: jax.Array, k: int, width: int = GPU_TOP_K_KERNEL_MAX) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` as rounds of at most ``width``, each masking the ids it found: on a GPU every
    round is the TopK kernel, where one top-k wider than ``width`` would sort each row. The result
    equals ``lax.top_k`` except among tied -inf entries (their ids may come in another order)."""
    values, ids = [], []
    rows = jnp.arange(x.shape[0])[:, None]
    for start in range(0, k, width):
        v, i = lax.top_k(x, min(width, k - start))
        values.append(v)
        ids.append(i)
        if start + width < k:
            x = x.at[rows, i].set(-jnp.inf)
    return jnp.concatenate(values, axis=-1), jnp.concatenate(ids, axis=-1)


def effective_top_k(top_k: jax.Array, vocab_size: int) -> jax.Array:
    """top_k with 'off' (<= 0) and oversize values mapped to V."""
    return jnp.where((top_k <= 0) | (top_k >= vocab_size), vocab_size, top_k)


def min_p_threshold(row_max: jax.Array, min_p: jax.Array) -> jax.Array:
    """Logit below which p < min_p * p_max: log p_i - log p_max = l_i - l_max (min_p 0 -> -inf)."""
    return row_max + jnp.log(min_p)


def min_p_mass(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """Unnormalised mass (relative to the top token) of the tokens min-p keeps, over all of V."""
    row_max = jnp.max(scaled, axis=-1)
    kept = scaled >= min_p_threshold(row_max, min_p)[:, None]
    return jnp.sum(jnp.where(kept, jnp.exp(scaled - row_max[:, None]), 0.0), axis=-1)


def kept_columns(
    sorted_desc: jax.Array,
    k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    full_min_p_mass: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """(keep bool[R, n], prefix_inside bool[R]) over the leading n sorted logits of each row.

    min-p and top-k keep a prefix; `prefix_inside` says it ends within these n columns, in which
    case its mass (top-p's normaliser) is known here. Otherwise `full_min_p_mass` stands in,
    which is right only when top-k is off.
    """
    n = sorted_desc.shape[-1]
    col = jnp.arange(n)[None, :]
    row_max = sorted_desc[:, :1]
    thr_min_p = min_p_threshold(row_max, min_p[:, None])
    in_prefix = (col < k[:, None]) & (sorted_desc >= thr_min_p)
    # `any` rather than reading column n-1: XLA:CPU turns a slice of top_k's last column into a
    # full sort.
    prefix_inside = (k <= n) | jnp.any(sorted_desc < thr_min_p, axis=-1)
    weights = jnp.where(in_prefix, jnp.exp(sorted_desc - row_max), 0.0)
    mass = jnp.sum(weights, axis=-1)
    if full_min_p_mass is not None:
        mass = jnp.where(prefix_inside, mass, full_min_p_mass)
    mass_before = (jnp.cumsum(weights, axis=-1) - weights) / mass[:, None]
    top_p_keeps = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    return (in_prefix & top_p_keeps) | (col == 0), prefix_inside


def threshold_from_sorted(
    sorted_desc: jax.Array,
    k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    vocab_size: int,
    full_min_p_mass: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(threshold f32[R], decided bool[R]) from the leading n sorted logits of each row.

    `k` is the effective top-k (V when off); `full_min_p_mass` is `min_p_mass` of the whole row.
    With n == V (a full sort) every row is decided.
    """
    n = sorted_desc.shape[-1]
    keep, prefix_inside = kept_columns(sorted_desc, k, top_p, min_p, full_min_p_mass)
    num_kept = jnp.sum(keep, axis=-1)
    last_kept = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)[:, 0]
    top_k_off = k >= vocab_size
    # A top-p cut inside the columns is trustworthy only if its normaliser was right.
    cut_inside = prefix_inside | (top_k_off & (num_kept < n))
    decided = cut_inside | (top_k_off & (top_p >= 1.0))
    # The other decided rows (no top-k, no top-p, min-p keeps > n tokens) keep what min-p keeps.
    row_max = sorted_desc[:, 0]
    min_p_only = jnp.minimum(min_p_threshold(row_max, min_p), row_max)
    return jnp.where(cut_inside, last_kept, min_p_only), decided


def full_sort_threshold(scaled: jax.Array, k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Threshold from a descending sort of the whole row (always decided)."""
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    threshold, _ = threshold_from_sorted(sorted_desc, k, top_p, min_p, scaled.shape[-1])
    return threshold


def truncation_threshold(
    scaled: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    skip: jax.Array,
    cap: int = DEFAULT_TOP_K_CAP,
    policy: SamplerPolicy = WITH_CONDS,
) -> jax.Array:
    """Per-row logit threshold for top-k/min-p/top-p on temperature-scaled logits f32[R, V].

    `skip` marks rows whose threshold is not used (greedy), so they never force the full sort.
    A cond-free ``policy``: every row from the full sort, with no conditional. XLA:GPU lowers a
    top-k wider than 16 to a sort of the whole row anyway, so the partial sort saves nothing there.
    """
    vocab_size = scaled.shape[-1]
    k = effective_top_k(top_k, vocab_size)
    if policy.full_sort_only:
        return full_sort_threshold(scaled, k, top_p, min_p)
    top_vals, _ = top_k_sorted(scaled, min(cap, vocab_size))
    fast, decided = threshold_from_sorted(
        top_vals, k, top_p, min_p, vocab_size, full_min_p_mass=min_p_mass(scaled, min_p)
    )
    return lax.cond(
        jnp.all(decided | skip),
        lambda: fast,
        lambda: jnp.where(decided, fast, full_sort_threshold(scaled, k, top_p, min_p)),
    )


def truncate(scaled: jax.Array, threshold: jax.Array) -> jax.Array:
    """Logits below the row threshold become -inf."""
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
