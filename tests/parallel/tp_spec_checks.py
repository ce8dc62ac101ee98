"""The checks a speculating engine split over devices passes against its one-device run (results
as :mod:`tests.parallel.tp_spec_runs` writes them), shared by the tensor-parallel spec tests."""

from __future__ import annotations

LOGPROB_TOLERANCE = 1e-4


def assert_ran_chunked_with_a_prefix_hit_and_no_compile_after_warm_up(run: dict) -> None:
    assert run["device_ids"] == list(range(run["tp"]))
    assert run["max_prefill_steps"] > 1 and run["prefix_hits"] > 0
    assert run["new_compiles"] == 0 and run["unexpected_compiles"] == 0
    assert run["drafted"] > 0


def assert_same_tokens_logprobs_and_drafts(run: dict, ref: dict) -> None:
    """``run`` gives ``ref``'s greedy tokens, its top logprobs (within :data:`LOGPROB_TOLERANCE`)
    and its drafts: as many proposed, accepted, and at each position."""
    assert run["tokens"] == ref["tokens"]
    for rows, ref_rows in zip(run["logprobs"], ref["logprobs"], strict=True):
        for row, ref_row in zip(rows, ref_rows, strict=True):
            assert set(row) == set(ref_row)
            assert max(abs(row[t] - ref_row[t]) for t in row) < LOGPROB_TOLERANCE
    assert (run["drafted"], run["accepted"], run["accepted_per_pos"]) == (
        ref["drafted"], ref["accepted"], ref["accepted_per_pos"])


def assert_split_on_the_heads(run: dict, heads_axis: int, devices: int) -> None:
    """The proposer's two pools are split on the key/value heads (``heads_axis``), as the target's
    is; some weights are split, each device holding ``1 / devices`` of them."""
    assert run["split"]
    assert len(run["pool"]) == 2  # K and V
    for spec, shape, block in run["pool"]:
        assert spec[heads_axis] == "tp" and block[heads_axis] * devices == shape[heads_axis]
        assert block[:heads_axis] == shape[:heads_axis]
    split = [(spec, shape, block) for spec, shape, block in run["weights"] if "tp" in spec]
    assert split
    for spec, shape, block in split:
        axis = spec.index("tp")
        assert block[axis] * devices == shape[axis]


def weight_all_gathers(run: dict) -> list:
    """The all-gathers of the proposer's programs that make a weight's shape (its own or the target's)."""
    from jaxserve.bench.hlo_collectives import Collectives

    gathered = Collectives(run["collectives"], tuple(map(tuple, run["all_gather_shapes"])))
    return gathered.weight_all_gathers(map(tuple, run["weight_shapes"]))
