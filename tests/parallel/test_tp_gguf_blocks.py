"""``--quantization gguf`` at tensor_parallel_size 2: the kept blocks and their scales split over
two CPU devices as the float kernels are, giving the tokens and logprobs of one device
(:mod:`.tp_gguf_runs`, in a process of its own)."""

from __future__ import annotations

import pytest

from tests.parallel.tp_gguf_runs import run_in_subprocess


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_in_subprocess(tmp_path_factory.mktemp("tp_gguf") / "out.json", timeout=600)


def test_two_devices_give_one_devices_tokens_and_logprobs(results):
    by_file: dict[str, dict[int, dict]] = {}
    for case in (c for c in results if not c["scanned"]):
        by_file.setdefault(case["file"], {})[case["tp"]] = case
    assert sorted(by_file) == ["Q4_1/Q4_1", "Q8_0/F32"]
    for cases in by_file.values():
        one, two = cases[1], cases[2]
        assert two["tokens"] == one["tokens"]
        for rows_one, rows_two in zip(one["logprobs"], two["logprobs"], strict=True):
            for top_one, top_two in zip(rows_one, rows_two, strict=True):
                assert top_two.keys() == top_one.keys()
                for token, logprob in top_one.items():
                    assert top_two[token] == pytest.approx(logprob, abs=1e-4)


def test_each_device_holds_half_of_every_split_block_array(results):
    """q|k|v and gate|up split on their output rows, o and down on their input blocks (the scales
    with them), the kept embedding on its vocabulary rows."""
    for case in (c for c in results if c["tp"] == 2 and not c["scanned"]):
        whole = next(c for c in results if c["file"] == case["file"] and c["tp"] == 1)["block_shards"]
        assert case["block_shards"].keys() == whole.keys()
        for name, shards in case["block_shards"].items():
            (full,) = whole[name]
            axis = 1 if (".o_proj." in name or ".down_proj." in name) else 0
            expected = [d // 2 if i == axis else d for i, d in enumerate(full)]
            assert shards == [expected, expected], name
    assert any(name.startswith("embed_tokens.head.") for name in results[-1]["block_shards"])


def test_a_scanned_stack_split_over_two_devices_gives_one_devices_tokens(results):
    """Scanned, each layer's kernel reads its blocks from the split (layers, ...) stack in place,
    given the layer index: the layer axis stays whole, the rest split as unrolled."""
    (scanned,) = [c for c in results if c["scanned"]]
    one = next(c for c in results if c["file"] == scanned["file"] and c["tp"] == 1)
    assert scanned["tp"] == 2 and scanned["tokens"] == one["tokens"]
    for rows_one, rows_two in zip(one["logprobs"], scanned["logprobs"], strict=True):
        for top_one, top_two in zip(rows_one, rows_two, strict=True):
            assert top_two.keys() == top_one.keys()
            for token, logprob in top_one.items():
                assert top_two[token] == pytest.approx(logprob, abs=1e-4)
    layers = {name: shards for name, shards in scanned["block_shards"].items() if name.startswith("layers.")}
    down = next(shards for name, shards in layers.items() if name.endswith("down_proj.qs"))
    assert down[0] == down[1] and down[0][0] == 2  # [layers, hidden, intermediate / 2 in bytes]
    assert down[0][2] * 2 == next(s for n, s in one["block_shards"].items() if n.endswith("0.mlp.down_proj.qs"))[0][1]
