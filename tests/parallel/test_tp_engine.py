"""Tensor parallelism end to end on eight fake CPU devices (one subprocess runs every case,
:mod:`tests.parallel.tp_runs`): the same greedy tokens and logprobs as one device, each shard on
its own device, weights per device falling as 1/N, and the collectives Megatron's plan implies."""

from __future__ import annotations

import math

import pytest

from jaxserve.bench.hlo_collectives import Collectives
from tests.parallel.tp_runs import CASES, run_in_subprocess

LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, int], dict]:
    runs = run_in_subprocess(tmp_path_factory.mktemp("tp") / "runs.json", timeout=1200)
    return {(r["arch"], r["tp"]): r for r in runs}


def _reference(results, arch: str) -> dict:
    return results[(arch, 1)]


SHARDED = [(arch, tp) for arch, tp, _ in CASES if tp > 1]


def test_every_case_ran_on_its_devices_with_its_backend(results):
    assert len(results) == len(CASES)
    for arch, tp, backend in CASES:
        run = results[(arch, tp)]
        assert run["backend"] == backend
        assert run["device_ids"] == list(range(tp))  # the first N devices, in order


@pytest.mark.parametrize("arch,tp", SHARDED)
def test_sharded_engine_gives_the_single_device_tokens_and_logprobs(results, arch, tp):
    run, ref = results[(arch, tp)], _reference(results, arch)
    assert run["preemptions"] > 0 and ref["preemptions"] > 0  # the workload did preempt
    assert run["prefix_hits"] > 0  # and hit the prefix cache
    assert run["tokens"] == ref["tokens"]
    for rows, ref_rows in zip(run["logprobs"], ref["logprobs"]):
        for row, ref_row in zip(rows, ref_rows):
            assert set(row) == set(ref_row)
            assert max(abs(row[t] - ref_row[t]) for t in row) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("arch,tp", SHARDED)
def test_split_weights_per_device_fall_as_one_over_n(results, arch, tp):
    run, ref = results[(arch, tp)], _reference(results, arch)
    per_device = run["split_weight_bytes_per_device"]
    assert len(per_device) == tp and len(set(per_device)) == 1  # every device holds one equal block
    assert per_device[0] * tp == run["split_weight_bytes_total"]
    # all shards together hold the one-device weights, plus copies of replicated key/value heads
    # and the vocabulary's padding rows (under 1%)
    if run["kv_replicas"] == 1:
        assert math.isclose(run["split_weight_bytes_total"], ref["split_weight_bytes_total"], rel_tol=0.01)
    else:
        assert ref["split_weight_bytes_total"] < run["split_weight_bytes_total"] < (
            ref["split_weight_bytes_total"] * run["kv_replicas"])
    replicated = max(ref["weight_bytes_per_device"]) - ref["split_weight_bytes_total"]
    assert max(run["weight_bytes_per_device"]) == per_device[0] + replicated


@pytest.mark.parametrize("arch,tp", SHARDED)
def test_step_holds_two_all_reduces_per_layer_and_gathers_no_weight(results, arch, tp):
    run = results[(arch, tp)]
    counts = run["collectives"]
    # o and down per layer, the vocabulary-parallel embedding; the logits' one all-gather
    assert counts["all-reduce"] == 2 * run["num_layers"] + 1
    assert counts["all-gather"] == 1
    assert counts["reduce-scatter"] == counts["all-to-all"] == counts["collective-permute"] == 0
    gathered = Collectives(run["collectives"], tuple(map(tuple, run["all_gather_shapes"])))
    assert gathered.weight_all_gathers(map(tuple, run["weight_shapes"])) == []


def test_single_device_step_has_no_collectives(results):
    for arch, tp, _ in CASES:
        if tp == 1:
            assert not any(results[(arch, 1)]["collectives"].values())
