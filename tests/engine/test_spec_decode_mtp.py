"""Speculative decoding with the target's own multi-token-prediction layer (``method: mtp``) on a
tiny random MiMo checkpoint (tests/mtp_models.py): a Qwen2 folder plus ``model.mtp_layers.*``.

The plain engine serves the Qwen2 folder the MiMo one was made from (the MTP tensors ignored, the
decoder the same), so equal greedy output shows both the target loading as before and the drafts
verified correctly. The target is tied and its MTP layer near a pass-through of the token it
reads: the tiny model's greedy output repeats tokens and the drafts repeat the last one, so most
drafts are accepted and some are not. Every proposal equals the drafts of a dense numpy computation of MiMo's MTP
formula from the checkpoint's tensors (tests/mtp_reference.py), K larger than the one layer
(reused, as vLLM's MiMo does)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.exceptions import ConfigError
from tests.eagle_checks import assert_pools_empty, recorded_proposals
from tests.shapes import ENGINE_TESTS_SHAPE
from tests.spec_helpers import assert_same_logprobs, prompts, stats_of, token_ids

K = 2
SPEC_SHAPE = {**ENGINE_TESTS_SHAPE, "num_gpu_blocks_override": 80}
MTP = {"method": "mtp", "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> str:
    from tests.tiny_models import build_tiny_checkpoint

    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2") / "m", "Qwen2ForCausalLM", seed=3,
                                   vocab_size=1024, tie_word_embeddings=True))


@pytest.fixture(scope="module")
def mimo(qwen2, tmp_path_factory) -> str:
    from tests.mtp_models import write_mimo

    return write_mimo(tmp_path_factory.mktemp("mimo") / "m", qwen2)


@pytest.fixture(scope="module")
def plain(qwen2):
    return LLM(qwen2, show_progress=False, **ENGINE_TESTS_SHAPE)


@pytest.fixture(scope="module")
def mtp(mimo):
    return LLM(mimo, show_progress=False, **SPEC_SHAPE, speculative_config=MTP)


def test_greedy_output_and_drafts(plain, mtp, mimo, monkeypatch):
    compiles = mtp.stats()["compile_num_compiles"]
    drafted, accepted = stats_of(mtp).num_draft_tokens, stats_of(mtp).num_accepted_tokens
    seen = recorded_proposals(mtp, monkeypatch)
    ps = prompts(4, seed=0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    want, got = plain.generate(ps, params, use_tqdm=False), mtp.generate(ps, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert_same_logprobs(want, got, ranks=False)
    assert stats_of(mtp).num_draft_tokens > drafted and seen and all(len(d) == K for _, d in seen)
    assert stats_of(mtp).num_accepted_tokens > accepted
    assert mtp.stats()["compile_num_compiles"] == compiles
    assert mtp.stats()["compile_unexpected_compiles"] == 0
    assert_pools_empty(mtp)
    assert_drafts_equal_the_reference(mimo, ps, got, seen)


def assert_drafts_equal_the_reference(mimo: str, ps: list[dict], outs, seen) -> None:
    """Each proposal is the first MTP layer's, step after step: the dense formula over the whole
    context from the target's hidden states of one prefill."""
    from jaxserve.models import load_model
    from tests.eagle_reference import target_hidden
    from tests.mtp_reference import DenseMTP

    model = load_model(mimo)
    dense = DenseMTP(mimo)
    sequences = [np.array(p["prompt_token_ids"] + o.outputs[0].token_ids) for p, o in zip(ps, outs)]
    hidden = [target_hidden(model, seq, ()) for seq in sequences]
    assert len(seen) >= 8
    for context, drafts in seen:
        i = next(i for i, seq in enumerate(sequences) if np.array_equal(seq[:len(context)], context))
        assert drafts == dense.drafts(context, hidden[i][:len(context) - 1], K)


