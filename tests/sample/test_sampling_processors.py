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


def min_tokens_params(min_tokens: int, stop_token_ids: list[int], eos: list[int], **fields):
    p = params(temperature=0.0, min_tokens=min_tokens, stop_token_ids=stop_token_ids, **fields)
    p.update_from_eos(eos)
    return p


def test_min_tokens_masks_stop_and_eos_ids_until_reached():
    logits = low_logits([9.0, 8.0, 7.0, 1.0])  # row 0 prefers 0, then 1, then 2
    logits[1, :4] = [9.0, 8.0, 7.0, 1.0]
    rows = [min_tokens_params(3, [1], eos=[0]), min_tokens_params(3, [1], eos=[0], ignore_eos=True)]
    short = metadata(rows, V, num_rows=R, positions=[2, 2])
    processed = np.asarray(process_logits(jnp.asarray(logits), short, jnp.zeros((R, V), jnp.int32),
                                          jnp.zeros((R, V), bool)))
    assert np.isneginf(processed[0, :2]).all() and processed[0, 2] == 7.0  # stop id 1 and EOS 0 masked
    assert np.isneginf(processed[1, 1]) and processed[1, 0] == 9.0  # ignore_eos: only the stop id
    np.testing.assert_array_equal(processed[2:], logits[2:])  # padding rows untouched
    assert np.asarray(run_sample(logits, short).sampled_token_ids)[:2].tolist() == [2, 0]
    reached = metadata(rows, V, num_rows=R, positions=[3, 3])
    assert np.asarray(run_sample(logits, reached).sampled_token_ids)[:2].tolist() == [0, 0]


def test_min_tokens_mask_beats_a_large_bias_and_random_draws():
    logits = low_logits([0.0] * 4)
    row = min_tokens_params(5, [], eos=[3], logit_bias={3: 100.0})
    assert int(run_sample(logits, metadata([row], V, num_rows=R, positions=[4])).sampled_token_ids[0]) != 3
    assert int(run_sample(logits, metadata([row], V, num_rows=R, positions=[5])).sampled_token_ids[0]) == 3
    # every draw (positions 0..DRAWS-1) is short of min_tokens: the stop ids never come out
    draws = draw_tokens(logits[0], V, temperature=2.0, min_tokens=10**6, max_tokens=None, stop_token_ids=[3, 7])
    assert not {3, 7} & set(draws.tolist()) and len(set(draws.tolist())) > 20


def test_a_written_penalty_row_replaces_the_slot_and_steps_add_to_it():
    from jaxserve.sample.penalties import PenaltyTables, update_penalty_tables, write_penalty_row

    tables = PenaltyTables(jnp.ones((3, V), jnp.int32), jnp.ones((3, V), bool))  # stale history everywhere
    known = np.array([5, 9, 9, 7, 7, 7, -1, -1], np.int32)  # prompt 5, 9, 9, then outputs 7, 7, 7
    is_output = np.arange(8) >= 3
    tables = write_penalty_row(tables, jnp.int32(1), jnp.asarray(known), jnp.asarray(is_output))
    tables = update_penalty_tables(tables, token_slots=jnp.asarray([1, 1, 2]), input_ids=jnp.asarray([7, 11, 3]),
                                   token_is_output=jnp.asarray([True, True, False]))
    counts, mask = np.asarray(tables.output_counts), np.asarray(tables.prompt_mask)
    want_counts = np.zeros(V, np.int32)
    want_counts[[7, 11]] = [4, 1]
    np.testing.assert_array_equal(counts[1], want_counts)
    assert set(np.flatnonzero(mask[1])) == {5, 9}
    assert (counts[[0, 2]] >= 1).all() and mask[[0, 2]].all()  # other slots untouched
