"""The compiled decoder pooling step against sentence-transformers and transformers on a tiny random Qwen3
(packed by hand here; the engine-level tests pack through the scheduler)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import pallas_kernels
from jaxserve.models import load_model
from jaxserve.models.pooling_config import PoolerConfig, resolve_pooler_config
from jaxserve.runner.pooling_step import make_decoder_step
from tests.models.test_pooling_config import write_st_folder
from tests.tiny_models import build_tiny_checkpoint

BLOCK = 4
NUM_BLOCKS = 96
MAX_BLOCKS = 24
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "pooling models embed text"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_embed"), seed=3)


def packed_inputs(chunks: list[list[int]], computed: list[int], hidden: int, carry=None):
    """One packed step: request ``i`` feeds ``chunks[i]`` after ``computed[i]`` cached tokens, in blocks
    ``1 + i * MAX_BLOCKS ...`` of its own; ``carry``: the pooled state its earlier chunks left."""
    ids, positions, slots, qsl = [], [], [], [0]
    for i, (chunk, start) in enumerate(zip(chunks, computed)):
        pos = np.arange(start, start + len(chunk))
        ids += chunk
        positions += pos.tolist()
        slots += ((1 + i * MAX_BLOCKS + pos // BLOCK) * BLOCK + pos % BLOCK).tolist()
        qsl.append(qsl[-1] + len(chunk))
    tables = np.stack([1 + i * MAX_BLOCKS + np.arange(MAX_BLOCKS) for i in range(len(chunks))]).astype(np.int32)
    n = len(chunks)
    return {"input_ids": np.asarray(ids, np.int32), "positions": np.asarray(positions, np.int32),
            "slot_mapping": np.asarray(slots, np.int32), "block_tables": tables,
            "kv_lens": np.asarray([s + len(c) for c, s in zip(chunks, computed)], np.int32),
            "query_start_loc": np.asarray(qsl, np.int32), "num_seqs": np.asarray([n], np.int32),
            "starts": np.asarray(qsl[:-1], np.int32), "lens": np.asarray([len(c) for c in chunks], np.int32),
            "carry": np.zeros((n, hidden), np.float32) if carry is None else carry,
            "first": np.asarray([s == 0 for s in computed]),
            "counts": np.asarray([s + len(c) for c, s in zip(chunks, computed)], np.int32)}


def empty_kv(cfg):
    shape = (cfg.num_hidden_layers, NUM_BLOCKS, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)


@pytest.fixture(scope="module")
def model(folder):
    return load_model(folder, dtype="float32")


def embed_all(model, pooler, ids_list, split: int | None = None):
    """Every prompt in one packed step, or (``split``) its first ``split`` tokens, then the rest."""
    step, weights = make_decoder_step(model, "embed", pooler, pallas_kernels.ragged_paged_attention_reference)
    kv = empty_kv(model.config)
    hidden = model.config.hidden_size
    carry = None
    if split:
        _, carry, kv = step(weights, kv, packed_inputs([p[:split] for p in ids_list], [0] * len(ids_list), hidden))
        ids_list = [p[split:] for p in ids_list]
    out, _, _ = step(weights, kv, packed_inputs(ids_list, [split or 0] * len(ids_list), hidden,
                                                None if carry is None else np.asarray(carry)))
    return np.asarray(out)


def cosine(a, b):
    return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("mode", ["pooling_mode_lasttoken", "pooling_mode_mean_tokens", "pooling_mode_cls_token"])
def test_embeddings_equal_sentence_transformers(tmp_path, folder, model, mode):
    import shutil

    from sentence_transformers import SentenceTransformer

    st_folder = tmp_path / "st"
    shutil.copytree(folder, st_folder)
    write_st_folder(st_folder, mode, normalize=True)
    st = SentenceTransformer(str(st_folder), device="cpu")
    want = st.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    ids_list = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    got = embed_all(model, resolve_pooler_config("embed", str(st_folder), None), ids_list)
    assert got.shape == want.shape
    assert cosine(got, want).min() > 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, rtol=1e-5)


def hf_hidden(folder, ids):
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].numpy()


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_chunked_state_carried(model, kind):
    ids_list = [list(range(5, 5 + n)) for n in (13, 21, 9)]
    pooler = PoolerConfig(kind, normalize=True)
    np.testing.assert_allclose(embed_all(model, pooler, ids_list, split=7), embed_all(model, pooler, ids_list),
                               rtol=1e-5, atol=1e-6)


def test_chunked_last_token_equals_one_pass_and_matryoshka(folder, model):
    ids_list = [list(range(5, 5 + n)) for n in (13, 21, 9)]
    pooler = PoolerConfig("LAST", normalize=True, dimensions=16)
    whole = embed_all(model, pooler, ids_list)
    chunked = embed_all(model, pooler, ids_list, split=7)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-6)
    # The Matryoshka prefix of transformers' last hidden state, renormalized.
    want = np.stack([hf_hidden(folder, p)[-1, :16] for p in ids_list])
    want /= np.linalg.norm(want, axis=-1, keepdims=True)
    assert cosine(whole, want).min() > 0.9999
    assert whole.shape == (3, 16)


def test_classify_equals_sequence_classification(folder, model):
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3, dtype=torch.float32)
    hf.config.pad_token_id = 0
    hf.eval()
    ids_list = [list(range(7, 7 + n)) for n in (11, 4)]
    with torch.no_grad():
        want = [torch.softmax(hf(torch.tensor([p])).logits[0], -1).numpy() for p in ids_list]
    weight = jnp.asarray(hf.score.weight.detach().numpy())
    step, weights = make_decoder_step(model, "classify", PoolerConfig("LAST"),
                                      pallas_kernels.ragged_paged_attention_reference, score=(weight, None))
    out, _, _ = step(weights, empty_kv(model.config), packed_inputs(ids_list, [0, 0], model.config.hidden_size))
    np.testing.assert_allclose(np.asarray(out), np.stack(want), rtol=1e-4, atol=1e-5)
