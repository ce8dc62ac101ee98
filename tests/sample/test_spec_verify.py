"""Verification in the compiled step (``jaxserve.sample.spec_verify``): the real sampler over the
expanded rows, then ``verify_point_mass``. On a 5-token vocabulary with known target distributions
(chi-square), an n-gram draft keeps the target's distribution at every position, the acceptance
rate is p(draft), a seed reproduces its tokens, and greedy rows emit plain greedy decoding's."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import chisquare

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.sample.metadata import SamplingMetadata, sampling_arrays
from jaxserve.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID
from jaxserve.sample.sampler import sample
from jaxserve.sample.spec_verify import expand_rows, verified_output, verify_point_mass

V, K, N = 5, 2, 20000
P = np.array([[0.40, 0.25, 0.20, 0.10, 0.05],     # the target at position 0, 1, 2 (bonus)
              [0.05, 0.15, 0.50, 0.20, 0.10],
              [0.30, 0.10, 0.10, 0.20, 0.30]], np.float32)
DRAFTS = [1, 2]  # the n-gram proposer's drafts: a point mass


@jax.jit
def step(logits, md, drafts, num_drafts):
    """What ModelRunner._step does with a speculative step's logits [R*(K+1), V]."""
    md = expand_rows(md, K + 1)  # every row at K+1 positions, end to end
    r = logits.shape[0]
    zeros = jnp.zeros((r, V), jnp.int32)
    out = sample(logits, md, zeros, zeros.astype(bool), max_num_logprobs=2)
    flat_index = jnp.arange(r).reshape(-1, K + 1)
    return verified_output(out, flat_index, drafts, num_drafts)


def run(params: SamplingParams, seeds, num_drafts: int = K, positions=None):
    n = len(seeds)
    md = SamplingMetadata.from_arrays(sampling_arrays([params] * n, n, positions=positions or [0] * n,
                                                      seeds=list(seeds)))
    logits = np.tile(np.log(P), (n, 1))
    out, num = step(jnp.asarray(logits), md, jnp.tile(jnp.asarray([DRAFTS], jnp.int32), (n, 1)),
                    jnp.full(n, num_drafts, jnp.int32))
    return np.asarray(out.sampled_token_ids), np.asarray(num), out


def check(tokens, p):
    counts = np.bincount(tokens, minlength=V)
    assert len(tokens) > 1000
    p64 = np.asarray(p, np.float64)
    expected = p64 / p64.sum() * counts.sum()
    assert chisquare(counts, expected).pvalue > 1e-3, (counts / len(tokens), p)


def test_expand_rows_advances_positions():
    md = SamplingMetadata.from_arrays(sampling_arrays([SamplingParams(temperature=1.0)] * 2, 2,
                                                      positions=[4, 9], seeds=[1, 2]))
    e = expand_rows(md, 3)
    assert np.asarray(e.positions).tolist() == [4, 5, 6, 9, 10, 11]
    assert np.asarray(e.seeds).tolist() == [1, 1, 1, 2, 2, 2]


def test_random_rows_keep_the_target_distribution():
    out, num, _ = run(SamplingParams(temperature=1.0), range(N))
    assert ((1 <= num) & (num <= K + 1)).all()
    rows = np.arange(N)
    assert (out[rows, num - 1] != PLACEHOLDER_TOKEN_ID).all()
    assert all((out[num <= i, i] == PLACEHOLDER_TOKEN_ID).all() for i in range(K + 1))
    for i in range(K):  # the accepted positions echo the drafts
        assert (out[num > i + 1, i] == DRAFTS[i]).all()
    check(out[:, 0], P[0])                 # the first token
    check(out[num >= 2, 1], P[1])          # after an accepted draft
    check(out[num == K + 1, K], P[K])      # the bonus token
    # A point-mass draft is accepted with probability p(draft).
    assert abs((num >= 2).mean() - P[0, DRAFTS[0]]) < 0.015
    assert abs((num == K + 1).mean() - P[0, DRAFTS[0]] * P[1, DRAFTS[1]]) < 0.015


