"""The on-device sampler: one call per compiled step, every shape static.

Order (vLLM V1's sampler, `vllm/v1/sample/sampler.py`):
  1. raw logprobs: log_softmax of the model's logits before any processing (vLLM's default
     `logprobs_mode='raw_logprobs'`); the returned logprobs, top-K and rank all use these;
  2. the structured-output bitmask (first, so every later step sees only tokens the grammar
     allows), allowed-token mask, min-tokens mask (stop and EOS ids while a row is short of its
     `min_tokens`), then logit bias (all can change the greedy choice);
  3. penalties: repetition (prompt + output tokens), frequency and presence (output tokens only).
     As in vLLM, penalties come after the bias, so a repetition penalty divides a biased logit;
  4. greedy rows (temperature < SAMPLING_EPS) take the argmax of the processed logits;
  5. random rows: divide by temperature, min-p, top-k, top-p (see `truncation`), then draw with
     `jax.random.categorical` from key `fold_in(PRNGKey(seed), position)`, vmapped per row, so a
     seeded request's token depends only on its own logits, seed and position.

One pipeline, whose control flow a ``SamplerPolicy`` (:mod:`.policy`, built by the runner's
``StepTarget``) fixes. With conds (the CPU step) the common batches stay cheap: a batch that is
all greedy with nothing to process and no logprobs takes only the argmax; otherwise an all-greedy
batch skips step 5 entirely, a batch without penalties skips reading the [R, V] count and mask
tables, and a batch without allowed lists, min-tokens rows or logit bias skips those three [R, V]
passes. Cond-free (the GPU step, ``jaxserve/runner/target.py`` says why) the host, which knows
whether every row is greedy, gets a program with or without step 5; everything else runs as
selects, and the random rows' truncation sorts every row. Both take the greedy token with
``first_argmax``, so ties resolve the same way; the policy never changes a result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.core.sampling_params import SAMPLING_EPS
from jaxserve.sample.metadata import SamplingMetadata
from jaxserve.sample.policy import WITH_CONDS, SamplerPolicy
from jaxserve.sample.processors import (
    apply_penalties,
    apply_restrictions,
    apply_token_bitmask,
    penalties_active,
    restrictions_active,
)
from jaxserve.sample.truncation import (
    DEFAULT_TOP_K_CAP,
    top_k_in_rounds,
    top_k_sorted,
    truncate,
    truncation_threshold,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """K = max_num_logprobs (static). Column 0 of the logprob arrays is the sampled token."""

    sampled_token_ids: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R, K+1]: [logprob of sampled token, top-K logprobs (descending)]
    logprob_token_ids: jax.Array  # i32[R, K+1]: [sampled token, top-K token ids]
    sampled_token_rank: jax.Array  # i32[R]: 1 + number of tokens with a higher raw logprob


def process_logits(
    logits: jax.Array, md: SamplingMetadata, output_counts: jax.Array, prompt_mask: jax.Array,
    row_slots: jax.Array | None = None, token_bitmask: jax.Array | None = None,
    use_bitmask: jax.Array | None = None, policy: SamplerPolicy = WITH_CONDS,
    extra_outputs: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Steps 2-3: the logits both greedy and random rows choose from."""
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask, True if use_bitmask is None else use_bitmask, policy)
    logits = apply_restrictions(logits, md.allowed_token_ids, md.has_allowed, md.bias_token_ids, md.bias_values,
                                md.positions, md.min_tokens, md.min_tokens_stop_ids, policy)
    return apply_penalties(
        logits, output_counts, prompt_mask, md.presence_penalty, md.frequency_penalty, md.repetition_penalty,
        row_slots, policy, extra_outputs,
    )


