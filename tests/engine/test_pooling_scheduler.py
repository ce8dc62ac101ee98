"""Pooling requests through the engine core's scheduler: chunked prefill with the pooled state carried
across chunks, the prefix cache (LAST only), the encoder's rule (never chunked), compile counts, no
block leaks; each against sentence-transformers on real tiny folders."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.exceptions import InvalidRequestError
from tests.models.test_bert import tiny_bert
from tests.models.test_pooling_config import write_st_folder
from tests.tiny_models import build_tiny_checkpoint

LONG = ["the quick brown fox jumps over the lazy dog " * 4, "hello world, " * 9 + "and more",
        "a", "pooling models embed text through the same scheduler as generation " * 2]


def cosine(a, b):
    return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_pool"), seed=7)


def st_folder(decoder, tmp_path, mode):
    folder = tmp_path / mode
    shutil.copytree(decoder, folder)
    return write_st_folder(folder, mode, normalize=True)


def assert_no_leak(llm):
    core = llm.pooling.core
    assert not core.scheduler.requests and core.scheduler.kv_cache_manager.usage == 0.0
    core.step()  # ships the finished ids: the runner forgets them
    assert not core.runner.requests


@pytest.mark.parametrize("mode", ["pooling_mode_lasttoken", "pooling_mode_mean_tokens", "pooling_mode_cls_token"])
def test_chunked_prefill_equals_sentence_transformers(decoder, tmp_path, mode):
    from sentence_transformers import SentenceTransformer

    folder = st_folder(decoder, tmp_path, mode)
    st = SentenceTransformer(str(folder), device="cpu")
    want = st.encode(LONG, convert_to_numpy=True)
    lengths = [len(st.tokenizer(t)["input_ids"]) for t in LONG]
    assert max(lengths) > 2 * 16  # the longest prompts run in three chunks or more
    llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=16)
    core = llm.pooling.core
    compiled = llm.pooling.runner.num_compiled()
    assert compiled == len(core.runner.buckets) == 1  # one bucket, compiled at warm-up
    steps = core.scheduler.step_counter
    got = np.asarray([o.outputs.embedding for o in llm.embed(LONG)])
    assert core.scheduler.step_counter - steps >= sum(lengths) // 16  # the budget cut them into chunks
    assert cosine(got, want).min() > 0.9999
    assert llm.pooling.runner.num_compiled() == compiled
    # Only LAST reads the prefix cache: the others need every token's hidden state.
    assert core.scheduler.kv_cache_manager.enable_caching == (mode == "pooling_mode_lasttoken")
    assert_no_leak(llm)


def test_prefix_hits_and_batches(decoder, tmp_path):
    from sentence_transformers import SentenceTransformer

    folder = st_folder(decoder, tmp_path, "pooling_mode_lasttoken")
    st = SentenceTransformer(str(folder), device="cpu")
    shared = "a shared system prompt that is long enough to fill several blocks of the cache. " * 2
    texts = [shared + t for t in ("first question", "second one here", "third")]
    want = st.encode(texts, convert_to_numpy=True)
    llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=64, block_size=16)
    core = llm.pooling.core
    compiled = llm.pooling.runner.num_compiled()
    first = np.asarray([o.outputs.embedding for o in llm.embed(texts[:1])])
    hits = core.scheduler.make_stats().prefix_cache_hits
    rest = np.asarray([o.outputs.embedding for o in llm.embed(texts[1:] + texts[:1])])
    assert core.scheduler.make_stats().prefix_cache_hits - hits >= 3 * 32  # whole blocks of the shared prefix
    assert cosine(np.concatenate([first, rest[:2]]), want).min() > 0.9999
    np.testing.assert_allclose(rest[2], first[0], rtol=1e-5, atol=1e-6)  # a full hit still computes the last token
    assert llm.pooling.runner.num_compiled() == compiled
    assert_no_leak(llm)


def test_bert_is_never_chunked_and_fits_one_step(tmp_path):
    from sentence_transformers import SentenceTransformer

    tiny_bert(tmp_path, "BertModel", seed=4)
    write_st_folder(tmp_path, "pooling_mode_mean_tokens", normalize=True)
    st = SentenceTransformer(str(tmp_path), device="cpu")
    texts = ["the quick brown fox jumps over the lazy dog " * 3, "hello world", "the cat sat on the mat " * 2]
    want = st.encode(texts, convert_to_numpy=True)
    assert max(len(st.tokenizer(t)["input_ids"]) for t in texts) > 16
    # vLLM's rule for a bidirectional encoder: no chunked prefill, no prefix cache; the budget is
    # raised to max_model_len so that every prompt fits one step.
    llm = LLM(str(tmp_path), max_model_len=64, max_num_batched_tokens=16)
    sched = llm.pooling.core.scheduler
    assert not sched.scheduler_config.enable_chunked_prefill and not sched.kv_cache_manager.enable_caching
    assert sched.max_num_batched_tokens == 64
    compiled = llm.pooling.runner.num_compiled()
    steps = sched.step_counter
    got = np.asarray([o.outputs.embedding for o in llm.embed(texts)])
    assert sched.step_counter - steps == 1  # the three prompts packed in one step
    assert cosine(got, want).min() > 0.9999
    assert llm.pooling.runner.num_compiled() == compiled
    assert_no_leak(llm)


def test_bad_input_is_a_clear_error_and_the_engine_goes_on(decoder, tmp_path):
    folder = st_folder(decoder, tmp_path, "pooling_mode_lasttoken")
    llm = LLM(str(folder), max_model_len=64, max_num_batched_tokens=32)
    good = llm.embed(["hello"])[0].outputs.embedding
    with pytest.raises(InvalidRequestError, match="max_model_len 64; pass truncate_prompt_tokens"):
        llm.embed(["hello", list(range(3, 70))])
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        llm.embed([[]])
    # A generation request cannot enter a pooling engine (nor the other way round).
    with pytest.raises(InvalidRequestError, match="pooling"):
        llm.pooling.core.add_request(Request("g", [1, 2, 3], SamplingParams(max_tokens=2), None))
    assert llm.embed([list(range(3, 67))], truncate_prompt_tokens=64)[0].prompt_token_ids[-1] == 66
    np.testing.assert_allclose(llm.embed(["hello"])[0].outputs.embedding, good, rtol=1e-5, atol=1e-6)
    assert_no_leak(llm)


@pytest.mark.parametrize("flag", ["tensor_parallel_size", "data_parallel_size"])
def test_one_device_one_engine(decoder, tmp_path, flag):
    from jaxserve.exceptions import ConfigError

    folder = st_folder(decoder, tmp_path, "pooling_mode_lasttoken")
    with pytest.raises(ConfigError, match=f"{flag}: a pooling model"):
        LLM(str(folder), max_model_len=64, **{flag: 2})