def test_seeds_reproduce_and_rows_without_drafts_sample_plainly():
    a, _, _ = run(SamplingParams(temperature=1.0), range(500))
    b, _, _ = run(SamplingParams(temperature=1.0), range(500))
    c, _, _ = run(SamplingParams(temperature=1.0), range(1000, 1500))
    assert (a == b).all() and (a != c).any()
    # No drafts: one token, drawn with the key a plain step uses (fold_in(seed, position)).
    out, num, _ = run(SamplingParams(temperature=1.0), range(500), num_drafts=0, positions=[3] * 500)
    assert (num == 1).all()
    md = SamplingMetadata.from_arrays(sampling_arrays([SamplingParams(temperature=1.0)] * 500, 500,
                                                      positions=[3] * 500, seeds=list(range(500))))
    zeros = jnp.zeros((500, V), jnp.int32)
    plain = jax.jit(lambda logits, md: sample(logits, md, zeros, zeros.astype(bool), max_num_logprobs=2))(
        jnp.asarray(np.tile(np.log(P[:1]), (500, 1))), md)
    assert (out[:, 0] == np.asarray(plain.sampled_token_ids)).all()


def test_greedy_rows_and_logprobs():
    out, num, full = run(SamplingParams(temperature=0), range(4))
    argmax = P.argmax(-1)  # 0, 2, 0: the first draft (1) is rejected at once
    assert (num == 1).all() and (out[:, 0] == argmax[0]).all()
    lp = np.asarray(full.logprobs)
    assert lp.shape == (4, K + 1, 3)
    np.testing.assert_allclose(lp[:, 0, 0], np.log(P[0, argmax[0]]), rtol=1e-5)


def test_verify_point_mass_prefix_rule():
    sampled = jnp.asarray([[1, 2, 3], [1, 4, 3], [0, 2, 3], [1, 2, 3]], jnp.int32)
    drafts = jnp.asarray([[1, 2]] * 4, jnp.int32)
    out, num = verify_point_mass(sampled, drafts, jnp.asarray([2, 2, 2, 1], jnp.int32))
    assert np.asarray(num).tolist() == [3, 2, 1, 2]
    assert np.asarray(out).tolist() == [[1, 2, 3], [1, 4, -1], [0, -1, -1], [1, 2, -1]]


def test_penalties_count_the_drafts_before_each_position_and_only_accepted_ones_stay():
    """Position j of a row is penalised as if its drafts d_0..d_{j-1} were generated (the sampler's
    ``extra_outputs``, on top of the slot's table); after verification only the accepted drafts
    are added to the table."""
    from jaxserve.sample.penalties import PenaltyTables, add_accepted_drafts
    from jaxserve.sample.sampler import process_logits
    from jaxserve.sample.spec_verify import earlier_drafts

    vocab, slots = 8, 3
    rng = np.random.default_rng(0)
    tables = PenaltyTables(jnp.asarray(rng.integers(0, 3, (slots + 1, vocab)), jnp.int32),
                           jnp.asarray(rng.random((slots + 1, vocab)) < 0.3))
    drafts = np.array([[5, 5, 2], [1, 0, 0]], np.int32)  # row 0 (slot 2): 3 drafts; row 1 (slot 0): 1
    rows, offsets = np.array([0, 0, 0, 0, 1, 1]), np.array([0, 1, 2, 3, 0, 1])
    row_slots = np.array([2, 0])
    pen = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    arrays = sampling_arrays([pen] * len(rows), len(rows), positions=[0] * len(rows))
    md = SamplingMetadata.from_arrays({k: jnp.asarray(v) for k, v in arrays.items()})
    logits = jnp.asarray(rng.normal(size=(len(rows), vocab)), jnp.float32)
    extra = earlier_drafts(jnp.asarray(drafts), jnp.asarray(rows), jnp.asarray(offsets))
    got = process_logits(logits, md, tables.output_counts, tables.prompt_mask, jnp.asarray(row_slots[rows]),
                         extra_outputs=extra)
    counts = np.asarray(tables.output_counts)[row_slots[rows]].copy()
    for p, (r, j) in enumerate(zip(rows, offsets)):
        for d in drafts[r, :j]:
            counts[p, d] += 1
    want = process_logits(logits, md, jnp.asarray(counts), np.asarray(tables.prompt_mask)[row_slots[rows]])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    plain = process_logits(logits, md, tables.output_counts, tables.prompt_mask, jnp.asarray(row_slots[rows]))
    differs = ~np.isclose(np.asarray(got), np.asarray(plain)).all(axis=1)
    assert differs.tolist() == [False, True, True, True, False, True]  # positions after a draft

    after = add_accepted_drafts(tables, jnp.asarray(row_slots), jnp.asarray(drafts), jnp.asarray([2, 0]))
    expected = np.asarray(tables.output_counts).copy()
    expected[2, 5] += 2  # row 0 accepted 5, 5 (not 2); row 1 accepted nothing
    np.testing.assert_array_equal(np.asarray(after.output_counts), expected)
    np.testing.assert_array_equal(np.asarray(after.prompt_mask), np.asarray(tables.prompt_mask))
