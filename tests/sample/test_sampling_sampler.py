"""The sampler end to end: greedy, seeded reproducibility and batch independence, logprobs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sample import SamplingMetadata, sample, sampling_arrays
from jaxserve.sample.sampler import first_argmax
from tests.sample.sampler_testlib import draw_tokens, metadata, np_log_softmax, np_penalize, params, run_sample

V = 1000  # > the 256 top-k cap, so flat top-p rows need the full-sort fallback
R = 8


def random_logits(rows, seed=0, vocab=V, scale=2.0):
    return (np.random.default_rng(seed).normal(size=(rows, vocab)) * scale).astype(np.float32)


# Batch mates exercising every path: fallback sort (flat top-p), penalties, bias, allowed, min-p.
MATES = [
    params(temperature=1.0, top_p=0.95, seed=11),
    params(temperature=0.7, top_k=5, presence_penalty=1.0, repetition_penalty=1.5, seed=12),
    params(temperature=0.0, logit_bias={1: 30.0}),
    params(temperature=2.0, allowed_token_ids=[4, 5, 6], seed=13),
    params(temperature=1.0, min_p=0.2, top_k=600, seed=14),
]


def test_greedy_is_argmax_in_greedy_and_mixed_batches():
    logits = random_logits(R)
    all_greedy = run_sample(logits, metadata([params(temperature=0.0)] * R, V))
    np.testing.assert_array_equal(all_greedy.sampled_token_ids, logits.argmax(-1))
    mixed = run_sample(logits, metadata([params(temperature=0.0)] * 3 + MATES, V))
    np.testing.assert_array_equal(np.asarray(mixed.sampled_token_ids)[:3], logits[:3].argmax(-1))


@pytest.mark.parametrize("vocab", [64, 128, 1000, 8192])  # one segment, exact segments, a padded tail
def test_first_argmax_matches_numpy_on_ties_and_masked_rows(vocab):
    logits = np.round(random_logits(R, vocab=vocab), 0)  # rounding makes ties common
    logits[1, :] = -np.inf  # a fully masked row: numpy picks index 0
    logits[2, [5, vocab - 3]] = 99.0  # a tie for the maximum across segments: the first index wins
    logits[3, 17] = np.inf
    logits[4, -1] = 99.0  # the maximum in the padded last segment
    logits[5, 130 % vocab] = logits[5, 131 % vocab] = 99.0  # a tie inside one segment
    np.testing.assert_array_equal(jax.jit(first_argmax)(logits), logits.argmax(-1))
    nan_row = np.zeros((1, vocab), np.float32)
    nan_row[0, 3] = np.nan
    assert 0 <= int(first_argmax(nan_row)[0]) < vocab  # never an out-of-range id


def test_padding_rows_are_greedy():
    logits = random_logits(R)
    out = run_sample(logits, metadata([params(temperature=1.0, seed=1)], V, num_rows=R))
    np.testing.assert_array_equal(np.asarray(out.sampled_token_ids)[1:], logits[1:].argmax(-1))


def place(target, target_logits, row, mates, num_rows, seed):
    """A batch with `target` at `row` and `mates` (cycled) elsewhere, mates' logits random."""
    logits = random_logits(num_rows, seed=seed)
    logits[row] = target_logits
    rows = [mates[i % len(mates)] for i in range(num_rows)]
    rows[row] = target
    positions = [3 * i for i in range(num_rows)]
    positions[row] = 17
    return logits, metadata(rows, V, positions=positions)


def test_seeded_draw_is_reproducible_and_independent_of_row_and_batch_mates():
    targets = [
        params(temperature=0.8, top_k=20, seed=7),
        params(temperature=1.0, top_p=0.9, seed=123456789),  # flat logits: needs the full sort itself
        params(temperature=1.3, min_p=0.1, seed=2**32 - 1),
        params(temperature=0.9, top_p=0.5, top_k=300, seed=5),  # top_k above the cap
    ]
    target_logits = random_logits(1, seed=99)[0]
    for target in targets:
        results = set()
        for row, mates, num_rows, seed in [
            (0, [params(temperature=0.0)], R, 1),
            (5, MATES, R, 2),
            (13, MATES[::-1], 2 * R, 3),  # another row bucket
            (2, [params(temperature=0.5, top_k=3, seed=1)], R, 4),  # mates that take the fast path
        ]:
            logits, md = place(target, target_logits, row, mates, num_rows, seed)
            first = np.asarray(run_sample(logits, md).sampled_token_ids)[row]
            again = np.asarray(run_sample(logits, md).sampled_token_ids)[row]
            assert first == again
            results.add(int(first))
        assert len(results) == 1, (target, results)


def test_vmap_over_positions_matches_rows_at_those_positions():
    logits = random_logits(1, seed=5)[0]
    fields = dict(temperature=1.0, top_k=50, seed=31)
    as_rows = draw_tokens(logits, V, 2 * R, **fields)
    md1 = metadata([params(**fields)], V)

    def one(position):
        md = dataclasses.replace(md1, positions=jnp.full((1,), position, jnp.int32))
        zeros = jnp.zeros((1, V), jnp.int32)
        return sample(jnp.asarray(logits)[None], md, zeros, zeros > 0, max_num_logprobs=0).sampled_token_ids[0]

    as_vmap = jax.jit(jax.vmap(one))(jnp.arange(2 * R))
    np.testing.assert_array_equal(as_vmap, as_rows)