def first_argmax(x: jax.Array, segment: int = 128) -> jax.Array:
    """``jnp.argmax`` over the last axis (first index of the maximum), as int32.

    XLA:CPU lowers argmax to a variadic (value, index) reduce, several times slower than plain
    reductions. Here the row is cut into segments of ``segment``: the row's max comes from the
    segments' maxima, then only the first segment holding it is searched for the index. A row
    holding NaN gives some index in range.
    """
    r, v = x.shape
    nseg = -(-v // segment)
    if nseg * segment != v:  # pad with -inf, which never wins unless the whole row is -inf
        x = jnp.pad(x, ((0, 0), (0, nseg * segment - v)), constant_values=-jnp.inf)
    seg = x.reshape(r, nseg, segment)
    seg_max = jnp.max(seg, axis=-1)
    row_max = jnp.max(seg_max, axis=-1, keepdims=True)
    first_seg = jnp.min(jnp.where(seg_max == row_max, jnp.arange(nseg, dtype=jnp.int32), nseg), axis=-1)
    first_seg = jnp.minimum(first_seg, nseg - 1)
    values = jnp.take_along_axis(seg, first_seg[:, None, None], axis=1)[:, 0]
    offset = jnp.min(jnp.where(values == row_max, jnp.arange(segment, dtype=jnp.int32), segment), axis=-1)
    return jnp.minimum(first_seg * segment + offset, v - 1)


def greedy_rows(temperature: jax.Array) -> jax.Array:
    return temperature < SAMPLING_EPS


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per row: fold_in(PRNGKey(seed), position)."""
    return jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.PRNGKey(seed), pos))(seeds, positions)


def draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One categorical draw per row, each from its own key (vmapped, so rows never share noise)."""
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def sample_random(processed: jax.Array, md: SamplingMetadata, top_k_cap: int,
                  policy: SamplerPolicy = WITH_CONDS) -> jax.Array:
    """Step 5 for every row (greedy rows' results are discarded by the caller)."""
    greedy = greedy_rows(md.temperature)
    temperature = jnp.where(greedy, 1.0, md.temperature)
    scaled = processed / temperature[:, None]
    threshold = truncation_threshold(scaled, md.top_k, md.top_p, md.min_p, skip=greedy, cap=top_k_cap,
                                     policy=policy)
    return draw(row_keys(md.seeds, md.positions), truncate(scaled, threshold))


def choose_tokens(processed: jax.Array, md: SamplingMetadata, top_k_cap: int,
                  policy: SamplerPolicy = WITH_CONDS) -> jax.Array:
    """Steps 4-5; an all-greedy batch never pays for the top-k/sort and the random draw (the
    host's ``policy.all_greedy``, else a cond on the device)."""
    greedy = greedy_rows(md.temperature)
    greedy_ids = first_argmax(processed)
    if policy.all_greedy:
        return greedy_ids

    def mixed():
        return jnp.where(greedy, greedy_ids, sample_random(processed, md, top_k_cap, policy))

    return mixed() if policy.all_greedy is False else lax.cond(jnp.all(greedy), lambda: greedy_ids, mixed)


def gather_logprobs(logits: jax.Array, sampled: jax.Array, num_logprobs: int,
                    policy: SamplerPolicy = WITH_CONDS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logprobs f32[R, K+1], token ids i32[R, K+1], rank i32[R]) from the raw logits.

    The [R, V] log_softmax is never stored: top-K runs on the logits (same order) and the
    normaliser is subtracted from the K+1 gathered values; the rank compare fuses it in.
    A cond-free ``policy`` (the GPU step): top-K in rounds of XLA:GPU's TopK kernel, not a sort.
    """
    normaliser = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    sampled_col = sampled[:, None]
    sampled_logprob = jnp.take_along_axis(logits, sampled_col, axis=-1) - normaliser
    rank = jnp.sum(logits - normaliser > sampled_logprob, axis=-1).astype(jnp.int32) + 1
    if num_logprobs == 0:
        return sampled_logprob, sampled_col, rank
    top_k = top_k_in_rounds if policy.cond_free else top_k_sorted
    top_logits, top_ids = top_k(logits, num_logprobs)
    logprobs = jnp.concatenate([sampled_logprob, top_logits - normaliser], axis=-1)
    token_ids = jnp.concatenate([sampled_col, top_ids.astype(jnp.int32)], axis=-1)
    return logprobs, token_ids, rank


def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    *,
    max_num_logprobs: int,
    top_k_cap: int = DEFAULT_TOP_K_CAP,
    row_slots: jax.Array | None = None,
    need_logprobs: jax.Array | None = None,
    token_bitmask: jax.Array | None = None,
    use_bitmask: jax.Array | None = None,
    policy: SamplerPolicy = WITH_CONDS,
    extra_outputs: tuple[jax.Array, jax.Array] | None = None,
) -> SamplerOutput:
    """Sample one token per row of logits [R, V] (any float dtype; computed in f32).

    output_counts: i32[R, V], times each token was generated by the row's request;
    prompt_mask: bool[R, V], tokens in the row's prompt. Both may be all-zero when no row uses a
    penalty. With ``row_slots`` they are instead per-slot tables [S, V] and row i reads slot
    ``row_slots[i]`` (only when some row uses a penalty). ``need_logprobs`` (traced bool): when
    False the logprob outputs are zeros (with conds their [R, V] passes are skipped).
    ``token_bitmask`` (i32[R, ceil(V/32)], structured outputs) masks each row's logits first when
    ``use_bitmask`` (traced bool) is True; logprobs stay those of the raw logits.
    ``extra_outputs`` (ids i32[R, K], mask bool[R, K]): output tokens each row's penalties count on
    top of ``output_counts`` (a speculative position's earlier drafts).
    `max_num_logprobs` and `top_k_cap` are static; ``policy`` (static) decides the control flow
    (:mod:`.policy`), never the result.
    """
    logits = logits.astype(jnp.float32)
    r = logits.shape[0]
    k = max_num_logprobs + 1 if max_num_logprobs else 1

    def no_logprobs():
        return jnp.zeros((r, k), jnp.float32), jnp.zeros((r, k), jnp.int32), jnp.zeros((r,), jnp.int32)

    def full() -> SamplerOutput:
        processed = process_logits(logits, md, output_counts, prompt_mask, row_slots, token_bitmask, use_bitmask,
                                   policy, extra_outputs)
        sampled = choose_tokens(processed, md, top_k_cap, policy)
        with_logprobs = lambda: gather_logprobs(logits, sampled, max_num_logprobs, policy)  # noqa: E731
        if need_logprobs is None:
            return SamplerOutput(sampled, *with_logprobs())
        return SamplerOutput(sampled, *policy.select(jnp.asarray(need_logprobs, jnp.bool_), with_logprobs,
                                                     no_logprobs))

    if need_logprobs is None or policy.cond_free:
        return full()
    # The common batch (all greedy, nothing to process, no logprobs) takes the argmax and nothing
    # else. One cond around everything also spares a copy of the [R, V] logits: the processing
    # conds cannot update the logits in place while the raw ones stay alive for logprobs.
    bitmask_on = jnp.asarray(token_bitmask is not None if use_bitmask is None else use_bitmask, jnp.bool_)
    plain = (~jnp.asarray(need_logprobs, jnp.bool_) & ~bitmask_on & jnp.all(greedy_rows(md.temperature))
             & ~restrictions_active(md.allowed_token_ids, md.has_allowed, md.bias_token_ids, md.positions,
                                    md.min_tokens)
             & ~penalties_active(md.presence_penalty, md.frequency_penalty, md.repetition_penalty))
    return lax.cond(plain, lambda: SamplerOutput(first_argmax(logits), *no_logprobs()), full)
