"""The pooling endpoints on a real uvicorn server; ``openai``'s ``embeddings.create`` unchanged."""

from __future__ import annotations

import base64
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn

from jaxserve import LLM
from server.pooling_app import build_pooling_app
from tests.models.test_bert import TEXTS, tiny_bert
from tests.models.test_pooling_config import write_st_folder


def serve(llm, name):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_pooling_app(llm.pooling, served_model_name=name), log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert_st")
    tiny_bert(folder, "BertModel", seed=4)
    write_st_folder(folder, "pooling_mode_mean_tokens", normalize=True)
    llm = LLM(str(folder))
    server, thread, url = serve(llm, "emb")
    yield llm, url
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert_ce")
    tiny_bert(folder, "BertForSequenceClassification", seed=2)
    llm = LLM(str(folder))
    server, thread, url = serve(llm, "ce")
    yield llm, url
    server.should_exit = True
    thread.join(10)


def test_openai_client_embeddings(embedder):
    llm, url = embedder
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    want = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS)])
    got = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 by default
    np.testing.assert_allclose([d.embedding for d in got.data], want, rtol=1e-6)
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in llm.embed(TEXTS))
    one = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float", dimensions=8)
    assert len(one.data[0].embedding) == 8
    ids = llm.embed(TEXTS[1])[0].prompt_token_ids
    by_ids = client.embeddings.create(model="emb", input=[ids], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, want[1], rtol=1e-5, atol=1e-6)  # another bucket
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="a")
    with pytest.raises(openai.BadRequestError, match="does not generate"):
        client.completions.create(model="emb", prompt="a")


def test_embeddings_base64_pooling_and_errors(embedder):
    llm, url = embedder
    r = httpx.post(url + "/v1/embeddings", json={"input": "hello world", "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vec, llm.embed("hello world")[0].outputs.embedding, rtol=1e-6)
    r = httpx.post(url + "/pooling", json={"input": ["hello world"]})
    assert r.status_code == 200 and len(r.json()["data"][0]["data"]) == 32
    for body, param in [({"input": []}, "input"), ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
                        ({"input": "a", "dimensions": 999}, "dimensions"), ({}, "input")]:
        r = httpx.post(url + "/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(url + "/v1/embeddings", json={"input": "a", "truncate_prompt_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1
    scores = httpx.post(url + "/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()["data"]
    assert [s["score"] for s in scores] == [s.outputs.score for s in llm.score(TEXTS[0], TEXTS[1:])]


def test_rerank_score_and_classify(reranker):
    llm, url = reranker
    docs = ["the lazy dog", "hello world", "a cat sat on the mat"]
    want = [s.outputs.score for s in llm.score("the quick fox", docs)]
    order = np.argsort(want)[::-1]
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(url + route, json={"query": "the quick fox", "documents": docs, "top_n": 2})
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:2].tolist()
        assert results[0]["document"]["text"] == docs[order[0]]
        np.testing.assert_allclose(results[0]["relevance_score"], want[order[0]], rtol=1e-6)
    r = httpx.post(url + "/rerank", json={"query": "q", "documents": docs, "return_documents": False})
    assert "document" not in r.json()["results"][0] and len(r.json()["results"]) == 3
    for route in ("/score", "/v1/score"):
        data = httpx.post(url + route, json={"text_1": "the quick fox", "text_2": docs}).json()["data"]
        np.testing.assert_allclose([d["score"] for d in data], want, rtol=1e-6)
    c = httpx.post(url + "/classify", json={"input": ["hello world"]}).json()["data"][0]
    np.testing.assert_allclose(c["probs"], llm.classify("hello world")[0].outputs.probs, rtol=1e-6)
    assert c["num_classes"] == 3
    r = httpx.post(url + "/v1/embeddings", json={"input": "a"})
    assert r.status_code == 400 and "classify" in r.json()["error"]["message"]
    r = httpx.post(url + "/rerank", json={"query": "q", "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_jaxserve_serve_detects_a_pooling_folder(tmp_path):
    from tests.server.server_testing import start_server, stop_server

    folder = tmp_path / "ce"
    folder.mkdir()
    tiny_bert(folder, "BertForSequenceClassification", seed=2)
    # The tiny BERT has 64 positions: the suite's longer max_model_len is refused, as for any model.
    handle = start_server([str(folder), "--served-model-name", "ce", "--max-model-len", "64"], tmp_path / "log.txt")
    try:
        r = httpx.post(handle.base + "/v1/rerank", json={"query": "q", "documents": ["hello world", "a cat"]})
        assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text
        r = httpx.post(handle.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 400 and "does not generate" in r.json()["error"]["message"]
    finally:
        stop_server(handle)


def test_decoder_embedder_over_http_chunked_with_prefix_hits_equals_sentence_transformers(tmp_path):
    """A causal embedder (last-token pooling) over the openai client: prompts longer than the
    16-token budget (chunked prefill), sent twice (the second time from the prefix cache), each
    batch equal to sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    from tests.tiny_models import build_tiny_checkpoint

    folder = write_st_folder(build_tiny_checkpoint(tmp_path / "qwen3_emb", seed=7), "pooling_mode_lasttoken",
                             normalize=True)
    texts = ["a shared preamble long enough to span several cache blocks, then " + t
             for t in ("the first question", "another one", "and a third, a little longer than the rest")]
    want = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=16, block_size=16)
    server, thread, url = serve(llm, "qwen-emb")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        for _ in range(2):
            got = np.asarray([d.embedding for d in client.embeddings.create(model="qwen-emb", input=texts,
                                                                            encoding_format="float").data])
            cos = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
            assert cos.min() > 0.9999
        stats = llm.pooling.core.scheduler.make_stats()
        assert stats.prefix_cache_hits > 0
        assert llm.pooling.runner.num_partial_chunks > 0  # some prompt ran in more than one chunk
    finally:
        server.should_exit = True
        thread.join(timeout=10)
