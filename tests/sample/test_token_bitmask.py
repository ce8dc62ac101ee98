"""The structured-output bitmask in the sampler: applied first, so bias, penalties, temperature and
top-k/p see only legal tokens; logprobs stay raw; off (and free) when the step has no mask."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from llguidance.numpy import apply_token_bitmask_inplace

from jaxserve.sample import sample
from jaxserve.sample.processors import apply_token_bitmask
from tests.sample.sampler_testlib import K, metadata, params

V = 300  # not a multiple of 32: the last word is partial
ROWS = 4


def bitmask_of(allowed: list[list[int]], vocab: int = V) -> np.ndarray:
    mask = np.zeros((len(allowed), (vocab + 31) // 32), np.int32)
    for r, ids in enumerate(allowed):
        for t in ids:
            mask[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask


@partial(jax.jit, static_argnames=("max_num_logprobs",))
def _sample(logits, md, counts, prompt_mask, bitmask, use_bitmask, *, max_num_logprobs):
    return sample(logits, md, counts, prompt_mask, max_num_logprobs=max_num_logprobs, token_bitmask=bitmask,
                  use_bitmask=use_bitmask, need_logprobs=jnp.asarray(True))


def run(logits, md, bitmask, use_bitmask=True, counts=None):
    counts = jnp.zeros(logits.shape, jnp.int32) if counts is None else jnp.asarray(counts)
    return _sample(jnp.asarray(logits), md, counts, jnp.zeros(logits.shape, jnp.bool_), jnp.asarray(bitmask),
                   jnp.asarray(use_bitmask), max_num_logprobs=K)


def test_matches_llguidance_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(ROWS, V)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, size=(ROWS, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    want = logits.copy()
    apply_token_bitmask_inplace(want, mask)
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, mask, True))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(apply_token_bitmask(logits, mask, False)), logits)


def test_masked_tokens_never_win_whatever_processing_follows():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(ROWS, V)).astype(np.float32)
    best = logits.argmax(-1)
    allowed = [[7, 290], [3], [5, 6, 299], list(range(V))]
    rows = [params(temperature=0.0, logit_bias={int(best[0]): 100.0}),  # a bias on a masked token
            params(temperature=1.0, top_k=2, seed=3),
            params(temperature=0.7, top_p=0.5, repetition_penalty=2.0, seed=4),  # penalties after the mask
            params(temperature=0.0)]
    md = metadata(rows, V)
    counts = np.zeros((ROWS, V), np.int32)
    counts[2, 5] = 3  # penalise one of the allowed tokens
    out = run(logits, md, bitmask_of(allowed), counts=counts)
    sampled = np.asarray(out.sampled_token_ids)
    assert sampled[0] == max(allowed[0], key=lambda t: logits[0, t])
    assert sampled[1] == 3 and sampled[2] in allowed[2]
    assert sampled[3] == best[3]  # an all-ones row is unconstrained
    # logprobs are of the raw logits (vLLM's default), not of the masked ones
    raw = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    np.testing.assert_allclose(np.asarray(out.logprobs)[:, 0], np.asarray(raw)[np.arange(ROWS), sampled], rtol=1e-5)


def test_flag_off_ignores_the_bitmask():
    logits = np.random.default_rng(2).normal(size=(ROWS, V)).astype(np.float32)
    md = metadata([params(temperature=0.0)] * ROWS, V)
    out = run(logits, md, bitmask_of([[1]] * ROWS), use_bitmask=False)
    np.testing.assert_array_equal(np.asarray(out.sampled_token_ids), logits.argmax(-1))
