"""The rejection sampler: greedy equals plain argmax decoding, and random rows keep the target's
distribution (chi-square on a 5-token vocabulary: the first token, the token after an accepted
draft, the bonus token), for a point-mass (n-gram) and a distribution (draft model) proposer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from jaxserve.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample
from jaxserve.sample.sampler import row_keys

V, K, N = 5, 2, 40000
P = np.array([[0.40, 0.25, 0.20, 0.10, 0.05],     # the target at position 0, 1, 2 (bonus)
              [0.05, 0.15, 0.50, 0.20, 0.10],
              [0.30, 0.10, 0.10, 0.20, 0.30]], np.float32)
Q = np.array([[0.10, 0.60, 0.10, 0.10, 0.10],     # a draft model's proposals at positions 0, 1
              [0.20, 0.20, 0.20, 0.20, 0.20]], np.float32)
sample = jax.jit(rejection_sample)


def run(draft_model: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = np.broadcast_to(np.log(P), (N, K + 1, V))
    if draft_model:
        drafts = np.stack([rng.choice(V, size=N, p=Q[i]) for i in range(K)], axis=1)
        q = np.broadcast_to(Q, (N, K, V))
    else:  # n-gram: always the same draft, a point mass
        drafts, q = np.tile(np.array([[1, 2]]), (N, 1)), None
    keys = row_keys(jnp.arange(N, dtype=jnp.uint32) + seed * N, jnp.zeros(N, jnp.int32))
    out, num = sample(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32),
                      jnp.full(N, K, jnp.int32), jnp.zeros(N, bool), keys,
                      None if q is None else jnp.asarray(q))
    return np.asarray(out), np.asarray(num), drafts


def check(tokens, p):
    counts = np.bincount(tokens, minlength=V)
    assert len(tokens) > 1000
    p64 = np.asarray(p, np.float64)
    expected = p64 / p64.sum() * counts.sum()
    assert chisquare(counts, expected).pvalue > 1e-3, (counts / len(tokens), p)


@pytest.mark.parametrize("draft_model", [False, True])
def test_random_rows_keep_the_target_distribution(draft_model):
    out, num, drafts = run(draft_model)
    assert ((1 <= num) & (num <= K + 1)).all()
    rows = np.arange(N)
    assert (out[rows, num - 1] != PLACEHOLDER_TOKEN_ID).all()
    assert all((out[num <= i, i] == PLACEHOLDER_TOKEN_ID).all() for i in range(K + 1))
    for i in range(K):  # accepted positions echo the drafts
        assert (out[num > i + 1, i] == drafts[num > i + 1, i]).all()
    check(out[:, 0], P[0])                 # the first token
    check(out[num >= 2, 1], P[1])          # after an accepted draft
    check(out[num == K + 1, K], P[K])      # the bonus token
    # The acceptance rate is the overlap sum(min(p, q)) at position 0.
    q0 = Q[0] if draft_model else np.eye(V)[1]
    assert abs((num >= 2).mean() - np.minimum(P[0], q0).sum()) < 0.01


def test_reproducible_per_seed():
    a, _, _ = run(True, seed=1)
    b, _, _ = run(True, seed=1)
    c, _, _ = run(True, seed=2)
    assert (a == b).all() and (a != c).any()


def test_greedy_accepts_the_argmax_prefix_and_fewer_drafts():
    rng = np.random.default_rng(0)
    r = 64
    logits = rng.normal(size=(r, K + 1, V)).astype(np.float32)
    argmax = logits.argmax(-1)
    drafts = np.where(rng.random((r, K)) < 0.6, argmax[:, :K], (argmax[:, :K] + 1) % V)
    num_drafts = rng.integers(0, K + 1, size=r)
    keys = row_keys(jnp.arange(r, dtype=jnp.uint32), jnp.zeros(r, jnp.int32))
    out, num = sample(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32),
                      jnp.asarray(num_drafts, jnp.int32), jnp.ones(r, bool), keys, None)
    out, num = np.asarray(out), np.asarray(num)
    for i in range(r):
        a = 0
        while a < num_drafts[i] and drafts[i, a] == argmax[i, a]:
            a += 1
        assert num[i] == a + 1
        assert list(out[i, :a + 1]) == list(argmax[i, :a + 1])  # plain greedy decoding's tokens


def test_missing_drafts_draw_from_the_target():
    """A row with no drafts (or fewer than K) is a plain sample from p at its next position."""
    logits = np.broadcast_to(np.log(P), (N, K + 1, V))
    keys = row_keys(jnp.arange(N, dtype=jnp.uint32), jnp.ones(N, jnp.int32))
    out, num = sample(jnp.asarray(logits), jnp.zeros((N, K), jnp.int32), jnp.zeros(N, jnp.int32),
                      jnp.zeros(N, bool), keys, None)
    assert (np.asarray(num) == 1).all()
    check(np.asarray(out)[:, 0], P[0])
