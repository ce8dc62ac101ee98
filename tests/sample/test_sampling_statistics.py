"""Top-k / top-p / min-p supports against a numpy reference of vLLM V1, and empirical distributions.

Draws for one request are n rows with the same seed at positions 0..n-1 (`draw_tokens`). Every
test runs twice: with the default top-256 fast path and with `top_k_cap=2`, which leaves nearly
every row undecided and so exercises the full-sort fallback.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sample.truncation import truncate, truncation_threshold
from tests.sample.sampler_testlib import draw_tokens, np_keep_mask, np_softmax

V = 64
CAPS = [256, 2]


def logits_row(seed=0, scale=1.5):
    return (np.random.default_rng(seed).normal(size=V) * scale).astype(np.float32)


@partial(jax.jit, static_argnames="cap")
def truncated(scaled, top_k, top_p, min_p, *, cap):
    threshold = truncation_threshold(scaled, top_k, top_p, min_p, skip=jnp.zeros(scaled.shape[0], bool), cap=cap)
    return truncate(scaled, threshold)


@pytest.mark.parametrize("cap", [256, 16, 1])
def test_truncation_support_matches_vllm_reference(cap):
    rng = np.random.default_rng(cap)
    rows, vocab = 48, 300
    scaled = rng.normal(size=(rows, vocab)) * rng.choice([0.5, 2.0, 6.0], size=(rows, 1))
    scaled = scaled.astype(np.float32)
    top_k = rng.choice([0, 1, 5, 40, 299, 300, 500], size=rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.7, 0.3], size=rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.02, 0.3], size=rows).astype(np.float32)
    kept = np.isfinite(np.asarray(truncated(scaled, top_k, top_p, min_p, cap=cap)))
    for i in range(rows):
        want = np_keep_mask(scaled[i], int(top_k[i]), float(top_p[i]), float(min_p[i]))
        np.testing.assert_array_equal(kept[i], want, err_msg=f"row {i}: k={top_k[i]} p={top_p[i]} min_p={min_p[i]}")


@pytest.mark.parametrize("cap", CAPS)
def test_top_k_never_leaves_the_k_highest(cap):
    logits = logits_row(1)
    draws = draw_tokens(logits, V, top_k_cap=cap, temperature=2.0, top_k=5, seed=3)
    top5 = set(np.argsort(-logits)[:5].tolist())
    assert set(draws.tolist()) == top5  # never outside, and every one of them drawn


@pytest.mark.parametrize("cap", CAPS)
def test_top_p_never_leaves_the_nucleus(cap):
    logits = logits_row(2)
    draws = draw_tokens(logits, V, top_k_cap=cap, temperature=1.0, top_p=0.6, seed=4)
    probs = np_softmax(logits)
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = order[before < 0.6]
    assert set(draws.tolist()) <= set(nucleus.tolist())
    assert len(set(draws.tolist())) >= len(nucleus) - 1  # the rarest nucleus token may be unseen
    # Within the nucleus, frequencies follow the renormalised probabilities.
    want = probs[nucleus] / probs[nucleus].sum()
    got = np.array([(draws == t).mean() for t in nucleus])
    np.testing.assert_allclose(got, want, atol=0.03)


@pytest.mark.parametrize("cap", CAPS)
def test_min_p_never_below_threshold(cap):
    logits = logits_row(3, scale=2.0)
    draws = draw_tokens(logits, V, top_k_cap=cap, temperature=1.0, min_p=0.1, seed=5)
    probs = np_softmax(logits)
    assert (probs[draws] >= 0.1 * probs.max()).all()
    assert len(set(draws.tolist())) == int((probs >= 0.1 * probs.max()).sum())


def chi_square(draws, probs):
    counts = np.bincount(draws, minlength=len(probs))
    expected = probs * len(draws)
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_one_matches_softmax():
    logits = logits_row(4, scale=1.0)
    draws = draw_tokens(logits, V, temperature=1.0, seed=6)
    # df = 63: the 0.1% upper quantile of chi-square is 103.4.
    assert chi_square(draws, np_softmax(logits)) < 103.4
    assert chi_square(draws, np_softmax(logits * 1.25)) > 103.4  # the test can tell a wrong temperature


def entropy(draws):
    freq = np.bincount(draws) / len(draws)
    freq = freq[freq > 0]
    return float(-(freq * np.log(freq)).sum())


def test_entropy_rises_with_temperature():
    logits = logits_row(5)
    entropies = [entropy(draw_tokens(logits, V, temperature=t, seed=7)) for t in (0.3, 0.7, 1.0, 2.0)]
    assert entropies == sorted(entropies) and entropies[0] < entropies[-1] - 0.5
