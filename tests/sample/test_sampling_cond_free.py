"""The GPU step's sampler (no conditional: the host says whether every row is greedy) against the
CPU one (conds on the device): one pipeline, so same tokens, same logprobs, the same answer to
every flag, and no conditional in its program."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxserve.bench.hlo_stats import analyze_hlo
from jaxserve.sample import sample
from jaxserve.sample.policy import SamplerPolicy
from jaxserve.sample.truncation import top_k_in_rounds
from tests.sample.sampler_testlib import K, metadata, params
from tests.sample.test_sampling_sampler import MATES, V, random_logits

ROWS = 8


def _policy(all_greedy):
    return SamplerPolicy() if all_greedy is None else SamplerPolicy(cond_free=True, all_greedy=all_greedy)


@partial(jax.jit, static_argnames=("all_greedy",))
def _sample(logits, md, counts, mask, need_logprobs, all_greedy=None, bitmask=None, use_bitmask=None):
    return sample(logits, md, counts, mask, max_num_logprobs=K, need_logprobs=need_logprobs,
                  token_bitmask=bitmask, use_bitmask=use_bitmask, policy=_policy(all_greedy))


def _history(seed=3):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 3, (ROWS, V)).astype(np.int32) * (rng.random((ROWS, V)) < 0.01)
    return jnp.asarray(counts), jnp.asarray(rng.random((ROWS, V)) < 0.02)


@pytest.mark.parametrize("batch", ["mixed", "greedy"])
def test_cond_free_sampler_matches_the_cond_one(batch):
    logits = random_logits(ROWS, seed=5)
    # a row short of its min_tokens whose stop id is its argmax: the mask must change its token
    min_tokens_row = params(temperature=0.0, min_tokens=ROWS + 1, stop_token_ids=[int(np.argmax(logits[7]))])
    rows = [params(temperature=0.0)] * 2 + MATES + [min_tokens_row] if batch == "mixed" else (
        [params(temperature=0.0, repetition_penalty=1.3, logit_bias={7: 5.0})] * 4 + [params(temperature=0.0)] * 3
        + [min_tokens_row])
    md = metadata(rows, V, positions=list(range(ROWS)))
    counts, mask = _history()
    ref = _sample(logits, md, counts, mask, jnp.asarray(True))
    out = _sample(logits, md, counts, mask, jnp.asarray(True), all_greedy=batch == "greedy")
    np.testing.assert_array_equal(out.sampled_token_ids, ref.sampled_token_ids)
    np.testing.assert_array_equal(out.logprob_token_ids, ref.logprob_token_ids)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out.sampled_token_rank, ref.sampled_token_rank)
    assert int(out.sampled_token_ids[7]) != int(np.argmax(logits[7]))


def test_cond_free_sampler_program_has_no_conditional():
    md = metadata(MATES, V, num_rows=ROWS)
    args = (random_logits(ROWS), md, *_history(), jnp.asarray(False))
    shapes, pools = set(), set()
    with_conds = analyze_hlo(_sample.lower(*args).compile().as_text(), shapes, pools)
    for all_greedy in (True, False):
        stats = analyze_hlo(_sample.lower(*args, all_greedy=all_greedy).compile().as_text(), shapes, pools)
        assert stats.conditionals == 0 and stats.data_dependent_whiles == 0, stats
    assert with_conds.conditionals > 0  # the CPU program keeps its conds: the check sees them


@pytest.mark.parametrize("all_greedy", [None, True, False])
def test_every_path_honours_need_logprobs_and_use_bitmask(all_greedy):
    """need_logprobs False gives zero logprobs and use_bitmask False leaves the logits unmasked,
    whatever the policy (the cond-free sampler used to ignore both)."""
    logits = random_logits(ROWS, seed=6)
    random_mates = [m for m in MATES if m.allowed_token_ids is None]  # an allowed list would exclude token 3
    rows = [params(temperature=0.0)] * (ROWS - (0 if all_greedy else len(random_mates))) + ([] if all_greedy
                                                                                        else random_mates)
    md = metadata(rows, V)
    counts, mask = _history()
    bitmask = np.zeros((ROWS, -(-V // 32)), np.int32)
    bitmask[:, 0] = 1 << 3  # each row may take token 3 only
    off = _sample(logits, md, counts, mask, jnp.asarray(False), all_greedy, jnp.asarray(bitmask), jnp.asarray(False))
    ref = _sample(logits, md, counts, mask, jnp.asarray(False), None, None, None)  # no bitmask at all
    np.testing.assert_array_equal(off.sampled_token_ids, ref.sampled_token_ids)
    assert not np.any(np.asarray(off.logprobs)) and not np.any(np.asarray(off.logprob_token_ids))
    on = _sample(logits, md, counts, mask, jnp.asarray(True), all_greedy, jnp.asarray(bitmask), jnp.asarray(True))
    np.testing.assert_array_equal(on.sampled_token_ids, np.full(ROWS, 3))
    assert np.all(np.asarray(on.logprob_token_ids)[:, 0] == 3) and np.any(np.asarray(on.logprobs))


def test_greedy_ties_and_nan_rows_resolve_alike_on_both_paths():
    logits = random_logits(ROWS, seed=8)
    logits[0, [5, 900]] = logits[0].max() + 1  # a tie: the first index wins
    logits[1, :] = 0.0  # a flat row
    logits[2, [17, 600]] = np.nan  # a broken row: both paths still agree
    md = metadata([params(temperature=0.0)] * ROWS, V)
    counts, mask = _history()
    outs = [np.asarray(_sample(logits, md, counts, mask, jnp.asarray(False), g).sampled_token_ids)
            for g in (None, True, False)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    assert outs[0][0] == 5 and outs[0][1] == 0


@pytest.mark.parametrize("k", [3, 16, 20, 40])
def test_top_k_in_rounds_equals_top_k(k):
    x = jnp.asarray(random_logits(ROWS, seed=9))
    values, ids = jax.jit(top_k_in_rounds, static_argnums=1)(x, k)
    ref_values, ref_ids = lax.top_k(x, k)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(values, ref_values)

