"""Speculative decoding under tensor parallelism on two fake CPU devices (one subprocess runs
every case, :mod:`tests.parallel.tp_spec_runs`): a draft model split like the target, one whose
heads two devices do not divide (replicated) and EAGLE-1 and EAGLE-3 heads split as one target
layer each give
the one-device greedy tokens, logprobs and acceptance counts, with chunked prefill and a prefix
hit, and compile nothing after warm-up; the proposers' weights and pools are placed as planned.
(MTP: tests/parallel/test_tp_spec_mtp.py.)"""

from __future__ import annotations

import pytest

from tests.parallel.tp_spec_checks import (
    assert_ran_chunked_with_a_prefix_hit_and_no_compile_after_warm_up,
    assert_same_tokens_logprobs_and_drafts,
    assert_split_on_the_heads,
    weight_all_gathers,
)
from tests.parallel.tp_spec_runs import CASES, DEVICES, REFERENCE, VOCAB, run_in_subprocess

pytestmark = pytest.mark.slow  # nine engines compiled in a subprocess: several minutes on two loaded cores
SPLIT_KINDS = [kind for kind, tp in CASES if tp == DEVICES]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, int], dict]:
    runs = run_in_subprocess(tmp_path_factory.mktemp("tp_spec") / "runs.json", timeout=1800)
    return {(r["kind"], r["tp"]): r for r in runs}


def test_every_case_ran_chunked_with_a_prefix_hit_and_no_compile_after_warm_up(results):
    assert sorted(results) == sorted(CASES)
    for run in results.values():
        assert_ran_chunked_with_a_prefix_hit_and_no_compile_after_warm_up(run)


@pytest.mark.parametrize("kind", SPLIT_KINDS)
def test_two_devices_give_the_one_device_tokens_logprobs_and_acceptance(results, kind):
    assert_same_tokens_logprobs_and_drafts(results[(kind, DEVICES)], results[(REFERENCE.get(kind, kind), 1)])


def test_the_self_draft_and_the_head_get_drafts_accepted(results):
    draft, head = results[("draft", DEVICES)], results[("eagle", DEVICES)]
    assert draft["accepted"] >= 0.9 * draft["drafted"]  # the target drafting for itself
    assert head["accepted"] > 0


@pytest.mark.parametrize("kind", ["draft", "eagle", "eagle3"])
def test_a_split_proposer_holds_its_share_of_the_heads(results, kind):
    """The draft's pool [L, blocks, bs, Hkv, D] and the head's [blocks, bs, Hkv, D] are split on
    the key/value heads, as the target's is; some weights are split, each device holding half."""
    run = results[(kind, DEVICES)]
    assert not results[(kind, 1)]["split"]
    assert_split_on_the_heads(run, 3 if kind == "draft" else 2, DEVICES)
    if kind == "draft":  # the draft's embedding, split on the vocabulary padded to the devices
        split = [shape for spec, shape, _ in run["weights"] if "tp" in spec]
        assert [VOCAB + 1, 64] in split and VOCAB % DEVICES


@pytest.mark.parametrize("kind", ["odd_draft", "eagle_whole"])
def test_a_draft_the_devices_do_not_divide_or_asked_whole_is_replicated(results, kind):
    run = results[(kind, DEVICES)]
    assert not run["split"]
    for spec, shape, block in run["pool"] + run["weights"]:
        assert "tp" not in spec and block == shape


@pytest.mark.parametrize("kind", SPLIT_KINDS)
def test_proposer_programs_gather_no_weight(results, kind):
    """A split proposer's programs sum partial products (all-reduces) and gather logits, never a
    weight (its own or the target's embedding and LM head, which an EAGLE head reads split, whole
    or not); a replicated draft runs with no collective at all."""
    run = results[(kind, DEVICES)]
    assert weight_all_gathers(run) == []
    if run["split"] or kind == "eagle_whole":
        assert run["collectives"]["all-reduce"] > 0
    else:
        assert not any(run["collectives"].values())
    assert not any(results[(REFERENCE.get(kind, kind), 1)]["collectives"].values())
