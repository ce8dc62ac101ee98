"""Runs a pooling model over whole prompts in padded ``(batch, length)`` buckets: one program each.

The decoder (``--convert embed|classify`` or a Sentence-Transformers folder) goes through its paged
forward with a scratch pool sized for the bucket, each prompt in blocks of its own; the BERT encoder
needs no pool. Buckets are powers of two, so after the warm-up of a bucket no batch recompiles.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.exceptions import InvalidRequestError
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models.bert import BERT_ARCHITECTURES, bert_classify, bert_embed, bert_encode, load_bert, padded_batch
from jaxserve.models.pooling_config import PoolerConfig
from jaxserve.runner.pooling_step import make_pooling_step

BLOCK = 16
MIN_LENGTH = 16


def _bucket(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


class PoolingRunner:
    def __init__(self, folder: str, task: str, pooler: PoolerConfig, max_model_len: int | None = None):
        raw = json.loads((Path(folder) / "config.json").read_text())
        self.task, self.pooler = task, pooler
        self.is_encoder = any(a in BERT_ARCHITECTURES for a in raw.get("architectures") or [])
        self.max_model_len = max_model_len or int(raw.get("max_position_embeddings", 2048))
        if self.is_encoder:
            self.bert_cfg, self.params = load_bert(folder)
            self._fn = jax.jit(self._bert_forward)
        else:
            self._load_decoder(folder)

    def _bert_forward(self, ids, mask, types):
        if self.task == "embed":
            return bert_embed(self.bert_cfg, self.params, ids, mask, self.pooler, types)
        logits = bert_classify(self.bert_cfg, self.params, bert_encode(self.bert_cfg, self.params, ids, mask, types))
        if not self.pooler.activation:
            return logits
        return jax.nn.sigmoid(logits) if logits.shape[-1] == 1 else jax.nn.softmax(logits, axis=-1)

    def _load_decoder(self, folder: str) -> None:
        import pallas_kernels
        from jaxserve.models import load_model
        from jaxserve.models.safetensors_io import open_checkpoint_files

        model = load_model(folder, dtype="float32")
        self.model_config = model.config
        score = None
        if self.task == "classify":
            files = open_checkpoint_files(folder)
            if "score.weight" not in files:
                raise InvalidRequestError("model", "classify needs the checkpoint's score.weight head")
            score = (jnp.asarray(np.asarray(files["score.weight"].get("score.weight"), np.float32)), None)
        self._step, self._state = make_pooling_step(model, self.task, self.pooler,
                                                    pallas_kernels.ragged_paged_attention_reference, score)

    def num_compiled(self) -> int:
        fn: Any = self._fn if self.is_encoder else self._step
        return int(fn._cache_size())

    def run(self, prompts: list[list[int]], token_type_ids: list[list[int]] | None = None,
            max_batch: int = 64) -> np.ndarray:
        """``[N, D]`` float32: one row per prompt, in order."""
        for i, p in enumerate(prompts):
            if not p:
                raise InvalidRequestError(f"input[{i}]", "empty prompt")
            if len(p) > self.max_model_len:
                raise InvalidRequestError(f"input[{i}]", f"{len(p)} tokens, more than max_model_len "
                                          f"{self.max_model_len}; pass truncate_prompt_tokens",
                                          code="context_length_exceeded")
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a bucket
        rows: dict[int, np.ndarray] = {}
        for s in range(0, len(order), max_batch):
            part = order[s:s + max_batch]
            out = self._run_bucket([prompts[i] for i in part],
                                   None if token_type_ids is None else [token_type_ids[i] for i in part])
            rows.update(zip(part, out))
        return np.stack([rows[i] for i in range(len(prompts))])

    def _run_bucket(self, prompts: list[list[int]], types: list[list[int]] | None) -> np.ndarray:
        n = len(prompts)
        b = _bucket(n)
        length = _bucket(max(len(p) for p in prompts), MIN_LENGTH)
        padded = prompts + [[0]] * (b - n)
        ids, mask = padded_batch(padded, length)
        mask[n:] = 0
        if self.is_encoder:
            tt = np.zeros_like(ids)
            for i, t in enumerate(types or []):
                tt[i, :len(t)] = t
            return np.asarray(self._fn(ids, mask, tt))[:n]
        return self._decoder_bucket(prompts, b, length)[:n]

    def _decoder_bucket(self, prompts: list[list[int]], b: int, length: int) -> np.ndarray:
        cfg = self.model_config
        per_seq = length // BLOCK if length % BLOCK == 0 else length // BLOCK + 1
        shape = (cfg.num_hidden_layers, 1 + b * per_seq, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
        kv = (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
        # Packed tightly, as the scheduler packs a step; the bucket's spare rows trail, owned by nobody.
        ids = np.zeros(b * length, np.int32)
        positions = np.zeros(b * length, np.int32)
        slots = np.full(b * length, -1, np.int32)
        tables = (1 + np.arange(b)[:, None] * per_seq + np.arange(per_seq)[None]).astype(np.int32)
        lens = np.zeros(b, np.int32)
        starts = np.zeros(b, np.int32)
        at = 0
        for i, p in enumerate(prompts):
            pos = np.arange(len(p))
            ids[at:at + len(p)] = p
            positions[at:at + len(p)] = pos
            slots[at:at + len(p)] = tables[i, pos // BLOCK] * BLOCK + pos % BLOCK
            starts[i], lens[i] = at, len(p)
            at += len(p)
        starts[len(prompts):] = at
        md = AttentionMetadata(positions=jnp.asarray(positions), slot_mapping=jnp.asarray(slots),
                               block_tables=jnp.asarray(tables), kv_lens=jnp.asarray(lens),
                               query_start_loc=jnp.asarray(np.append(starts, at).astype(np.int32)),
                               num_seqs=jnp.asarray([len(prompts)], jnp.int32))
        out, _ = self._step(self._state, jnp.asarray(ids), kv, md, jnp.asarray(starts), jnp.asarray(lens))
        return np.asarray(out)

