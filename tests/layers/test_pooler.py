"""Poolers over a packed step against per-request numpy/torch computations of the same thing."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.layers.pooler import classify_head, embed_head, pool, token_owner

# Three requests packed end to end, a padding request (len 0), then unowned padding rows.
STARTS = np.array([0, 5, 6, 0])
LENS = np.array([5, 1, 7, 0])
T, H = 16, 8


@pytest.fixture
def hidden():
    return np.random.default_rng(0).normal(size=(T, H)).astype(np.float32)


def per_request(hidden, reduce):
    rows = [reduce(hidden[s:s + n]) if n else np.zeros(H, np.float32) for s, n in zip(STARTS, LENS)]
    return np.stack(rows)


def test_token_owner_marks_padding_rows():
    owner = np.asarray(token_owner(jnp.asarray(STARTS), jnp.asarray(LENS), T))
    assert owner.tolist() == [0] * 5 + [1] + [2] * 7 + [4] * 3


@pytest.mark.parametrize("kind,reduce", [("LAST", lambda x: x[-1]), ("CLS", lambda x: x[0]),
                                         ("MEAN", lambda x: x.mean(axis=0))])
def test_pool_matches_per_request(hidden, kind, reduce):
    got = np.asarray(pool(jnp.asarray(hidden), jnp.asarray(STARTS), jnp.asarray(LENS), kind))
    np.testing.assert_allclose(got, per_request(hidden, reduce), rtol=1e-6, atol=1e-6)


def test_pool_rejects_unknown_type(hidden):
    with pytest.raises(ValueError, match="pooling_type"):
        pool(jnp.asarray(hidden), jnp.asarray(STARTS), jnp.asarray(LENS), "MAX")


def test_embed_head_normalizes_like_torch_and_truncates_first(hidden):
    pooled = hidden[:4]
    want = torch.nn.functional.normalize(torch.from_numpy(pooled[:, :3]), p=2, dim=-1).numpy()
    got = np.asarray(embed_head(jnp.asarray(pooled), normalize=True, dimensions=3))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, rtol=1e-6)
    raw = np.asarray(embed_head(jnp.asarray(pooled), normalize=False))
    np.testing.assert_array_equal(raw, pooled)
    # A zero vector (a padding request) stays zero instead of becoming NaN.
    assert np.all(np.asarray(embed_head(jnp.zeros((1, H)), normalize=True)) == 0)


@pytest.mark.parametrize("labels", [1, 3])
def test_classify_head_matches_torch(hidden, labels):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(labels, H)).astype(np.float32)
    b = rng.normal(size=(labels,)).astype(np.float32)
    logits = torch.nn.functional.linear(torch.from_numpy(hidden), torch.from_numpy(w), torch.from_numpy(b))
    want = torch.sigmoid(logits) if labels == 1 else torch.softmax(logits, dim=-1)
    got = classify_head(jnp.asarray(hidden), jnp.asarray(w), jnp.asarray(b))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-6)
    raw = classify_head(jnp.asarray(hidden), jnp.asarray(w), jnp.asarray(b), activation=False)
    np.testing.assert_allclose(np.asarray(raw), logits.numpy(), rtol=1e-5, atol=1e-5)
