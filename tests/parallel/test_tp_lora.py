"""LoRA under tensor parallelism on two fake CPU devices (one subprocess runs every case,
:mod:`tests.parallel.tp_lora_runs`): a mixed batch of the base model and adapters on the layers,
the LM head and the embedding gives the one-device tokens and logprobs (on a vocabulary the
devices do not divide); each slot table is split as its base weight is; on the CPU the LoRA step
adds no collective to the base step's and gathers no table."""

from __future__ import annotations

import pytest

from tests.parallel.tp_lora_runs import CASES, DEVICES, ODD_VOCAB, run_in_subprocess

pytestmark = pytest.mark.slow  # eight engines compiled in a subprocess: about four minutes on two loaded cores
LOGPROB_TOLERANCE = 1e-4
KINDS = sorted({(arch, kind) for arch, _, kind in CASES})
# each table pair: the table split as its base weight, on which axis (a: (layers, in, slots, R),
# b: (layers, slots, R, out)); the other is whole on each device
SPLIT = {"qkv": ("b", 3), "gate_up": ("b", 3), "o": ("a", 1), "down": ("a", 1), "lm_head": ("b", 3), "embed": ("a", 1)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, int, str], dict]:
    runs = run_in_subprocess(tmp_path_factory.mktemp("tp_lora") / "runs.json", timeout=1800)
    return {(r["arch"], r["tp"], r["kind"]): r for r in runs}


def assert_close_rows(rows_of, ref_rows_of):
    for rows, ref_rows in zip(rows_of, ref_rows_of, strict=True):
        for row, ref_row in zip(rows, ref_rows, strict=True):
            assert set(row) == set(ref_row)
            assert max(abs(row[t] - ref_row[t]) for t in row) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("arch,kind", KINDS)
def test_two_devices_give_the_one_device_tokens_and_logprobs(results, arch, kind):
    run, ref = results[(arch, DEVICES, kind)], results[(arch, 1, kind)]
    assert run["device_ids"] == list(range(DEVICES))
    assert run["adapter_steps"] > 0 and run["prefix_hits"] > 0 and run["unexpected_compiles"] == 0
    assert run["tokens"] == ref["tokens"]
    assert_close_rows(run["logprobs"], ref["logprobs"])
    assert_close_rows(run["prompt_logprobs"], ref["prompt_logprobs"])
    if kind == "heads":  # the head's and embedding's tables span a vocabulary padded to the devices
        assert run["vocab"] == ODD_VOCAB and ODD_VOCAB % DEVICES and len(run["prompt_logprobs"]) == 2


@pytest.mark.parametrize("arch,kind", KINDS)
def test_tables_are_split_as_their_base_weights(results, arch, kind):
    run = results[(arch, DEVICES, kind)]
    tables = run["tables"]
    names = {key.split(".", 1)[1] for key in tables}
    assert names == (set(SPLIT) if kind == "heads" else set(SPLIT) - {"lm_head", "embed"})
    for name in names:
        split, axis = SPLIT[name]
        for ab in "ab":
            spec, shape, block = tables[f"{ab}.{name}"]
            if ab == split:
                assert spec[axis] == "tp" and block[axis] * DEVICES == shape[axis], (name, ab)
            else:
                assert block == shape, (name, ab)
    if kind == "heads":  # the padded vocabulary, as the base head and embedding store it
        padded = -(-run["vocab"] // DEVICES) * DEVICES
        assert tables["b.lm_head"][1][3] == padded and tables["a.embed"][1][1] == padded


@pytest.mark.parametrize("arch,kind", KINDS)
def test_the_lora_step_has_the_base_steps_collectives(results, arch, kind):
    run = results[(arch, DEVICES, kind)]
    counts = run["collectives"]
    # o and down per layer and the vocabulary-parallel embedding; the logits' one all-gather: XLA:CPU
    # merges the sum of o's and down's partial x @ a into the base's all-reduces (XLA:GPU keeps them
    # apart: scripts/gpu_aot_check.py --enable-lora), and the sum of the embedding LoRA's looked-up
    # A rows into the base embedding's; the head's delta is added to each device's logits slice
    # before their one gather, and no table is gathered
    assert counts["all-reduce"] == 2 * run["num_layers"] + 1
    assert counts["all-gather"] == 1
    assert not any(results[(arch, 1, kind)]["collectives"].values())
