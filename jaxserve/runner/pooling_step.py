"""The compiled pooling steps: a packed step's forward, a pooler carried across chunks, a head; no sampler.

Both take a packed step as the scheduler lays it out (prompts' scheduled tokens end to end) and the
same per-request inputs: ``starts``/``lens`` (the rows each request owns in this step; 0 for padding
rows), ``carry`` (the pooled state its earlier chunks left), ``first`` (the chunk starts the prompt)
and ``counts`` (tokens pooled once this chunk is in). They return ``(out, carry, kv)``: ``out`` is
the head's output for every row, read for the requests whose prompt ends in this step; ``carry`` is
kept for the others. The decoder writes and reads the paged KV pools (so chunks and prefix hits
see earlier keys); the encoder keeps none. One jitted program per token bucket: shapes fix it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.pooler import activate, classify_head, embed_head, finish_pool, pool_chunk
from jaxserve.models.bert import BertConfig, bert_classify_first, bert_encode_packed
from jaxserve.models.pooling_config import PoolerConfig

Score = tuple[jax.Array, jax.Array | None]


def pooling_head(pooled: jax.Array, task: str, pooler: PoolerConfig, score: Score | None = None) -> jax.Array:
    """``[B, D]`` float32: embeddings (embed) or label probabilities (classify) from pooled rows."""
    if task == "embed":
        return embed_head(pooled, normalize=pooler.normalize, dimensions=pooler.dimensions)
    if score is None:
        raise ValueError("classify needs the checkpoint's score head (weight [num_labels, hidden])")
    return classify_head(pooled, score[0], score[1], activation=pooler.activation)


def _pool(hidden: jax.Array, x: dict[str, jax.Array], pooling_type: str) -> tuple[jax.Array, jax.Array]:
    """(the state to carry, the pooled vector if the prompt ended here)."""
    carry = pool_chunk(hidden, x["starts"], x["lens"], pooling_type, x["carry"], x["first"])
    return carry, finish_pool(carry, x["counts"], pooling_type)


def make_decoder_step(model: nnx.Module, task: str, pooler: PoolerConfig, attn_fn: Callable[..., Any],
                      score: Score | None = None):
    """``(step, weights)``: ``step(weights, kv, x) -> (out [R, D], carry [R, H], kv)``, jitted, the
    pools donated (updated in place, as the generating step does)."""
    graphdef, weights = nnx.split(model)

    def step(weights, kv, x):
        m: Any = nnx.merge(graphdef, weights)
        md = AttentionMetadata(positions=x["positions"], slot_mapping=x["slot_mapping"],
                               block_tables=x["block_tables"], kv_lens=x["kv_lens"],
                               query_start_loc=x["query_start_loc"], num_seqs=x["num_seqs"])
        hidden, kv = m(x["input_ids"], kv, md, attn_fn)
        carry, pooled = _pool(m.norm(hidden), x, pooler.pooling_type)
        return pooling_head(pooled, task, pooler, score), carry, kv

    return jax.jit(step, donate_argnums=(1,)), weights


def make_encoder_step(cfg: BertConfig, task: str, pooler: PoolerConfig):
    """The BERT encoder's step, the same signature; ``kv`` is an empty tuple, returned as it came.
    A prompt is never chunked here (``first`` is always true): bidirectional attention needs it whole."""

    def step(params, kv, x):
        hidden = bert_encode_packed(cfg, params, x["input_ids"], x["positions"], x["token_type_ids"], x["segments"])
        if task == "embed":
            carry, pooled = _pool(hidden, x, pooler.pooling_type)
            return embed_head(pooled, normalize=pooler.normalize, dimensions=pooler.dimensions), carry, kv
        # A cross-encoder: BERT's own pooler (dense + tanh on the first token), then its classifier.
        carry, first = _pool(hidden, x, "CLS")
        logits = bert_classify_first(params, first)
        return (activate(logits) if pooler.activation else logits), carry, kv

    return jax.jit(step)
