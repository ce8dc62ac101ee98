"""MTP (the target's own multi-token-prediction layer, ``method: mtp``) under tensor parallelism
on two fake CPU devices: a tiny MiMo target split two ways drafts with its layer split as one
target layer (q/k/v with their biases and gate/up by output columns, o and down by input rows,
the one-layer pool on the key/value heads; ``input_proj`` and the norms replicated), reading the
target's vocabulary-split embedding and tied LM head in place. It gives the one-device greedy
tokens, logprobs, drafts and accepted counts, with chunked prefill and a prefix hit, and compiles
nothing after warm-up. One engine pair in a subprocess (:mod:`tests.parallel.tp_spec_runs`)."""

from __future__ import annotations

import pytest

from jaxserve.models.tp_layout import EAGLE_SPLIT_AXES
from tests.parallel.device_runs import run_module
from tests.parallel.tp_spec_checks import (
    assert_ran_chunked_with_a_prefix_hit_and_no_compile_after_warm_up,
    assert_same_tokens_logprobs_and_drafts,
    assert_split_on_the_heads,
    weight_all_gathers,
)
from tests.parallel.tp_spec_runs import DEVICES

pytestmark = pytest.mark.slow  # two engines compiled in a subprocess


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("tp_spec_mtp") / "runs.json"
    return {r["tp"]: r for r in run_module("tests.parallel.tp_spec_runs", out, DEVICES, 900, "mtp")}


def test_two_devices_give_the_one_device_tokens_logprobs_drafts_and_acceptance(runs):
    assert sorted(runs) == [1, DEVICES]
    for run in runs.values():
        assert_ran_chunked_with_a_prefix_hit_and_no_compile_after_warm_up(run)
    assert_same_tokens_logprobs_and_drafts(runs[DEVICES], runs[1])
    assert runs[DEVICES]["accepted"] > 0


def test_the_layer_is_split_as_a_target_layer_and_the_rest_replicated(runs):
    run = runs[DEVICES]
    assert not runs[1]["split"]
    assert_split_on_the_heads(run, 2, DEVICES)
    names = run["weight_names"]
    assert "input_proj.weight" in names and "layers.0.self_attn.q_proj.bias" in names
    for name, (spec, shape, block) in zip(names, run["weights"], strict=True):
        axis = EAGLE_SPLIT_AXES.get(name.removeprefix("layers.0."))
        if axis is None:  # input_proj and the norms read whole hidden states
            assert "tp" not in spec and block == shape, name
        else:
            assert spec[axis] == "tp" and block[axis] * DEVICES == shape[axis], name


def test_the_programs_gather_no_weight(runs):
    """All-reduces (the split layer's partial sums, the vocabulary-parallel embedding rows) and
    the gathered logits; never a weight, the target's embedding and LM head included."""
    run = runs[DEVICES]
    assert weight_all_gathers(run) == []
    assert run["collectives"]["all-reduce"] > 0
    assert not any(runs[1]["collectives"].values())
