"""Poolers over a packed step's hidden states: one vector per request, then the embed/classify heads.

A packed step lays the scheduled requests' tokens end to end (``hidden`` is ``[T, H]``); request
``i`` owns rows ``starts[i] : starts[i] + lens[i]``. Padding requests have ``lens == 0`` and pool to
zeros. All shapes are static for a bucket, so one compiled program serves every step of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_owner(starts: jax.Array, lens: jax.Array, num_tokens: int) -> jax.Array:
    """``[T]``: the request that owns each row, or ``len(starts)`` for rows nobody owns."""
    rows = jnp.arange(num_tokens)[:, None]
    inside = (rows >= starts[None, :]) & (rows < (starts + lens)[None, :])
    return jnp.where(inside.any(axis=1), jnp.argmax(inside, axis=1), starts.shape[0])


def pool(hidden: jax.Array, starts: jax.Array, lens: jax.Array, pooling_type: str) -> jax.Array:
    """``[B, H]`` in float32: LAST (last row), CLS (first row) or MEAN (mean of the rows)."""
    h = hidden.astype(jnp.float32)
    present = (lens > 0)[:, None]
    if pooling_type == "LAST":
        picked = h[jnp.maximum(starts + lens - 1, 0)]
    elif pooling_type == "CLS":
        picked = h[starts]
    elif pooling_type == "MEAN":
        owner = token_owner(starts, lens, h.shape[0])
        sums = jax.ops.segment_sum(h, owner, num_segments=starts.shape[0] + 1)[:-1]
        picked = sums / jnp.maximum(lens, 1)[:, None].astype(jnp.float32)
    else:
        raise ValueError(f"pooling_type: must be LAST, MEAN or CLS, got {pooling_type!r}")
    return jnp.where(present, picked, 0.0)


def pool_chunk(hidden: jax.Array, starts: jax.Array, lens: jax.Array, pooling_type: str,
               carry: jax.Array, first: jax.Array) -> jax.Array:
    """``[B, H]`` float32: the pooled state after this step's chunk of each request, from the state
    ``carry`` its earlier chunks left. LAST: the chunk's last row; CLS: the row at position 0
    (``first``: the chunk starts the prompt), else the carried one; MEAN: the running sum (divided
    by the token count once, at the end: :func:`finish_pool`). Rows with ``lens == 0`` keep ``carry``."""
    h = hidden.astype(jnp.float32)
    if pooling_type == "LAST":
        new = h[jnp.maximum(starts + lens - 1, 0)]
    elif pooling_type == "CLS":
        new = jnp.where(first[:, None], h[starts], carry)
    elif pooling_type == "MEAN":
        owner = token_owner(starts, lens, h.shape[0])
        new = carry + jax.ops.segment_sum(h, owner, num_segments=starts.shape[0] + 1)[:-1]
    else:
        raise ValueError(f"pooling_type: must be LAST, MEAN or CLS, got {pooling_type!r}")
    return jnp.where((lens > 0)[:, None], new, carry)


def finish_pool(state: jax.Array, counts: jax.Array, pooling_type: str) -> jax.Array:
    """The pooled vector from :func:`pool_chunk`'s state; ``counts``: tokens pooled so far."""
    if pooling_type == "MEAN":
        return state / jnp.maximum(counts, 1)[:, None].astype(jnp.float32)
    return state


def embed_head(pooled: jax.Array, *, normalize: bool, dimensions: int | None = None) -> jax.Array:
    """Matryoshka truncation first (then the unit norm holds for the kept prefix), then L2 norm."""
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    if normalize:
        # Sentence-Transformers' Normalize: x / max(||x||, eps), with torch's eps of 1e-12.
        norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
        pooled = pooled / jnp.maximum(norm, 1e-12)
    return pooled


def classify_head(pooled: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                  activation: bool = True) -> jax.Array:
    """``score`` head (``weight`` is ``[num_labels, H]`` as in HF), then softmax or, for one label, sigmoid."""
    logits = pooled @ weight.astype(jnp.float32).T
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    return activate(logits) if activation else logits


def activate(logits: jax.Array) -> jax.Array:
    """Label probabilities: softmax, or for one label sigmoid (vLLM's classify activation)."""
    return jax.nn.sigmoid(logits) if logits.shape[-1] == 1 else jax.nn.softmax(logits, axis=-1)
