"""LoRA under tensor parallelism on two fake CPU devices (one subprocess runs every case,
:mod:`tests.parallel.tp_lora_runs`): a mixed batch of the base model and two adapters gives the
one-device tokens and logprobs; each slot table is split as its base weight is; on the CPU the
LoRA step adds no collective to the base step's and gathers no table."""

from __future__ import annotations

import pytest

from tests.parallel.tp_lora_runs import CASES, DEVICES, run_in_subprocess

pytestmark = pytest.mark.slow  # four engines compiled in a subprocess: about two minutes on two loaded cores
LOGPROB_TOLERANCE = 1e-4
ARCHS = sorted({arch for arch, _ in CASES})


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, int], dict]:
    runs = run_in_subprocess(tmp_path_factory.mktemp("tp_lora") / "runs.json", timeout=1200)
    return {(r["arch"], r["tp"]): r for r in runs}


@pytest.mark.parametrize("arch", ARCHS)
def test_two_devices_give_the_one_device_tokens_and_logprobs(results, arch):
    run, ref = results[(arch, DEVICES)], results[(arch, 1)]
    assert run["device_ids"] == list(range(DEVICES))
    assert run["adapter_steps"] > 0 and run["prefix_hits"] > 0 and run["unexpected_compiles"] == 0
    assert run["tokens"] == ref["tokens"]
    for rows, ref_rows in zip(run["logprobs"], ref["logprobs"]):
        for row, ref_row in zip(rows, ref_rows):
            assert set(row) == set(ref_row)
            assert max(abs(row[t] - ref_row[t]) for t in row) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_tables_are_split_as_their_base_weights(results, arch):
    tables = results[(arch, DEVICES)]["tables"]
    # column-split base (q|k|v, gate|up): b split on its output columns, a whole on each device;
    # row-split base (o, down): a split on its input rows, b whole
    for name, split in (("qkv", "b"), ("gate_up", "b"), ("o", "a"), ("down", "a")):
        for ab in "ab":
            spec, shape, block = tables[f"{ab}.{name}"]
            axis = 3 if ab == "b" else 1  # a: (layers, in, slots, R), b: (layers, slots, R, out)
            if ab == split:
                assert spec[axis] == "tp" and block[axis] * DEVICES == shape[axis], (name, ab)
            else:
                assert block == shape, (name, ab)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_lora_step_has_the_base_steps_collectives(results, arch):
    run = results[(arch, DEVICES)]
    counts = run["collectives"]
    # o and down per layer and the vocabulary-parallel embedding; the logits' one all-gather: XLA:CPU
    # merges the sum of o's and down's partial x @ a into the base's all-reduces (XLA:GPU keeps them
    # apart: scripts/gpu_aot_check.py --enable-lora), and no table is gathered
    assert counts["all-reduce"] == 2 * run["num_layers"] + 1
    assert counts["all-gather"] == 1
    assert not any(results[(arch, 1)]["collectives"].values())
