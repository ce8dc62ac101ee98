"""Speculative decoding with EAGLE heads (``method: eagle`` / ``eagle3``) on the demo model, the
heads random checkpoints in their published layouts (tests/eagle_heads.py).

Every proposal equals the drafts an independent dense numpy computation makes from the head's
tensors and the target's hidden states (tests/eagle_reference.py). The EAGLE-1 head is built
to mostly pass the target's hidden state through (``fc`` near ``[0 | I]``, the MLP's output
scaled down; the target's own logits at the position before the last token would propose the
last token again, which the demo model, repeating tokens, often accepts), so that some drafts
are accepted; the EAGLE-3 head is random with a 512-token draft vocabulary mapped by ``d2t``.
Either way greedy tokens and logprobs equal the plain engine's, under chunked prefill,
preemption and prefix hits too; the pools end empty, nothing compiles after warm-up, the metrics
count the drafts."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.exceptions import ConfigError
from jaxserve.models.safetensors_io import SafetensorsFile
from tests.eagle_checks import (
    assert_drafts_equal_the_reference,
    assert_pools_empty,
    recorded_proposals,
    sequences_of,
    write_near_pass_through_head,
)
from tests.eagle_heads import write_eagle_head
from tests.shapes import ENGINE_TESTS_SHAPE
from tests.spec_helpers import assert_metrics_count_the_drafts, assert_same_logprobs, prompts, stats_of, token_ids

K = 3
SPEC_SHAPE = {**ENGINE_TESTS_SHAPE, "num_gpu_blocks_override": 80}
DRAFT_VOCAB = 512


@pytest.fixture(scope="module")
def near_pass_through_head(demo_model, tmp_path_factory) -> str:
    return write_near_pass_through_head(tmp_path_factory.mktemp("eagle") / "head", demo_model)


@pytest.fixture(scope="module")
def eagle3_head(demo_model, tmp_path_factory) -> str:
    return write_eagle_head(tmp_path_factory.mktemp("eagle3") / "head", demo_model, "eagle3", seed=1,
                            draft_vocab_size=DRAFT_VOCAB)


@pytest.fixture(scope="module")
def plain(demo_model):
    return LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)


@pytest.fixture(scope="module")
def eagle(demo_model, near_pass_through_head):
    return LLM(demo_model, show_progress=False, **SPEC_SHAPE,
               speculative_config={"method": "eagle", "model": near_pass_through_head, "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def eagle3(demo_model, eagle3_head):
    return LLM(demo_model, show_progress=False, **SPEC_SHAPE,
               speculative_config={"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": K})


@pytest.mark.parametrize("which", ["eagle", "eagle3"])
def test_greedy_tokens_and_logprobs_equal_plain(which, plain, request, monkeypatch, eagle3_head):
    llm = request.getfixturevalue(which)
    compiles = llm.stats()["compile_num_compiles"]
    before = (stats_of(llm).num_draft_tokens, stats_of(llm).num_accepted_tokens)
    seen = recorded_proposals(llm, monkeypatch)
    ps = prompts(6, seed=0)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3)
    want, got = plain.generate(ps, params, use_tqdm=False), llm.generate(ps, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert_same_logprobs(want, got)
    drafted = stats_of(llm).num_draft_tokens - before[0]
    accepted = stats_of(llm).num_accepted_tokens - before[1]
    assert drafted > 0 and seen and all(len(d) == K for _, d in seen)
    if which == "eagle":
        assert 0 < accepted < drafted
    else:  # draft ids mapped through d2t: target ids among the draft vocabulary's
        file = SafetensorsFile(f"{eagle3_head}/model.safetensors")
        targets = set((np.arange(DRAFT_VOCAB) + file.get("d2t")).tolist())
        assert all(set(d) <= targets for _, d in seen)
        assert len({t for _, d in seen for t in d}) > 1
    assert llm.stats()["compile_num_compiles"] == compiles
    assert llm.stats()["compile_unexpected_compiles"] == 0
    assert_pools_empty(llm)


@pytest.mark.parametrize("which", ["eagle", "eagle3"])
def test_drafts_equal_a_dense_reference(which, demo_model, request, monkeypatch):
    """Each proposal (catch-up over accepted and rejected drafts, the K-step loop) equals the
    dense computation over the whole context from the target's hidden states of one prefill."""
    llm = request.getfixturevalue(which)
    folder = request.getfixturevalue("near_pass_through_head" if which == "eagle" else "eagle3_head")
    seen = recorded_proposals(llm, monkeypatch)
    ps = prompts(2, seed=5)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert_drafts_equal_the_reference(llm, which, folder, demo_model, sequences_of(ps, outs), seen)


