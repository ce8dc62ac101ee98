"""One sequence through the paged decoder, as the runner drives it (test helper)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from jaxserve.layers.attention import AttentionMetadata

BLOCK_SIZE = 4
NUM_BLOCKS = 64


class PagedSequence:
    """Drives one sequence through the paged forward, chunk by chunk (blocks 1, 2, 3, ...), the way
    the runner does: the module split once, its state passed to a jitted function that merges it."""

    def __init__(self, model):
        cfg = model.config
        shape = (cfg.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = (jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
        self.num_computed = 0
        self.graphdef, self.state = nnx.split(model)
        self.step = jax.jit(self._step)

    def _step(self, state, ids, kv, md):
        model = nnx.merge(self.graphdef, state)
        hidden, kv = model(ids, kv, md, pallas_kernels.ragged_paged_attention_reference)
        return model.compute_logits(hidden), kv

    def inputs(self, token_ids: list[int]) -> tuple[jax.Array, AttentionMetadata]:
        """The engine's inputs for the next chunk: token ids and paged-attention metadata."""
        start, n = self.num_computed, len(token_ids)
        positions = np.arange(start, start + n, dtype=np.int32)
        slots = (1 + positions // BLOCK_SIZE) * BLOCK_SIZE + positions % BLOCK_SIZE
        max_blocks = NUM_BLOCKS - 1
        md = AttentionMetadata(
            positions=jnp.asarray(positions),
            slot_mapping=jnp.asarray(slots, jnp.int32),
            block_tables=jnp.asarray(np.arange(1, max_blocks + 1, dtype=np.int32)[None]),
            kv_lens=jnp.asarray([start + n], jnp.int32),
            query_start_loc=jnp.asarray([0, n], jnp.int32),
            num_seqs=jnp.asarray([1], jnp.int32),
        )
        return jnp.asarray(token_ids, jnp.int32), md

    def feed(self, token_ids: list[int]) -> np.ndarray:
        """Logits at every fed position."""
        ids, md = self.inputs(token_ids)
        logits, self.kv = self.step(self.state, ids, self.kv, md)
        self.num_computed += len(token_ids)
        return np.asarray(logits)


def prompt(length: int, seed: int = 0, vocab: int = 500) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, length).tolist()
