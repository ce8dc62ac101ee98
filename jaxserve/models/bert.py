"""BERT-family encoder (``BertModel``, ``BertForSequenceClassification``): bidirectional, no KV cache.

An encoder reads the whole prompt at once and keeps nothing for later tokens, so it needs neither
the paged pools nor the scheduler's chunking. Served, a step is packed as the scheduler packs a
decoder's (prompts end to end, a mask keeping each to itself: one program per token bucket);
the padded ``[B, L]`` form is kept for the reference comparisons. Parameters are a plain dict of arrays named as in the
checkpoint (without the ``bert.`` prefix), read straight from its safetensors files.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.exceptions import ConfigError
from jaxserve.layers.pooler import embed_head, pool
from jaxserve.models.pooling_config import PoolerConfig
from jaxserve.models.safetensors_io import open_checkpoint_files

BERT_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    layer_norm_eps: float
    hidden_act: str
    num_labels: int
    architecture: str

    @classmethod
    def from_folder(cls, folder: str | Path) -> BertConfig:
        raw = json.loads((Path(folder) / "config.json").read_text())
        arch = next((a for a in raw.get("architectures") or [] if a in BERT_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(f"{folder}: architectures {raw.get('architectures')!r} is not one of "
                              f"{', '.join(BERT_ARCHITECTURES)}")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"{folder}: position_embedding_type must be 'absolute'")
        if raw.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"{folder}: hidden_act {raw.get('hidden_act')!r} is not a GELU")
        return cls(raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"],
                   raw["intermediate_size"], raw.get("layer_norm_eps", 1e-12), raw.get("hidden_act", "gelu"),
                   len(raw.get("id2label") or {}) or raw.get("num_labels", 2), arch)


def load_bert(folder: str | Path, dtype: str = "float32") -> tuple[BertConfig, dict[str, jax.Array]]:
    """The config and every weight, with ``bert.`` stripped (BertForSequenceClassification adds it)."""
    cfg = BertConfig.from_folder(folder)
    params: dict[str, jax.Array] = {}
    for name, f in open_checkpoint_files(folder).items():
        key = name.removeprefix("bert.")
        if key.endswith("position_ids"):
            continue  # a buffer, not a weight
        params[key] = jnp.asarray(np.asarray(f.get(name), np.float32), dtype)
    return cfg, params


def _layer_norm(x, p, prefix, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p[prefix + ".weight"] + p[prefix + ".bias"]


def _dense(x, p, prefix):
    return x @ p[prefix + ".weight"].T + p[prefix + ".bias"]


def _gelu(x, act: str):
    return jax.nn.gelu(x, approximate=act != "gelu")  # HF's "gelu" is the exact erf form


def bert_encode(cfg: BertConfig, p: dict[str, jax.Array], ids: jax.Array, mask: jax.Array,
                token_type_ids: jax.Array | None = None) -> jax.Array:
    """``[B, L, H]``: the last hidden states of a right-padded batch (``mask`` 1 on real tokens)."""
    _, length = ids.shape
    types = jnp.zeros_like(ids) if token_type_ids is None else token_type_ids
    x = _embed(cfg, p, ids, jnp.arange(length)[None], types)
    # Padding keys are masked out; every query attends to every real key (bidirectional).
    bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(x.dtype).min).astype(x.dtype)
    return _layers(cfg, p, x, bias)


def bert_encode_packed(cfg: BertConfig, p: dict[str, jax.Array], ids: jax.Array, positions: jax.Array,
                       token_type_ids: jax.Array, segments: jax.Array) -> jax.Array:
    """``[T, H]``: a packed step's prompts laid end to end (as the scheduler packs them), each token
    attending to the tokens of its own prompt (``segments``: the prompt of each row; -1 padding)."""
    x = _embed(cfg, p, ids[None], positions[None], token_type_ids[None])
    same = (segments[:, None] == segments[None, :]) & (segments[None, :] >= 0)
    bias = jnp.where(same, 0.0, jnp.finfo(x.dtype).min).astype(x.dtype)[None, None]
    return _layers(cfg, p, x, bias)[0]


def _embed(cfg: BertConfig, p: dict[str, jax.Array], ids: jax.Array, positions: jax.Array,
           types: jax.Array) -> jax.Array:
    x = (p["embeddings.word_embeddings.weight"][ids] + p["embeddings.position_embeddings.weight"][positions]
         + p["embeddings.token_type_embeddings.weight"][types])
    return _layer_norm(x, p, "embeddings.LayerNorm", cfg.layer_norm_eps)


def _layers(cfg: BertConfig, p: dict[str, jax.Array], x: jax.Array, bias: jax.Array) -> jax.Array:
    heads = cfg.num_attention_heads
    dh = cfg.hidden_size // heads
    for i in range(cfg.num_hidden_layers):
        pre = f"encoder.layer.{i}."

        def split(t):
            return t.reshape(*t.shape[:2], heads, dh).transpose(0, 2, 1, 3)

        q = split(_dense(x, p, pre + "attention.self.query"))
        k = split(_dense(x, p, pre + "attention.self.key"))
        v = split(_dense(x, p, pre + "attention.self.value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh) + bias
        ctx = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(x.shape)
        x = _layer_norm(x + _dense(ctx, p, pre + "attention.output.dense"), p, pre + "attention.output.LayerNorm",
                        cfg.layer_norm_eps)
        h = _gelu(_dense(x, p, pre + "intermediate.dense"), cfg.hidden_act)
        x = _layer_norm(x + _dense(h, p, pre + "output.dense"), p, pre + "output.LayerNorm", cfg.layer_norm_eps)
    return x


def bert_classify(cfg: BertConfig, p: dict[str, jax.Array], hidden: jax.Array) -> jax.Array:
    """``[B, num_labels]`` logits: BERT's pooler (dense + tanh on the first token) then the classifier."""
    return bert_classify_first(p, hidden[:, 0])


def bert_classify_first(p: dict[str, jax.Array], first: jax.Array) -> jax.Array:
    """``[B, num_labels]`` logits from each prompt's first hidden row ``[B, H]``."""
    return _dense(jnp.tanh(_dense(first, p, "pooler.dense")), p, "classifier")


def bert_embed(cfg: BertConfig, p: dict[str, jax.Array], ids: jax.Array, mask: jax.Array, pooler: PoolerConfig,
               token_type_ids: jax.Array | None = None) -> jax.Array:
    """``[B, D]`` sentence embeddings: the padded batch seen as packed rows, pooled by the shared poolers."""
    hidden = bert_encode(cfg, p, ids, mask, token_type_ids)
    b, length, h = hidden.shape
    starts = jnp.arange(b, dtype=jnp.int32) * length
    pooled = pool(hidden.reshape(b * length, h), starts, mask.sum(axis=1).astype(jnp.int32), pooler.pooling_type)
    return embed_head(pooled, normalize=pooler.normalize, dimensions=pooler.dimensions)


def padded_batch(token_ids: list[list[int]], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ids and mask, ``length`` wide (a bucket) or as wide as the longest prompt."""
    width = length or max(len(t) for t in token_ids)
    ids = np.zeros((len(token_ids), width), np.int32)
    mask = np.zeros_like(ids)
    for i, t in enumerate(token_ids):
        ids[i, :len(t)] = t
        mask[i, :len(t)] = 1
    return ids, mask