def test_chunked_prefill_and_preemption(plain, eagle):
    # Prompts of 90-110 tokens are chunked by the 64-token budget; 16 of them overflow the
    # 80-block pool, so requests are preempted and resumed (from a prefix hit or recomputed).
    ps = prompts(16, seed=2, lo=90, hi=110)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    want = token_ids(plain.generate(ps, params, use_tqdm=False))
    scheduler = eagle.llm_engine.core.scheduler
    preemptions, accepted = scheduler.num_preemptions, stats_of(eagle).num_accepted_tokens
    assert token_ids(eagle.generate(ps, params, use_tqdm=False)) == want
    assert scheduler.num_preemptions > preemptions
    assert stats_of(eagle).num_accepted_tokens > accepted
    assert_pools_empty(eagle)


def test_prefix_hits(plain, eagle3, eagle3_head, demo_model, monkeypatch):
    """The head's KV lives in the target's blocks: a prefix hit (one block short of the target's
    usual one, vLLM's rule for EAGLE) brings it along, and the drafts after it are those of the
    dense computation over the whole context."""
    ps = prompts(3, seed=3, lo=60, hi=90)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = token_ids(plain.generate(ps, params, use_tqdm=False))
    assert token_ids(eagle3.generate(ps, params, use_tqdm=False)) == want
    seen = recorded_proposals(eagle3, monkeypatch)
    again = eagle3.generate(ps, params, use_tqdm=False)  # the target's prefix cache hits
    assert [o.num_cached_tokens for o in again] == [((len(p["prompt_token_ids"]) - 1) // 16 - 1) * 16 for p in ps]
    assert token_ids(again) == want
    assert_drafts_equal_the_reference(eagle3, "eagle3", eagle3_head, demo_model, sequences_of(ps, again), seen)
    assert_pools_empty(eagle3)


def test_metrics_count_the_drafts(eagle3):
    assert_metrics_count_the_drafts(eagle3, K)


def test_the_target_hands_over_the_layers_eagle3_reads(demo_model):
    """The residual stream entering layers 0, 1 and 2: the embeddings first, and the same
    whether the layers run scanned or unrolled."""
    from jaxserve.layers.attention import AttentionMetadata
    from jaxserve.models import load_model
    from jaxserve.runner.kv_cache import allocate_kv_cache
    from pallas_kernels import get_attention_fn

    ids = np.arange(5, 13, dtype=np.int32)
    n = len(ids)
    md = AttentionMetadata(*(jax.numpy.asarray(a, jax.numpy.int32) for a in (
        np.arange(n), np.arange(n) + 16, [[1]], [n], [0, n], [1])))  # one sequence in block 1
    auxes = []
    for scan in (False, True):
        model = load_model(demo_model, scan_layers=scan)
        kv = allocate_kv_cache(model.config, 4, 16)
        hidden, _, _, aux = model.forward_with_aux(ids, kv, md, get_attention_fn("xla"), aux_layers=(2, 0, 1))
        h = model.config.hidden_size
        assert aux.shape == (n, 3 * h)
        np.testing.assert_allclose(aux[:, :h], model.embed_tokens(jax.numpy.asarray(ids)), rtol=1e-6)
        assert not np.allclose(aux[:, h:2 * h], aux[:, 2 * h:])
        assert not np.allclose(aux[:, 2 * h:], hidden)  # the last layer's input, not its output
        auxes.append(np.asarray(aux))
    np.testing.assert_allclose(auxes[0], auxes[1], rtol=1e-5, atol=1e-5)


def _refused(demo_model, head: str, method: str, words: str, **extra) -> None:
    with pytest.raises(ConfigError, match=words):
        LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE,
            speculative_config={"method": method, "model": head, "num_speculative_tokens": 2}, **extra)


@pytest.mark.parametrize("method, kwargs, words", [
    ("eagle", dict(drop=("fc.weight",)), r"speculative_config\.model.*no tensor fc\.weight"),
    ("eagle3", dict(drop=("d2t",)), r"speculative_config\.model.*no tensor d2t"),
    ("eagle3", dict(drop=("lm_head.weight",)), r"speculative_config\.model.*no tensor lm_head\.weight"),
    ("eagle", dict(vocab_size=2048), r"speculative_config\.model.*vocab_size 2048"),
    ("eagle", dict(hidden_size=128), r"speculative_config\.model.*hidden_size 128"),
    ("eagle3", dict(eagle_aux_hidden_state_layer_ids=[0, 1, 7]), r"eagle_aux_hidden_state_layer_ids"),
])
def test_bad_heads_are_refused_by_name(demo_model, tmp_path, method, kwargs, words):
    head = write_eagle_head(tmp_path / "head", demo_model, method, draft_vocab_size=DRAFT_VOCAB, **kwargs)
    _refused(demo_model, head, method, words)


def test_a_head_of_the_other_method_is_refused_by_shape(demo_model, tmp_path):
    head = write_eagle_head(tmp_path / "head", demo_model, "eagle")
    _refused(demo_model, head, "eagle3", r"fc\.weight has shape \[64, 128\], expected \[64, 192\]")


def test_unsupported_combinations_are_refused(demo_model, tmp_path):
    head = write_eagle_head(tmp_path / "head", demo_model, "eagle")
    _refused(demo_model, "/no/such/folder", "eagle", r"speculative_config\.model")
    with pytest.raises(ConfigError, match=r"speculative_config\.quantization is for method draft_model"):
        LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE, speculative_config={
            "method": "eagle", "model": head, "num_speculative_tokens": 2, "quantization": "int8"})


