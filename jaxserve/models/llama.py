"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the packed, paged batch.

All scheduled tokens of all requests share one ``[T]`` axis; attention finds each token's
request through the metadata. The weights' layout picks how the layers run:

- stacked (a leading layer axis): under ``lax.scan``, so a 28-layer model compiles as fast as a
  1-layer one, with the KV cache in the scan carry so that XLA updates it in place. The price is
  paid every step: each layer's weights are sliced out of the stack, and on XLA:CPU a slice is a
  copy (on the CPU benchmark model, 8% of the device time of a 64-token decode step).
- a list of per-layer dicts: unrolled, each matmul reading its own weights. Compiling takes
  about as long at 4 layers, 1.75x as long at 28.

:func:`default_scan_layers` picks by depth; ``--scan-layers`` overrides it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.layers.attention import AttentionFn, AttentionMetadata, paged_attention
from jaxserve.layers.linear import linear
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq
from jaxserve.models.config import ModelConfig

Params = dict[str, Any]
KVCache = tuple[jax.Array, jax.Array]  # (k, v), each [L, num_blocks, block_size, Hkv, D]

# Deepest model unrolled by default. Measured on the 4-layer CPU benchmark model, in one process
# with the two layouts taking turns (14 turns each, twice): unrolled gave 2.4% and 1.5% more output
# tokens/s, and 7-17% more in the turns when other tenants loaded the machine (it moves 25 MB less
# per 64-row decode step). Deeper models stay scanned for the compile time (module docstring),
# which every start-up pays.
UNROLL_MAX_LAYERS = 8


def default_scan_layers(num_layers: int) -> bool:
    return num_layers > UNROLL_MAX_LAYERS


def layers_are_stacked(params: Params) -> bool:
    """True for the scanned layout (a dict of stacks), False for a list of per-layer dicts."""
    return not isinstance(params["layers"], (list, tuple))


class LlamaModel:
    """Stateless model: weights are a pytree passed to every call, the config is static."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim)

    def forward(
        self,
        params: Params,
        input_ids: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        attn_fn: AttentionFn,
    ) -> tuple[jax.Array, KVCache]:
        """Hidden states ``[T, hidden]`` of every scheduled token, and the updated KV cache."""
        k_cache, v_cache = kv_cache
        num_layers, num_blocks = k_cache.shape[:2]
        pool_shape = (num_layers * num_blocks, *k_cache.shape[2:])
        cos, sin = rope_cos_sin(md.positions, jnp.asarray(self.inv_freq))
        hidden = params["embed"][input_ids]

        def layer_step(carry, xs):
            h, k_pool, v_pool = carry
            lp, layer = xs
            h, k_pool, v_pool = self._decoder_layer(lp, layer, num_blocks, h, k_pool, v_pool, cos, sin, md, attn_fn)
            return (h, k_pool, v_pool), None

        carry = (hidden, k_cache.reshape(pool_shape), v_cache.reshape(pool_shape))
        if layers_are_stacked(params):
            layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
            carry, _ = jax.lax.scan(layer_step, carry, (params["layers"], layer_ids))
        else:
            for i, lp in enumerate(params["layers"]):
                carry, _ = layer_step(carry, (lp, jnp.int32(i)))
        hidden, k_pool, v_pool = carry
        return hidden, (k_pool.reshape(k_cache.shape), v_pool.reshape(v_cache.shape))

    def compute_logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        """Final norm and LM head on the selected rows; logits in float32."""
        h = rms_norm(hidden, params["final_norm"], self.config.rms_norm_eps)
        head = params["embed"].T if self.config.tie_word_embeddings else params["lm_head"]
        return (h @ head).astype(jnp.float32)

    def _decoder_layer(self, lp, layer, num_blocks, h, k_pool, v_pool, cos, sin, md, attn_fn):
        cfg = self.config
        x = rms_norm(h, lp["input_norm"], cfg.rms_norm_eps)
        qkv = linear(x, lp["qkv"], lp.get("qkv_bias"))
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
        q = q.reshape(-1, cfg.num_attention_heads, cfg.head_dim)
        k = k.reshape(-1, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        attn, k_pool, v_pool = paged_attention(
            q, k.astype(k_pool.dtype), v.astype(v_pool.dtype), k_pool, v_pool, layer, num_blocks, md, attn_fn,
            sm_scale=cfg.head_dim**-0.5, sliding_window=cfg.sliding_window,
        )
        h = h + linear(attn.reshape(attn.shape[0], -1).astype(h.dtype), lp["o"], lp.get("o_bias"))
        x = rms_norm(h, lp["post_norm"], cfg.rms_norm_eps)
        gate_up = linear(x, lp["gate_up"], lp.get("gate_up_bias"))
        gate, up = jnp.split(gate_up, 2, axis=-1)
        h = h + linear(jax.nn.silu(gate) * up, lp["down"], lp.get("down_bias"))
        return h, k_pool, v_pool
