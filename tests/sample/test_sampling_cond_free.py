"""The GPU step's sampler (no conditional: the host says whether every row is greedy) against the
CPU one (conds on the device): same tokens, same logprobs, and no conditional in its program."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxserve.bench.hlo_stats import analyze_hlo
from jaxserve.sample import sample
from jaxserve.sample.truncation import top_k_in_rounds
from tests.sample.sampler_testlib import K, metadata, params
from tests.sample.test_sampling_sampler import MATES, V, random_logits

ROWS = 8


@partial(jax.jit, static_argnames=("all_greedy",))
def _sample(logits, md, counts, mask, need_logprobs, all_greedy=None):
    return sample(logits, md, counts, mask, max_num_logprobs=K, need_logprobs=need_logprobs, all_greedy=all_greedy)


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


@pytest.mark.parametrize("k", [3, 16, 20, 40])
def test_top_k_in_rounds_equals_top_k(k):
    x = jnp.asarray(random_logits(ROWS, seed=9))
    values, ids = jax.jit(top_k_in_rounds, static_argnums=1)(x, k)
    ref_values, ref_ids = lax.top_k(x, k)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(values, ref_values)