def test_the_auto_off_rule_keeps_the_head_caught_up(plain, demo_model, near_pass_through_head, monkeypatch):
    """Under the auto-off rule the head still catches up on the steps the rule keeps plain (their
    hidden states exist only then): the drafts of the steps it speculates on equal the dense
    computation over the whole context, and greedy output is the plain engine's."""
    from jaxserve.spec_decode.auto_off import SpecAutoOff

    llm = LLM(demo_model, show_progress=False, **SPEC_SHAPE, speculative_auto_off=True,
              speculative_config={"method": "eagle", "model": near_pass_through_head, "num_speculative_tokens": K})
    rule = SpecAutoOff(K, probe_every=3, prior_alpha=0.0)  # off, except every third step
    for _ in range(200):  # a compute-bound cost model: only accepted drafts could pay
        rule.observe_step(1, 0.001)
        rule.observe_step(64, 0.064)
    llm.llm_engine.core.spec_auto_off = rule
    seen = recorded_proposals(llm, monkeypatch)
    ps = prompts(2, seed=6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    last = llm.get_step_records(1)[0].step if llm.get_step_records(1) else -1
    outs = llm.generate(ps, params, use_tqdm=False)
    records = [r for r in llm.get_step_records() if r.step > last and r.spec_auto_off]
    assert token_ids(outs) == token_ids(plain.generate(ps, params, use_tqdm=False))
    assert any(r.spec_auto_off.startswith("off") for r in records)
    assert any(r.num_draft_tokens for r in records)
    assert_drafts_equal_the_reference(llm, "eagle", near_pass_through_head, demo_model, sequences_of(ps, outs),
                                      seen)
    assert_pools_empty(llm)
