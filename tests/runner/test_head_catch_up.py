"""The EAGLE head's catch-up inputs built from a step's device outputs
(``jaxserve.runner.head_catch_up``) against the host's, ``EagleProposer.propose`` run on the
true tokens after the step (its compiled program replaced by a recorder of its arguments)."""

import jax
import numpy as np
import pytest

from jaxserve.runner.eagle_runner import EagleProposer
from jaxserve.runner.head_catch_up import head_catch_up
from jaxserve.runner.input_batch import PersistentBatch, build_step_arrays, write_drafts
from tests.head_step_rows import step_row

BS, MAX_LEN, SLOTS, K = 4, 64, 8, 3
PAD = SLOTS
BUCKET, ROWS = 64, 8


def host_args(step, req_ids, contexts, samples, live, blind):
    """What the host's proposer hands its compiled program for this step."""
    head = object.__new__(EagleProposer)  # its bookkeeping only: the program is recorded, not run
    head.step_rows, head.table_width = {BUCKET: ROWS}, step.block_tables.shape[1]
    head.blind, head.num_computed, head.num_passes = set(blind), {}, 0
    head.weights = head.tables = head.kv = None
    seen = {}

    def program(bucket, hidden):
        def run(weights, tables, kv, hidden, ids, positions, slots, block_tables, kv_lens, qsl, num_seqs,
                logits_idx, proposing):
            seen.update(ids=ids, slots=slots, logits_idx=logits_idx, proposing=proposing)
            return kv, np.zeros((ROWS, K), np.int32)
        return run

    head._program = program
    head.propose(req_ids, contexts, samples, step, None, live)
    return seen


def scenario(rng):
    def toks(n):
        return [int(t) for t in rng.integers(1, 1000, n)]

    return [  # kind: verify (d drafts, a accepted), final (last prompt chunk), chunk (does not sample)
        dict(id="v", slot=2, known=toks(9), prompt=6, kind="verify", d=K, a=int(rng.integers(0, K))),
        dict(id="f", slot=0, known=toks(7), prompt=7, kind="final", start=3),
        dict(id="c", slot=4, known=toks(12), prompt=12, kind="chunk", start=4, n=5),
        dict(id="dead", slot=5, known=toks(6), prompt=4, kind="verify", d=2, a=int(rng.integers(0, 3)), live=False),
        dict(id="blind", slot=1, known=toks(8), prompt=5, kind="verify", d=K, a=1, blind=True),
        dict(id="p", slot=3, known=toks(5), prompt=5, kind="verify", d=0, a=0),  # a plain decode
        dict(id="all", slot=6, known=toks(6), prompt=3, kind="verify", d=K, a=K),
    ]


@pytest.mark.parametrize("seed", range(4))
def test_device_catch_up_is_the_hosts(seed):
    rng = np.random.default_rng(seed)
    reqs = scenario(rng)
    batch = PersistentBatch(SLOTS, MAX_LEN, -(-MAX_LEN // BS))
    free = list(rng.permutation(np.arange(1, 300)))
    starts, counts, drafts, contexts, samples = [], [], [], [], []
    emitted = np.full((ROWS, K + 1), -1, np.int32)
    next_known = np.zeros(ROWS, np.int32)
    for i, q in enumerate(reqs):
        known = q["known"]
        start, n, d, ctx, out, next_known[i] = step_row(q, rng)
        emitted[i, :len(out)] = out
        blocks = [int(free.pop()) for _ in range(-(-(start + n) // BS))]
        batch.add_request(q["slot"], known[:q["prompt"]], known[q["prompt"]:], (blocks,))
        starts.append(start)
        counts.append(n)
        drafts.append(d)
        contexts.append(np.asarray(ctx, np.int32))
        samples.append(q["kind"] != "chunk")
    slots = [q["slot"] for q in reqs]
    write_drafts(batch, slots, drafts)
    step, _ = build_step_arrays(batch, slots, starts, counts, [-1] * len(reqs), BUCKET, ROWS, BS, PAD,
                                [len(d) for d in drafts])
    live = [q.get("live", True) for q in reqs]
    want = host_args(step, [q["id"] for q in reqs], contexts, samples, live,
                     [q["id"] for q in reqs if q.get("blind")])

    def pad(values, dtype):
        out = np.zeros(ROWS, dtype)
        out[:len(values)] = values
        return out

    num_drafts = pad([len(d) for d in drafts], np.int32)
    num_emitted = (emitted >= 0).sum(1).astype(np.int32)  # as the sampler leaves it: 0 where none
    skip = pad([bool(q.get("blind")) for q in reqs], np.bool_)
    ids, slot_map, logits_idx, proposing = jax.jit(head_catch_up)(
        step.input_ids, step.slot_mapping, step.query_start_loc, emitted, num_emitted, num_drafts,
        pad(samples, np.bool_), next_known, pad(live, np.bool_), skip)
    np.testing.assert_array_equal(np.asarray(ids), want["ids"])
    np.testing.assert_array_equal(np.asarray(slot_map), want["slots"])
    np.testing.assert_array_equal(np.asarray(logits_idx), want["logits_idx"])
    np.testing.assert_array_equal(np.asarray(proposing), want["proposing"])
    assert want["proposing"][:len(reqs)].tolist() == [True, True, False, False, False, True, True]