def test_positions_and_seeds_change_the_draw():
    logits = random_logits(1, seed=6, scale=0.5)[0]
    by_position = draw_tokens(logits, V, 2 * R, temperature=1.0, seed=1)
    other_seed = draw_tokens(logits, V, 2 * R, temperature=1.0, seed=2)
    assert len(set(by_position.tolist())) > R
    assert (by_position != other_seed).mean() > 0.7


def test_logprobs_are_raw_log_softmax_topk_with_sampled_token_and_rank():
    k = 5
    logits = random_logits(R, seed=8)
    rows = [params(temperature=0.0), params(temperature=1.0, top_k=10, seed=1),
            params(temperature=0.0, logit_bias={7: 100.0}),  # forced token: low raw logprob
            params(temperature=1.0, repetition_penalty=1.8, frequency_penalty=1.0, seed=2),
            params(temperature=0.5, top_p=0.5, seed=3), params(temperature=1.0, allowed_token_ids=[9], seed=4),
            params(temperature=0.0), params(temperature=3.0, seed=5)]
    counts = np.zeros((R, V), np.int32)
    counts[3, logits[3].argsort()[-20:]] = 3
    out = run_sample(logits, metadata(rows, V), counts, num_logprobs=k)
    sampled = np.asarray(out.sampled_token_ids)
    logprobs, ids, ranks = map(np.asarray, (out.logprobs, out.logprob_token_ids, out.sampled_token_rank))
    ref = np_log_softmax(logits)  # raw: no bias, penalty, temperature or truncation
    assert logprobs.shape == (R, k + 1) and ids.shape == (R, k + 1)
    np.testing.assert_array_equal(ids[:, 1:], np.argsort(-ref, axis=-1, kind="stable")[:, :k])
    np.testing.assert_allclose(logprobs[:, 1:], np.sort(ref, axis=-1)[:, ::-1][:, :k], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ids[:, 0], sampled)
    sampled_ref = ref[np.arange(R), sampled]
    np.testing.assert_allclose(logprobs[:, 0], sampled_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ranks, (ref > sampled_ref[:, None]).sum(-1) + 1)
    assert ranks[0] == 1 and sampled[2] == 7 and sampled[5] == 9 and ranks[2] > 1
    # Greedy on the penalised logits, if the penalty moved it, is not rank 1 in the raw logits.
    processed = np_penalize(logits[3:4], counts[3:4], np.zeros((1, V), bool), np.zeros(1), np.ones(1), np.array([1.8]))
    assert processed.argmax() != logits[3].argmax()


def test_zero_logprobs_returns_the_sampled_column_only():
    logits = random_logits(R, seed=9)
    out = run_sample(logits, metadata([params(temperature=0.0)] * R, V), num_logprobs=0)
    assert out.logprobs.shape == (R, 1) and out.logprob_token_ids.shape == (R, 1)
    np.testing.assert_array_equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    np.testing.assert_array_equal(out.sampled_token_rank, 1)


def test_sample_accepts_the_builders_numpy_arrays():
    arrays = sampling_arrays([params(temperature=0.0)], R, positions=[0])
    logits = random_logits(R, seed=10)
    out = run_sample(logits, SamplingMetadata.from_arrays(arrays))
    assert out.sampled_token_ids.dtype == jnp.int32 and out.logprobs.shape == (R, 6)
    np.testing.assert_array_equal(out.sampled_token_ids, logits.argmax(-1))


def test_sample_lowers_for_cuda():
    """The runner compiles `sample` for GPUs; lowering (no GPU needed) catches CPU-only constructs."""
    md = metadata([params(temperature=1.0, top_k=5)] * R, V)
    fn = jax.jit(lambda l, m, c, p: sample(l, m, c, p, max_num_logprobs=5))
    lowered = fn.trace(jnp.zeros((R, V)), md, jnp.zeros((R, V), jnp.int32), jnp.zeros((R, V), bool)).lower(
        lowering_platforms=("cuda",))
    assert "stablehlo.case" in lowered.as_text()


GREEDY_PENALTY = params(temperature=0.0, frequency_penalty=1.0)


@pytest.mark.parametrize("mate", [None, GREEDY_PENALTY, *MATES])
def test_need_logprobs_switch_keeps_the_tokens(mate):
    """With ``need_logprobs`` given, an all-greedy batch with nothing to process takes the argmax
    alone; one row with a penalty, bias, allowed list or random draw sends the batch through the
    full path. Either way the tokens are those of the ungated sampler, and logprobs come only
    when asked for."""
    rows = [params(temperature=0.0)] * (R - 1) + [mate or params(temperature=0.0)]
    md = metadata(rows, V)
    logits = random_logits(R, seed=5)
    logits[-1, 10], logits[-1, 100] = 16.0, 15.0  # token 10 wins unless its history is penalized
    counts = np.zeros((R, V), np.int32)
    counts[:, :50] = 2  # history that a penalty row must see
    prompt_mask = np.zeros((R, V), bool)
    prompt_mask[:, 50:90] = True
    reference = run_sample(logits, md, counts, prompt_mask)
    gated = jax.jit(sample, static_argnames=("max_num_logprobs",))
    for need in (False, True):
        out = gated(jnp.asarray(logits), md, jnp.asarray(counts), jnp.asarray(prompt_mask), max_num_logprobs=3,
                    need_logprobs=jnp.asarray(need))
        np.testing.assert_array_equal(out.sampled_token_ids, reference.sampled_token_ids)
        assert (np.asarray(out.logprobs) != 0).any() == need
    if mate is GREEDY_PENALTY:
        assert int(reference.sampled_token_ids[-1]) == 100
