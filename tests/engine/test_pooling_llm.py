"""``LLM.embed`` / ``classify`` / ``score`` on real folders against sentence-transformers and transformers."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM
from jaxserve.engine.pooling_outputs import ClassificationRequestOutput, EmbeddingRequestOutput, ScoringRequestOutput
from jaxserve.exceptions import InvalidRequestError
from tests.models.test_bert import TEXTS, tiny_bert
from tests.models.test_pooling_config import write_st_folder
from tests.tiny_models import build_tiny_checkpoint


def cosine(a, b):
    return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def qwen3_embedder(tmp_path_factory):
    folder = build_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_st"), seed=5)
    write_st_folder(folder, "pooling_mode_lasttoken", normalize=True)
    return str(folder)


def test_decoder_embed_equals_sentence_transformers(qwen3_embedder):
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(qwen3_embedder, device="cpu").encode(TEXTS * 3, convert_to_numpy=True)
    llm = LLM(qwen3_embedder, max_model_len=64)  # detected: a Sentence-Transformers folder embeds
    out = llm.embed(TEXTS * 3)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in out)
    got = np.asarray([o.outputs.embedding for o in out])
    assert cosine(got, want).min() > 0.9999
    # Same bucket again: the same numbers and no new program; a smaller batch, the same rows.
    compiled = llm.pooling.runner.num_compiled()
    again = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS * 3)])
    np.testing.assert_array_equal(again, got)
    assert llm.pooling.runner.num_compiled() == compiled
    one = llm.embed(TEXTS[1])[0]
    np.testing.assert_allclose(one.outputs.embedding, got[1], rtol=1e-5, atol=1e-6)
    # Matryoshka: a renormalized prefix; token ids are accepted as a prompt.
    short = llm.embed([one.prompt_token_ids], dimensions=8)[0].outputs.embedding
    prefix = got[1, :8] / np.linalg.norm(got[1, :8])
    np.testing.assert_allclose(short, prefix, rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.embed("a", dimensions=10_000)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.embed([list(range(3, 100))])
    assert len(llm.embed([list(range(3, 100))], truncate_prompt_tokens=20)[0].prompt_token_ids) == 20
    with pytest.raises(InvalidRequestError, match="does not generate"):
        llm.generate("hello")
    with pytest.raises(InvalidRequestError, match="not 'classify'"):
        llm.classify("hello")


def test_bert_cross_encoder_score_and_classify(tmp_path):
    hf = tiny_bert(tmp_path, "BertForSequenceClassification", seed=2)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    query, docs = "the quick fox", ["the lazy dog", "hello world", "a cat sat on the mat"]
    with torch.no_grad():
        want = [torch.softmax(hf(**tok(query, d, return_tensors="pt")).logits[0], -1).numpy() for d in docs]
    llm = LLM(str(tmp_path))  # detected: *ForSequenceClassification classifies
    scores = llm.score(query, docs)
    assert all(isinstance(s, ScoringRequestOutput) for s in scores)
    np.testing.assert_allclose([s.outputs.score for s in scores], [w[-1] for w in want], rtol=1e-4, atol=1e-6)
    probs = llm.classify(["hello world"])
    assert isinstance(probs[0], ClassificationRequestOutput) and probs[0].outputs.num_classes == 3
    with torch.no_grad():
        ref = torch.softmax(hf(**tok("hello world", return_tensors="pt")).logits[0], -1).numpy()
    np.testing.assert_allclose(probs[0].outputs.probs, ref, rtol=1e-4, atol=1e-6)


def test_bert_embedder_and_cosine_score(tmp_path):
    from sentence_transformers import SentenceTransformer

    tiny_bert(tmp_path, "BertModel", seed=4)
    write_st_folder(tmp_path, "pooling_mode_mean_tokens", normalize=True)
    st = SentenceTransformer(str(tmp_path), device="cpu")
    want = st.encode(TEXTS, convert_to_numpy=True)
    llm = LLM(str(tmp_path))
    got = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS)])
    assert cosine(got, want).min() > 0.9999
    scores = [s.outputs.score for s in llm.score(TEXTS[0], TEXTS[1:])]
    np.testing.assert_allclose(scores, cosine(want[1:], want[:1]), rtol=1e-4, atol=1e-5)


def test_convert_refused_with_generate_runner(tmp_path):
    shutil.copytree(build_tiny_checkpoint(tmp_path / "m", seed=1), tmp_path / "c")
    with pytest.raises(Exception, match="convert"):
        LLM(str(tmp_path / "c"), runner="generate", convert="embed")