def test_prefix_hits(plain, mtp, mimo, monkeypatch):
    """The layer's KV lives in the target's blocks: a prefix hit (one block short, as with EAGLE)
    brings it along, and the drafts after it are the dense formula's."""
    ps = prompts(3, seed=3, lo=60, hi=90)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = token_ids(plain.generate(ps, params, use_tqdm=False))
    assert token_ids(mtp.generate(ps, params, use_tqdm=False)) == want
    seen = recorded_proposals(mtp, monkeypatch)
    again = mtp.generate(ps, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [((len(p["prompt_token_ids"]) - 1) // 16 - 1) * 16 for p in ps]
    assert token_ids(again) == want
    assert_drafts_equal_the_reference(mimo, ps, again, seen)
    assert_pools_empty(mtp)


def test_chunked_prefill_and_preemption(plain, mtp):
    # 90-110-token prompts are chunked by the 64-token budget; 12 of them overflow the 80-block pool.
    ps = prompts(12, seed=2, lo=90, hi=110)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = token_ids(plain.generate(ps, params, use_tqdm=False))
    scheduler = mtp.llm_engine.core.scheduler
    preemptions, drafted, accepted = (scheduler.num_preemptions, stats_of(mtp).num_draft_tokens,
                                      stats_of(mtp).num_accepted_tokens)
    assert token_ids(mtp.generate(ps, params, use_tqdm=False)) == want
    assert scheduler.num_preemptions > preemptions
    assert 0 < stats_of(mtp).num_accepted_tokens - accepted < stats_of(mtp).num_draft_tokens - drafted
    assert_pools_empty(mtp)


def test_the_mtp_layer_formula(mimo):
    """One pass of the loaded layer over a sequence (paged attention, jitted) equals the dense
    numpy formula over the checkpoint's tensors."""
    import jax.numpy as jnp

    from jaxserve.layers.attention import AttentionMetadata
    from jaxserve.models import load_model
    from jaxserve.models.eagle import TargetTables
    from jaxserve.models.mtp import load_mtp_head, mtp_forward
    from jaxserve.runner.kv_cache import allocate_kv_cache
    from pallas_kernels import get_attention_fn
    from tests.mtp_reference import DenseMTP

    model = load_model(mimo)
    cfg, w = load_mtp_head(mimo, model.config, jnp.float32)
    n, bs = 20, 16
    rng = np.random.default_rng(0)
    tokens, hidden = rng.integers(0, 500, n).astype(np.int32), rng.standard_normal((n, 64)).astype(np.float32)
    md = AttentionMetadata(*(jnp.asarray(a, jnp.int32) for a in (
        np.arange(n), np.arange(n) + bs, [[1, 2]], [n], [0, n], [1])))
    k_pool, v_pool = allocate_kv_cache(cfg.layer, 3, bs, 1)
    tables = TargetTables(model.embed_tokens.embedding[...], None)  # tied; the layer reads the embedding only
    rows, nxt, _ = mtp_forward(cfg, w, tables, jnp.asarray(tokens), jnp.asarray(hidden), (k_pool[0], v_pool[0]), md,
                               get_attention_fn("xla"))
    want, _, _ = DenseMTP(mimo).layer(tokens, np.arange(n), hidden.astype(np.float64), np.zeros(0), np.zeros(0))
    np.testing.assert_allclose(np.asarray(rows), want, rtol=2e-4, atol=2e-4)
    assert rows is nxt
    assert not np.allclose(want[0], DenseMTP(mimo).layer(tokens[:1], np.array([1]), hidden[:1].astype(np.float64),
                                                         np.zeros(0), np.zeros(0))[0][0])  # position 0: no token


@pytest.mark.parametrize("kwargs, words", [
    (dict(rename={"0.input_proj.weight": "0.input_projection.weight"}),
     r"unexpected tensor\(s\) model\.mtp_layers\.0\.input_projection\.weight"),
    (dict(num_layers=2, written=1), r"no MTP layer model\.mtp_layers\.1 \(config\.json: num_nextn_predict_layers=2\)"),
    (dict(written=2), r"unexpected tensor\(s\) model\.mtp_layers\.1\."),
    (dict(num_nextn_predict_layers=0), r"num_nextn_predict_layers must be an integer >= 1, got 0"),
])
def test_bad_mtp_layers_are_refused_by_name(qwen2, tmp_path, kwargs, words):
    from tests.mtp_models import write_mimo

    folder = write_mimo(tmp_path / "m", qwen2, **kwargs)
    with pytest.raises(ConfigError, match=r"speculative_config\.method=mtp.*" + words):
        LLM(folder, show_progress=False, **SPEC_SHAPE, speculative_config=MTP)


def test_a_target_without_mtp_layers_is_refused(qwen2):
    with pytest.raises(ConfigError, match=r"speculative_config\.method=mtp.*no multi-token-prediction layers"):
        LLM(qwen2, show_progress=False, **SPEC_SHAPE, speculative_config=MTP)
