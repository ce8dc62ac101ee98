"""LLaVA and Qwen2.5-VL under tensor parallelism on two fake CPU devices (one subprocess runs every
case, :mod:`tests.parallel.tp_vlm_runs`): the language model split as the text models are, the
tower on one device; image prompts in chunks through the images give the one-device tokens and
logprobs, a repeated image still hits the prefix cache, and nothing compiles after warm-up."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL")

from tests.parallel.tp_vlm_runs import CASES, DEVICES, run_in_subprocess

pytestmark = pytest.mark.slow  # four VLM engines compiled in a subprocess: about two minutes on two loaded cores
LOGPROB_TOLERANCE = 1e-4
FAMILIES = sorted({family for family, _ in CASES})


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, int], dict]:
    runs = run_in_subprocess(tmp_path_factory.mktemp("tp_vlm") / "runs.json", timeout=1200)
    return {(r["family"], r["tp"]): r for r in runs}


@pytest.mark.parametrize("family", FAMILIES)
def test_two_devices_give_the_one_device_tokens_and_logprobs(results, family):
    run, ref = results[(family, DEVICES)], results[(family, 1)]
    assert run["device_ids"] == list(range(DEVICES)) and ref["device_ids"] == [0]
    assert run["tokens"] == ref["tokens"]
    for rows, ref_rows in zip(run["logprobs"], ref["logprobs"]):
        for row, ref_row in zip(rows, ref_rows):
            assert set(row) == set(ref_row)
            assert max(abs(row[t] - ref_row[t]) for t in row) < LOGPROB_TOLERANCE
    # the repeated image prompt: a prefix hit through its image, the same tokens
    assert run["again_cached"] == ref["again_cached"] > 0 and run["again_tokens"] == run["tokens"][0]
    assert run["images_encoded"] == ref["images_encoded"] == 3
    assert run["unexpected_compiles"] == ref["unexpected_compiles"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_language_model_is_split_over_the_devices(results, family):
    (one,), split = results[(family, 1)]["weight_bytes"], results[(family, DEVICES)]["weight_bytes"]
    assert len(split) == DEVICES and all(b < 0.75 * one for b in split)
