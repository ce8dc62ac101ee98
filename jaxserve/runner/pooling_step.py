"""The compiled pooling step: the decoder's forward, its final norm, a pooler and a head; no sampler.

It takes a packed step exactly as the generating step does (ids, KV pools, attention metadata), so
the scheduler's chunking and the prefix cache apply unchanged; the extra inputs name, per request,
the rows this step pools (``starts``/``lens``; ``lens == 0`` for a request whose prompt is not
finished yet, or for padding). One jitted function per bucket: the shapes fix the program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxserve.layers.pooler import classify_head, embed_head, pool
from jaxserve.models.pooling_config import PoolerConfig


def pooling_head(hidden: jax.Array, starts: jax.Array, lens: jax.Array, task: str, pooler: PoolerConfig,
                 score: tuple[jax.Array, jax.Array | None] | None = None) -> jax.Array:
    """``[B, D]`` float32: embeddings (embed) or label probabilities (classify) from normed hidden rows."""
    pooled = pool(hidden, starts, lens, pooler.pooling_type)
    if task == "embed":
        return embed_head(pooled, normalize=pooler.normalize, dimensions=pooler.dimensions)
    if score is None:
        raise ValueError("classify needs the checkpoint's score head (weight [num_labels, hidden])")
    return classify_head(pooled, score[0], score[1], activation=pooler.activation)


def make_pooling_step(model: nnx.Module, task: str, pooler: PoolerConfig, attn_fn: Callable[..., Any],
                      score: tuple[jax.Array, jax.Array | None] | None = None):
    """``(step, state)``: ``step(state, ids, kv, md, starts, lens) -> (out [B, D], kv)``, jitted.

    The KV pools come back updated, so a later chunk of the same prompt (or a prompt sharing its
    prefix) attends to this one's keys; the pools are donated, as the generating step does."""
    graphdef, state = nnx.split(model)

    def step(state, ids, kv, md, starts, lens):
        m: Any = nnx.merge(graphdef, state)
        hidden, kv = m(ids, kv, md, attn_fn)
        out = pooling_head(m.norm(hidden), starts, lens, task, pooler, score)
        return out, kv

    return jax.jit(step, donate_argnums=(2,)), state

