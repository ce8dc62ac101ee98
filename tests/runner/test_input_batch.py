"""The persistent batch and the vectorised step builder, against a per-request oracle."""

import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.runner.input_batch import PersistentBatch, build_step_arrays
from jaxserve.sample.metadata import SamplingTable, sampling_arrays

BS, MAX_LEN, SLOTS = 4, 32, 6
PAD = SLOTS


def oracle(reqs, bucket, rows):
    """Step inputs written request by request, straight from each request's token and block lists."""
    ids = np.zeros(bucket, np.int32)
    pos = np.zeros(bucket, np.int32)
    slot_map = np.full(bucket, -1, np.int32)
    prev = np.full(bucket, -1, np.int32)
    is_out = np.zeros(bucket, bool)
    tables = np.zeros((rows, -(-MAX_LEN // BS)), np.int32)
    kv_lens = np.zeros(rows, np.int32)
    qsl = np.zeros(rows + 1, np.int32)
    t = 0
    for r, q in enumerate(reqs):
        tokens = q["prompt"] + q["outputs"]
        for i in range(q["start"], q["start"] + q["n"]):
            if i < len(tokens):
                ids[t] = tokens[i]
            else:
                prev[t] = q["prev"]
            pos[t] = i
            slot_map[t] = q["blocks"][i // BS] * BS + i % BS
            is_out[t] = i >= len(q["prompt"])
            t += 1
        tables[r, : len(q["blocks"])] = q["blocks"]
        kv_lens[r] = q["start"] + q["n"]
        qsl[r + 1] = t
    qsl[len(reqs) + 1 :] = t
    return dict(input_ids=ids, positions=pos, slot_mapping=slot_map, prev_rows=prev, token_is_output=is_out,
                block_tables=tables, kv_lens=kv_lens, query_start_loc=qsl)


def test_step_arrays_match_a_per_request_oracle():
    rng = np.random.default_rng(0)
    batch = PersistentBatch(SLOTS, MAX_LEN, -(-MAX_LEN // BS))
    free_blocks = list(rng.permutation(np.arange(1, 200)))
    reqs = [
        dict(slot=3, prompt=[5, 6, 7, 8, 9, 10, 11], outputs=[], start=0, n=7, prev=-1),  # whole prompt
        dict(slot=0, prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], outputs=[], start=4, n=3, prev=-1),  # a chunk
        dict(slot=5, prompt=[4, 4, 4], outputs=[20, 21], start=4, n=1, prev=-1),  # decode, token known
        dict(slot=1, prompt=[9, 8, 7, 6, 5], outputs=[30], start=6, n=1, prev=2),  # decode, token in flight
        dict(slot=2, prompt=[2, 3], outputs=[40, 41, 42], start=0, n=5, prev=-1),  # recompute after preemption
    ]
    for q in reqs:
        length = q["start"] + q["n"]
        q["blocks"] = [int(free_blocks.pop()) for _ in range(-(-length // BS))]
        # blocks arrive in two parts, as a running request's new blocks do
        batch.add_request(q["slot"], q["prompt"], q["outputs"], (q["blocks"][:1],))
        batch.append_blocks(q["slot"], (q["blocks"][1:],))
    bucket, rows = 24, 6
    arrays, samples = build_step_arrays(
        batch, [q["slot"] for q in reqs], [q["start"] for q in reqs], [q["n"] for q in reqs],
        [q["prev"] for q in reqs], bucket, rows, BS, PAD)
    want = oracle(reqs, bucket, rows)
    for name, value in want.items():
        np.testing.assert_array_equal(getattr(arrays, name), value, err_msg=name)
    assert samples == [True, False, True, True, True]
    np.testing.assert_array_equal(arrays.row_slots, [3, 0, 5, 1, 2, PAD])
    np.testing.assert_array_equal(arrays.logits_indices[:5], want["query_start_loc"][1:6] - 1)
    assert arrays.num_seqs.tolist() == [5]
    total = want["query_start_loc"][-1]
    assert (arrays.token_slots[total:] == PAD).all() and (arrays.slot_mapping[total:] == -1).all()

    # sampled tokens land in their requests' rows; the next decode reads them from the host
    before = batch.num_tokens.copy()
    batch.append_tokens([1, 3], [77, 78])
    assert (batch.num_tokens - before).tolist() == [0, 1, 0, 1] + [0] * (len(before) - 4)
    arrays, _ = build_step_arrays(batch, [1], [6], [1], [-1], 1, 1, BS, PAD)
    assert arrays.input_ids[0] == 77 and arrays.prev_rows[0] == -1
    assert batch.token_ids[3, before[3]] == 78


def test_a_token_neither_known_nor_in_flight_is_an_error():
    batch = PersistentBatch(SLOTS, MAX_LEN, -(-MAX_LEN // BS))
    batch.add_request(0, [1, 2, 3], [], ([1],))
    with pytest.raises(RuntimeError, match="neither known"):
        build_step_arrays(batch, [0], [3], [1], [-1], 1, 1, BS, PAD)


def test_padding_only_step():
    batch = PersistentBatch(SLOTS, MAX_LEN, -(-MAX_LEN // BS))
    arrays, samples = build_step_arrays(batch, [], [], [], [], 8, 4, BS, PAD)
    assert samples == [] and arrays.num_seqs.tolist() == [0]
    assert (arrays.slot_mapping == -1).all() and (arrays.query_start_loc == 0).all()


def test_sampling_table_gather_equals_a_fresh_build_and_leaves_nothing_stale():
    table = SamplingTable(SLOTS, max_logit_bias=4, max_allowed_tokens=4)
    first = SamplingParams(temperature=0.7, top_k=5, seed=3, logit_bias={1: 2.0, 2: -1.0, 3: 0.5},
                           allowed_token_ids=[4, 5, 6])
    table.set_row(2, first, seed=None)
    # slot 2 is reused by a request with a shorter bias list and no allowed ids
    params = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, min_p=0.1, logit_bias={9: 1.0}),
              SamplingParams(temperature=1.2, repetition_penalty=1.3, allowed_token_ids=[7])]
    seeds = [11, 12, 13]
    for slot, p, s in zip([4, 2, 0], params, seeds):
        table.set_row(slot, p, s)
    rows = np.array([4, 2, 0, PAD, PAD], np.int32)
    got = table.gather(rows, positions=[0, 3, 8])
    want = sampling_arrays(params, 5, positions=[0, 3, 8], seeds=seeds, max_logit_bias=4, max_allowed_tokens=4)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_each_kv_group_gets_its_own_tables_and_slots():
    """Two KV cache groups: group g's block tables and slot mapping are what one group holding
    g's blocks would give; group 0's are also the plain fields."""
    rng = np.random.default_rng(1)
    batch = PersistentBatch(SLOTS, MAX_LEN, -(-MAX_LEN // BS), num_groups=2)
    free_blocks = list(rng.permutation(np.arange(1, 200)))
    reqs = [dict(slot=2, prompt=list(range(3, 14)), outputs=[], start=0, n=11, prev=-1),
            dict(slot=0, prompt=[1, 2, 3, 4, 5, 6], outputs=[7, 8], start=7, n=1, prev=-1)]
    per_group = []
    for q in reqs:
        count = -(-(q["start"] + q["n"]) // BS)
        blocks = tuple([int(free_blocks.pop()) for _ in range(count)] for _ in range(2))
        blocks[0][0] = 0  # a sliding group's block out of the window: the null block
        per_group.append(blocks)
        batch.add_request(q["slot"], q["prompt"], q["outputs"], tuple(b[:1] for b in blocks))
        batch.append_blocks(q["slot"], tuple(b[1:] for b in blocks))
    bucket, rows = 16, 4
    arrays, _ = build_step_arrays(batch, [q["slot"] for q in reqs], [q["start"] for q in reqs],
                                  [q["n"] for q in reqs], [q["prev"] for q in reqs], bucket, rows, BS, PAD)
    assert arrays.group_block_tables.shape[0] == 2 and arrays.group_slot_mapping.shape == (2, bucket)
    for g in range(2):
        want = oracle([{**q, "blocks": list(b[g])} for q, b in zip(reqs, per_group)], bucket, rows)
        np.testing.assert_array_equal(arrays.group_block_tables[g], want["block_tables"])
        np.testing.assert_array_equal(arrays.group_slot_mapping[g], want["slot_mapping"])
    np.testing.assert_array_equal(arrays.block_tables, arrays.group_block_tables[0])
    np.testing.assert_array_equal(arrays.slot_mapping, arrays.group_slot_mapping[0])
    assert not np.array_equal(arrays.group_slot_mapping[0], arrays.group_slot_mapping[1])


def test_spec_inputs_lay_the_scored_positions_end_to_end():
    from jaxserve.runner.input_batch import build_spec_inputs

    # three rows of 1, 4 and 3 scheduled tokens with 0, 3 and 2 drafts; K=3, bucket 16, 4 rows
    qsl = np.array([0, 1, 5, 8, 8], np.int32)
    spec = build_spec_inputs(qsl, [[], [7, 8, 9], [5, 6]], 4, 3, 16)
    assert spec.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 6, 7] + [0] * 8  # P = min(16, 4 * 4)
    assert spec.position_rows[:8].tolist() == [0, 1, 1, 1, 1, 2, 2, 2]
    assert spec.position_offsets[:8].tolist() == [0, 0, 1, 2, 3, 0, 1, 2]
    assert spec.flat_index.tolist() == [[0, 0, 0, 0], [1, 2, 3, 4], [5, 6, 7, 7], [0, 0, 0, 0]]
    assert spec.num_draft_tokens.tolist() == [0, 3, 2, 0]
    assert spec.draft_token_ids.tolist() == [[0, 0, 0], [7, 8, 9], [5, 6, 0], [0, 0, 0]]
    # never more positions than rows can hold
    assert build_spec_inputs(qsl, [[], [7, 8, 9], [5, 6]], 4, 3, 64).logits_indices.shape == (16,)
