"""The device-side correction of a step built before its predecessor's verification
(``jaxserve.runner.spec_in_flight``), against the host builder run on the true tokens."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import DRAFT_PLACEHOLDER
from jaxserve.runner.input_batch import PersistentBatch, build_spec_inputs, build_step_arrays, write_drafts
from jaxserve.runner.spec_in_flight import (
    correct_in_flight,
    in_flight_ids,
    rejected_per_row,
    row_prev_rows,
    shift_rows,
)
from jaxserve.runner.step_inputs import StepArrays, flag
from jaxserve.sample.metadata import SamplingMetadata, sampling_arrays

BS, MAX_LEN, SLOTS, K = 4, 48, 8, 3
PAD = SLOTS
BUCKET, ROWS, ROWS_N = 64, 8, 8


def scenario(rng):
    """Requests of step N+1, each with what step N did for it. ``verify``: N verified ``d`` drafts
    and accepted ``a`` of them (emitting ``a`` + 1 tokens); then N+1 schedules the bonus token
    and K new drafts. Otherwise the row is known to the host (a prefill chunk, a new prompt)."""
    def toks(n):
        return [int(t) for t in rng.integers(1, 1000, n)]

    a_first = int(rng.integers(0, K))  # at least one row rejects some drafts
    return [
        dict(slot=2, prompt=toks(6), outputs=toks(3), verify=True, d=K, a=a_first, n_row=3),
        dict(slot=0, prompt=toks(5), outputs=toks(1), verify=True, d=2, a=int(rng.integers(0, 3)), n_row=0),
        dict(slot=4, prompt=toks(9), outputs=[], verify=False, start=4, n=5, n_row=5),  # a chunk, in N too
        dict(slot=5, prompt=toks(7), outputs=toks(2), verify=True, d=0, a=0, n_row=1),  # a plain decode in N
        dict(slot=1, prompt=toks(8), outputs=[], verify=False, start=0, n=8, n_row=-1),  # a new request
        dict(slot=3, prompt=toks(4), outputs=toks(4), verify=True, d=K, a=K, n_row=6),  # all accepted
        # preempted while N sampled its token, recomputed: known tokens, then N's token in flight
        dict(slot=6, prompt=toks(3), outputs=toks(2), verify=False, resume=True, start=0, n=6, n_row=2),
    ]


def build(reqs, rng, groups):
    """The optimistic inputs (N's tokens in flight), the true ones, and N's device outputs."""
    free = list(rng.permutation(np.arange(1, 400)))
    true_batch = PersistentBatch(SLOTS, MAX_LEN, -(-MAX_LEN // BS), groups)
    opt_batch = PersistentBatch(SLOTS, MAX_LEN, -(-MAX_LEN // BS), groups)
    prev_tokens = np.zeros((ROWS_N, K + 1), np.int32)
    num_emitted = np.ones(ROWS_N, np.int32)
    num_drafts = np.zeros(ROWS_N, np.int32)
    true_args, opt_args, drafts_true = [], [], []
    for q in reqs:
        known = q["prompt"] + q["outputs"]
        if q["verify"]:
            emitted = [int(t) for t in rng.integers(1, 1000, q["a"] + 1)]
            new_drafts = [int(t) for t in rng.integers(1, 1000, K)]
            true_tokens = known + emitted
            true_start, opt_start, n = len(true_tokens) - 1, len(known) + q["d"], K + 1
            prev_tokens[q["n_row"]] = [emitted[-1], *new_drafts]
            num_emitted[q["n_row"]], num_drafts[q["n_row"]] = q["a"] + 1, q["d"]
        elif q.get("resume"):
            bonus = int(rng.integers(1, 1000))
            true_tokens, new_drafts = known + [bonus], []
            true_start = opt_start = q["start"]
            n = q["n"]
            prev_tokens[q["n_row"]] = [bonus, *rng.integers(1, 1000, K)]  # drafts it does not read
        else:
            true_tokens, new_drafts = known, []
            true_start = opt_start = q["start"]
            n = q["n"]
        blocks = tuple([int(free.pop()) for _ in range(-(-(opt_start + n) // BS))] for _ in range(groups))
        true_batch.add_request(q["slot"], q["prompt"], true_tokens[len(q["prompt"]):], blocks)
        opt_batch.add_request(q["slot"], q["prompt"], q["outputs"], blocks)
        drafts_true.append(new_drafts)
        true_args.append((q["slot"], true_start, n, -1))
        opt_args.append((q["slot"], opt_start, n, q["n_row"] if q["verify"] or q.get("resume") else -1))
    slots = [a[0] for a in true_args]
    write_drafts(true_batch, slots, drafts_true)
    true, _ = build_step_arrays(true_batch, slots, [a[1] for a in true_args], [a[2] for a in true_args],
                                [-1] * len(reqs), BUCKET, ROWS, BS, PAD, [len(d) for d in drafts_true])
    # The scheduler's placeholders: K drafts for each row N verified, in flight, not written.
    drafts_opt = [[DRAFT_PLACEHOLDER] * K if q["verify"] else [] for q in reqs]
    opt, _ = build_step_arrays(opt_batch, slots, [a[1] for a in opt_args], [a[2] for a in opt_args],
                               [a[3] for a in opt_args], BUCKET, ROWS, BS, PAD, [len(d) for d in drafts_opt],
                               [bool(d) for d in drafts_opt])
    row_prev = np.full(ROWS, -1, np.int32)
    row_prev[:len(reqs)] = [q["n_row"] for q in reqs]
    # The sampler's draw key: tokens each row's request generated before it (the runner's count).
    generated = [[max(0, start + n - len(q["prompt"]) - len(d)) for q, (_, start, n, _), d in zip(reqs, args, ds)]
                 for args, ds in ((true_args, drafts_true), (opt_args, drafts_opt))]
    steps = [StepArrays(x, SamplingMetadata.from_arrays(sampling_arrays([SamplingParams(seed=3)] * len(reqs), ROWS,
                                                                        positions=g)),
                        need_logprobs=flag(False), use_bitmask=flag(False),
                        spec=build_spec_inputs(x.query_start_loc, ds, ROWS, K, BUCKET))
             for x, g, ds in ((true, generated[0], drafts_true), (opt, generated[1], drafts_opt))]
    return opt, true, row_prev, prev_tokens, num_emitted, num_drafts, steps


@jax.jit
def correct(opt, row_prev, prev_tokens, num_emitted, num_drafts):
    rejected = rejected_per_row(row_prev, num_emitted, num_drafts)
    shifted = shift_rows(opt, rejected, BS)
    return dataclasses.replace(shifted, input_ids=in_flight_ids(opt, prev_tokens)), rejected


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_corrected_inputs_are_those_built_on_the_true_tokens(seed, groups):
    rng = np.random.default_rng(seed)
    reqs = scenario(rng)
    opt, true, row_prev, prev_tokens, num_emitted, num_drafts, _ = build(reqs, rng, groups)
    assert not np.array_equal(opt.positions, true.positions)  # the correction has work to do
    got, rejected = correct(opt, row_prev, prev_tokens, num_emitted, num_drafts)
    want_rejected = [q["d"] - q["a"] if q["verify"] else 0 for q in reqs]
    np.testing.assert_array_equal(np.asarray(rejected)[:len(reqs)], want_rejected)
    assert not np.asarray(rejected)[len(reqs):].any()  # padding rows
    for name in ("input_ids", "positions", "slot_mapping", "kv_lens", "block_tables", "query_start_loc"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), getattr(true, name), err_msg=name)
    if groups > 1:
        np.testing.assert_array_equal(np.asarray(got.group_slot_mapping), true.group_slot_mapping)


def test_nothing_in_flight_changes_nothing():
    """A step whose rows N verified nothing for keeps every input (zero rejected, no in-flight id)."""
    rng = np.random.default_rng(7)
    reqs = [q for q in scenario(rng) if not q["verify"] and not q.get("resume")]
    opt, true, row_prev, prev_tokens, num_emitted, num_drafts, _ = build(reqs, rng, 1)
    got, rejected = correct(opt, row_prev, prev_tokens, num_emitted, num_drafts)
    assert not np.asarray(rejected).any()
    for name in ("input_ids", "positions", "slot_mapping", "kv_lens"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), getattr(opt, name), err_msg=name)


@pytest.mark.parametrize("seed", range(4))
def test_the_whole_step_is_the_one_built_on_the_true_tokens(seed):
    """``correct_in_flight`` on the step the host builds with N's drafts and the drafts after it
    in flight (the scheduler's placeholders): the model inputs, the drafts it verifies, which
    tokens the penalties count and each row's draw key are those of the step built on the true
    tokens, and nothing is left in flight."""
    rng = np.random.default_rng(seed)
    reqs = scenario(rng)
    opt, true, row_prev, prev_tokens, num_emitted, num_drafts, (true_step, opt_step) = build(reqs, rng, 1)
    flying = [q["n_row"] if q["verify"] or q.get("resume") else -1 for q in reqs]  # rows N left in flight
    np.testing.assert_array_equal(np.asarray(jax.jit(row_prev_rows)(opt)), flying + [-1] * (ROWS - len(reqs)))
    got = jax.jit(correct_in_flight, static_argnums=4)(opt_step, prev_tokens, num_emitted, num_drafts, BS)
    for name in ("input_ids", "positions", "slot_mapping", "kv_lens", "token_slots", "token_is_output",
                 "logits_indices", "row_slots"):
        np.testing.assert_array_equal(np.asarray(getattr(got.model, name)), getattr(true, name), err_msg=name)
    assert (np.asarray(got.model.prev_rows) == -1).all()
    for name in ("draft_token_ids", "num_draft_tokens", "logits_indices", "flat_index", "position_rows"):
        np.testing.assert_array_equal(np.asarray(getattr(got.spec, name)), getattr(true_step.spec, name),
                                      err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.sampling.positions), true_step.sampling.positions)
    assert not np.array_equal(opt_step.sampling.positions, true_step.sampling.positions)
