"""The BERT encoder against transformers and sentence-transformers on a tiny random checkpoint."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxserve.exceptions import ConfigError
from jaxserve.models.bert import BertConfig, bert_classify, bert_embed, bert_encode, load_bert, padded_batch
from jaxserve.models.pooling_config import resolve_pooler_config
from tests.models.test_pooling_config import write_st_folder

WORDS = "the quick brown fox jumps over lazy dog hello world pooling models embed text a cat sat on mat".split()
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "the cat sat on the mat"]


def tiny_bert(folder, arch: str, seed: int = 0):
    """A real HF folder: random weights from transformers, a word-piece vocabulary of our words."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                     num_labels=3)
    model = getattr(transformers, arch)(config).eval()
    model.save_pretrained(folder)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    transformers.BertTokenizer(str(vocab)).save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    return folder, tiny_bert(folder, "BertModel")


def test_hidden_states_equal_transformers(encoder):
    folder, hf = encoder
    cfg, params = load_bert(folder)
    ids, mask = padded_batch([[2, 7, 9, 11, 3], [2, 6, 3], [2, 5, 8, 10, 12, 14, 16, 3]], length=10)
    with torch.no_grad():
        want = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    got = np.asarray(jax.jit(lambda i, m: bert_encode(cfg, params, i, m))(ids, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["pooling_mode_mean_tokens", "pooling_mode_cls_token"])
def test_embeddings_equal_sentence_transformers(encoder, mode, tmp_path):
    import shutil

    from sentence_transformers import SentenceTransformer

    folder, _ = encoder
    st_folder = tmp_path / "st"
    shutil.copytree(folder, st_folder)
    write_st_folder(st_folder, mode, normalize=True)
    st = SentenceTransformer(str(st_folder), device="cpu")
    want = st.encode(TEXTS, convert_to_numpy=True)
    ids, mask = padded_batch([st.tokenizer(t)["input_ids"] for t in TEXTS], length=16)
    cfg, params = load_bert(st_folder)
    got = np.asarray(bert_embed(cfg, params, ids, mask, resolve_pooler_config("embed", str(st_folder), None)))
    cos = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() > 0.9999


def test_cross_encoder_scores_equal_transformers(tmp_path):
    hf = tiny_bert(tmp_path, "BertForSequenceClassification", seed=1)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    pairs = tok(["hello world", "the cat"], ["the quick brown fox", "sat on the mat"], padding=True)
    ids = np.asarray(pairs["input_ids"], np.int32)
    mask = np.asarray(pairs["attention_mask"], np.int32)
    types = np.asarray(pairs["token_type_ids"], np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                  token_type_ids=torch.tensor(types, dtype=torch.long)).logits.numpy()
    cfg, params = load_bert(tmp_path)
    assert (cfg.architecture, cfg.num_labels) == ("BertForSequenceClassification", 3)
    got = np.asarray(bert_classify(cfg, params, bert_encode(cfg, params, ids, mask, types)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_not_a_bert_folder_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    with pytest.raises(ConfigError, match="architectures"):
        BertConfig.from_folder(tmp_path)
