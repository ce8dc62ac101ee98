"""Penalties, logit bias and allowed tokens: exact formulas against numpy, and their effect on sampling."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sample.sampler import process_logits
from tests.sample.sampler_testlib import draw_tokens, metadata, np_penalize, params, run_sample

V = 64
R = 4


def random_history(rng):
    logits = rng.normal(size=(R, V)).astype(np.float32) * 3  # both signs
    counts = rng.integers(0, 4, size=(R, V)) * (rng.random((R, V)) < 0.3)
    prompt_mask = rng.random((R, V)) < 0.2
    return logits, counts.astype(np.int32), prompt_mask


def test_penalties_match_numpy_formulas():
    rng = np.random.default_rng(0)
    logits, counts, prompt_mask = random_history(rng)
    presence = np.array([0.0, 0.5, -1.0, 1.5], np.float32)
    frequency = np.array([0.0, 0.3, 0.7, -0.4], np.float32)
    repetition = np.array([1.0, 1.2, 0.8, 2.0], np.float32)
    rows = [params(presence_penalty=float(p), frequency_penalty=float(f), repetition_penalty=float(r))
            for p, f, r in zip(presence, frequency, repetition)]
    got = process_logits(jnp.asarray(logits), metadata(rows, V), jnp.asarray(counts), jnp.asarray(prompt_mask))
    want = np_penalize(logits, counts, prompt_mask, presence, frequency, repetition)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[0], logits[0])  # row 0 has every penalty off


def test_repetition_uses_prompt_and_output_presence_frequency_only_output():
    logits = np.array([[2.0, -2.0, 2.0, -2.0, 2.0]], np.float32)
    prompt_mask = np.array([[True, True, False, False, False]])
    counts = np.array([[0, 0, 2, 2, 0]], np.int32)  # tokens 2, 3 generated twice; token 4 unseen
    rep = process_logits(jnp.asarray(logits), metadata([params(repetition_penalty=2.0)], 5),
                         jnp.asarray(counts), jnp.asarray(prompt_mask))
    np.testing.assert_allclose(np.asarray(rep), [[1.0, -4.0, 1.0, -4.0, 2.0]])
    pres_freq = process_logits(jnp.asarray(logits), metadata([params(presence_penalty=0.5, frequency_penalty=0.25)], 5),
                               jnp.asarray(counts), jnp.asarray(prompt_mask))
    np.testing.assert_allclose(np.asarray(pres_freq), [[2.0, -2.0, 1.0, -3.0, 2.0]])  # prompt tokens untouched


def test_penalties_off_leave_logits_bit_identical_despite_history():
    rng = np.random.default_rng(1)
    logits, counts, prompt_mask = random_history(rng)
    md = metadata([params()] * R, V)
    got = process_logits(jnp.asarray(logits), md, jnp.asarray(counts), jnp.asarray(prompt_mask))
    np.testing.assert_array_equal(np.asarray(got), logits)


def low_logits(head):
    """[R, V] logits at -10 except `head` in the first columns of row 0 (one compiled shape)."""
    logits = np.full((R, V), -10.0, np.float32)
    logits[0, : len(head)] = head
    return logits


def test_repetition_penalty_changes_greedy_choice():
    counts = np.zeros((R, V), np.int32)
    counts[0, 0] = 1
    md = metadata([params(temperature=0.0, repetition_penalty=2.0)], V, num_rows=R)
    assert int(run_sample(low_logits([3.0, 2.0, 1.0]), md, counts).sampled_token_ids[0]) == 1  # 3/2 < 2


def test_logit_bias_moves_greedy_and_padding_slots_are_inert():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(R, V)).astype(np.float32)
    logits[:, V - 1] = 10.0  # the argmax sits at V-1: a -1 padding slot must not touch it
    rows = [params(temperature=0.0),
            params(temperature=0.0, logit_bias={5: 100.0}),
            params(temperature=0.0, logit_bias={V - 1: -100.0})]
    md = metadata(rows, V, num_rows=R)
    no_counts, no_prompt = jnp.zeros((R, V), jnp.int32), jnp.zeros((R, V), bool)
    processed = np.asarray(process_logits(jnp.asarray(logits), md, no_counts, no_prompt))
    np.testing.assert_array_equal(processed[0], logits[0])
    assert processed[1, 5] == np.float32(logits[1, 5] + 100.0)
    out = np.asarray(run_sample(logits, md).sampled_token_ids)
    assert out[0] == V - 1 and out[1] == 5 and out[2] == np.argmax(logits[2, : V - 1])


def test_allowed_token_ids_greedy_and_random():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=V).astype(np.float32)
    allowed = [3, 17, 40]
    rows = [params(temperature=0.0, allowed_token_ids=allowed), params(temperature=0.0)]
    out = np.asarray(run_sample(np.stack([logits] * R), metadata(rows, V, num_rows=R)).sampled_token_ids)
    assert out[0] == allowed[int(np.argmax(logits[allowed]))] and out[1] == np.argmax(logits)
    draws = draw_tokens(logits, V, temperature=1.5, allowed_token_ids=allowed)
    assert set(draws.tolist()) == set(allowed)


def test_allowed_tokens_combine_with_bias():
    md = metadata([params(temperature=0.0, allowed_token_ids=[1, 2], logit_bias={2: 1.0, 5: 50.0})], V, num_rows=R)
    assert int(run_sample(low_logits([0.0] * 8), md).sampled_token_ids[0]) == 2  # 5 is biased but not allowed


def test_processors_run_under_jit_with_bf16_logits():
    logits = jax.random.normal(jax.random.PRNGKey(0), (R, V)).astype(jnp.bfloat16)
    out = run_sample(logits, metadata([params(temperature=0.0), params(temperature=0.9, top_k=3)], V, num_rows=R))
    assert int(out.sampled_token_ids[0]) == int(jnp.argmax(logits[0].astype(jnp.float32)))
