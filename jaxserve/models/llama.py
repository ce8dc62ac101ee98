"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the packed, paged batch, as Flax NNX
modules.

All scheduled tokens of all requests share one ``[T]`` axis; attention finds each token's request
through the metadata. Modules carry Hugging Face's names (``model.layers[i].self_attn.o_proj``),
parameters flax's (``kernel`` stored ``[in, out]``, ``embedding``, ``scale``). ``layers`` has one
of two layouts:

- scanned (:class:`ScannedLayers`): one layer traced under ``lax.scan``, so a deep model compiles
  about as fast as a shallow one, with the KV cache in the scan carry so that XLA updates it in
  place. The price is paid every step: each layer's weights are sliced out of the stack, and on
  XLA:CPU and XLA:GPU alike a slice is a copy.
- unrolled (an ``nnx.List`` of layers): each matmul reads its own weights; compile time grows
  with depth.

:func:`default_scan_layers` picks by platform and depth; ``--scan-layers`` overrides it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.exceptions import ConfigError
from jaxserve.layers.attention import AttentionFn, AttentionMetadata, paged_attention, to_cache_dtype
from jaxserve.layers.block_quant_linear import BlockQuantEmbedding, embedding_block_format_of, project
from jaxserve.layers.embedding import Embedding, vocab_parallel_logits
from jaxserve.layers.linear import Linear
from jaxserve.layers.lora import LoRABatch
from jaxserve.layers.norm import RMSNorm
from jaxserve.layers.quantized_linear import make_linear
from jaxserve.layers.rotary import RotaryEmbedding, apply_rope
from jaxserve.models.config import ModelConfig
from jaxserve.models.forward_context import ForwardContext, KVGroups, KVPools
from jaxserve.models.layer_stack import ScannedLayers
from jaxserve.models.moe import SparseMoeBlock, expert_load
from jaxserve.models.tp_layout import TPLayout

KVCache = tuple[jax.Array, jax.Array]  # (k, v), each [L, num_blocks, block_size, Hkv, D]

# Deepest model unrolled by default on a CPU: unrolled steps run faster (no weight slices copied per
# step), scanned ones compile faster, which every start-up pays and which grows with depth.
UNROLL_MAX_LAYERS = 8


# The MLP's gate activation, by config.json's name (Gemma's gelu_pytorch_tanh is gelu's tanh form).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def make_norm(cfg: ModelConfig, features: int) -> RMSNorm:
    """An RMSNorm of the model's kind (Gemma's scales by ``1 + w``)."""
    return RMSNorm(features, eps=cfg.rms_norm_eps, param_dtype=jnp.dtype(cfg.dtype), offset=cfg.norm_offset)


def default_scan_layers(num_layers: int, platform: str | None = None) -> bool:
    """A GPU always unrolls: XLA:GPU copies every layer's weight slices out of the stack on each
    step under a scan (``scripts/gpu_aot_check.py`` shows it); a CPU scans models deeper than
    ``UNROLL_MAX_LAYERS``."""
    if (platform or jax.default_backend()) == "gpu":
        return False
    return num_layers > UNROLL_MAX_LAYERS


class LlamaAttention(nnx.Module):
    """Fused q|k|v projection, q/k RMSNorm over ``head_dim`` (Qwen3), rotary, paged attention, o.

    The fused columns are in ``layout``'s shard-major order (see :mod:`.tp_layout`); key/value
    heads are the stored ones (replicated when there are fewer than shards)."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, *, quantization: str | None = None, rngs: nnx.Rngs,
                 sliding_window: int | None = None):
        dtype = jnp.dtype(cfg.dtype)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = layout.stored_kv_heads
        self.num_shards = layout.size
        self.head_dim = cfg.head_dim
        self.sliding_window = sliding_window
        self.sm_scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        # gpt-oss: each head's sink logit (float32: it is added in the softmax, which runs in float32)
        self.sinks = (nnx.Param(jnp.zeros((cfg.num_attention_heads,), jnp.float32)) if cfg.attention_sinks
                      else nnx.data(None))
        self.qkv_proj = make_linear(cfg.hidden_size, layout.qkv_width, use_bias=cfg.attention_bias,
                                    param_dtype=dtype, quantization=quantization, rngs=rngs)
        self.o_proj = make_linear(cfg.q_size, cfg.hidden_size, use_bias=cfg.o_proj_bias, param_dtype=dtype,
                                  quantization=quantization, rngs=rngs)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg, cfg.head_dim)
            self.k_norm = make_norm(cfg, cfg.head_dim)
        else:
            self.q_norm = nnx.data(None)
            self.k_norm = nnx.data(None)

    def __call__(self, x: jax.Array, kv: KVPools, layer: jax.Array,
                 ctx: ForwardContext) -> tuple[jax.Array, KVPools]:
        """``x [T, hidden]`` -> ``[T, hidden]``; this step's K/V are written into layer ``layer``'s pages."""
        n = self.num_shards
        q_size, kv_size = self.num_heads * self.head_dim // n, self.num_kv_heads * self.head_dim // n
        qkv = project(self.qkv_proj, x, ctx.mesh, "column", layer)
        if ctx.lora is not None:  # its columns in the layout's order, split as the base's (models.lora_slots)
            qkv = qkv + ctx.lora.delta("qkv", x, layer, (q_size, kv_size, kv_size), n)
        qkv = qkv.reshape(x.shape[0], n, -1)  # [T, shard, q_s | k_s | v_s]
        q, k, v = jnp.split(qkv, [q_size, q_size + kv_size], axis=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = ctx.rope_for(self.sliding_window is not None)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_pool, v_pool = kv
        md, kv_slot = ctx.kv_view(layer)
        out, k_pool, v_pool = paged_attention(
            q, to_cache_dtype(k, k_pool.dtype), to_cache_dtype(v, v_pool.dtype), k_pool, v_pool, kv_slot,
            ctx.num_blocks, md, ctx.attn_fn, sm_scale=self.sm_scale, sliding_window=self.sliding_window,
            mesh=ctx.mesh, sinks=None if self.sinks is None else self.sinks[...],
        )
        out = out.reshape(out.shape[0], -1).astype(x.dtype)
        o = project(self.o_proj, out, ctx.mesh, "row", layer)
        if ctx.lora is not None:
            o = o + ctx.lora.delta("o", out, layer)
        return o, (k_pool, v_pool)


class LlamaMLP(nnx.Module):
    """SwiGLU: ``down(silu(gate) * up)``, gate|up fused into one projection whose columns are
    ``[gate_s | up_s]`` per shard ``s``."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, *, quantization: str | None = None, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.num_shards = layout.size
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj = make_linear(cfg.hidden_size, 2 * cfg.intermediate_size, use_bias=cfg.mlp_bias,
                                        param_dtype=dtype, quantization=quantization, rngs=rngs)
        self.down_proj = make_linear(cfg.intermediate_size, cfg.hidden_size, use_bias=cfg.mlp_bias,
                                     param_dtype=dtype, quantization=quantization, rngs=rngs)

    def __call__(self, x: jax.Array, lora: LoRABatch | None = None, layer: jax.Array | int = 0,
                 mesh: Mesh | None = None) -> jax.Array:
        gate_up = project(self.gate_up_proj, x, mesh, "column", layer)
        if lora is not None:
            per = gate_up.shape[-1] // (2 * self.num_shards)  # [gate_s | up_s] per shard
            gate_up = gate_up + lora.delta("gate_up", x, layer, (per, per), self.num_shards)
        gate, up = jnp.split(gate_up.reshape(x.shape[0], self.num_shards, -1), 2, axis=-1)
        h = (self.act(gate) * up).reshape(x.shape[0], -1)
        down = project(self.down_proj, h, mesh, "row", layer)
        return down if lora is None else down + lora.delta("down", h, layer)


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm residual block: attention (over its ``sliding_window``, None: full), then the MLP."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, *, quantization: str | None = None, rngs: nnx.Rngs,
                 sliding_window: int | None = None):
        dtype = jnp.dtype(cfg.dtype)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attn = LlamaAttention(cfg, layout, quantization=quantization, rngs=rngs,
                                        sliding_window=sliding_window)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        # Gemma: post_attention_layernorm normalizes the attention's output, these two the MLP's input and output
        self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size) if cfg.sandwich_norms else nnx.data(None)
        self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size) if cfg.sandwich_norms else nnx.data(None)
        self.mlp: LlamaMLP | SparseMoeBlock
        if cfg.is_moe:  # Qwen3-MoE, Mixtral: the experts stay in float under --quantization
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                      cfg.num_experts_per_tok, cfg.norm_topk_prob, param_dtype=dtype, rngs=rngs,
                                      clamped_swiglu=cfg.clamped_swiglu)
        else:
            self.mlp = LlamaMLP(cfg, layout, quantization=quantization, rngs=rngs)

    def __call__(self, hidden: jax.Array, kv: KVPools, layer: jax.Array,
                 ctx: ForwardContext) -> tuple[jax.Array, KVPools, jax.Array | None]:
        """The layer's output, the updated pools and, for a MoE layer, its per-expert load ``[E]``
        over the step's real tokens (None for a dense MLP)."""
        attn, kv = self.self_attn(self.input_layernorm(hidden), kv, layer, ctx)
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            assert isinstance(self.mlp, LlamaMLP)  # Gemma 3 has no experts
            hidden = hidden + self.post_attention_layernorm(attn)
            mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden), ctx.lora, layer)
            return hidden + self.post_feedforward_layernorm(mlp_out), kv, None
        hidden = hidden + attn
        normed = self.post_attention_layernorm(hidden)
        if isinstance(self.mlp, SparseMoeBlock):  # no LoRA on the experts (adapters target the dense MLP)
            out, ids = self.mlp.forward(normed, ctx.mesh)
            real = jnp.arange(hidden.shape[0]) < ctx.md.query_start_loc[ctx.md.num_seqs[0]]
            return hidden + out, kv, expert_load(ids, real, self.mlp.experts.down_proj.shape[0])
        return hidden + self.mlp(normed, ctx.lora, layer, ctx.mesh), kv, None


class LlamaForCausalLM(nnx.Module):
    """The whole decoder; one class for Llama, Mistral, Qwen2 and Qwen3 (the config says which
    biases and norms exist). ``lm_head`` is None when the checkpoint ties it to the embedding.

    ``tensor_parallel_size`` fixes the weights' layout (:class:`.tp_layout.TPLayout`): the fused
    projections' column order, the stored key/value heads and the padded vocabulary. The module is
    the whole model either way; a mesh given to :meth:`__call__` and :meth:`compute_logits` runs
    it split, its arrays placed by :mod:`jaxserve.runner.mesh`.

    ``quantization`` ("int8", "fp8"; None: float) makes the decoder layers' four projections
    :class:`~jaxserve.layers.quantized_linear.QuantizedLinear`; the embedding and the LM head stay
    in ``config.dtype`` (as vLLM's online fp8 keeps them)."""

    def __init__(self, config: ModelConfig, *, scan_layers: bool | None = None, tensor_parallel_size: int = 1,
                 quantization: str | None = None, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        windows = config.layer_windows
        mixed = len(set(windows)) > 1  # a scan traces one layer: one window for all
        if scan_layers is None:
            scan_layers = default_scan_layers(config.num_hidden_layers) and not mixed
        if scan_layers and mixed:
            raise ConfigError("scan_layers: layers with different attention (full and sliding-window) run "
                              "unrolled only")
        layout = TPLayout.of(config, tensor_parallel_size)
        self.config = config
        self.layout = layout
        self.quantization = quantization
        embed_format = embedding_block_format_of(quantization)
        self.embed_tokens = (
            Embedding(layout.padded_vocab, config.hidden_size, param_dtype=dtype, rngs=rngs) if embed_format is None
            else BlockQuantEmbedding(layout.padded_vocab, config.hidden_size, qtype=embed_format, param_dtype=dtype))
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)
        self.local_rotary_emb = (nnx.data(None) if config.local_rope is None
                                 else RotaryEmbedding(config.local_rope, config.head_dim))
        self.layers: ScannedLayers | nnx.List[LlamaDecoderLayer]
        if scan_layers:
            self.layers = ScannedLayers(lambda r: LlamaDecoderLayer(config, layout, quantization=quantization, rngs=r,
                                                                    sliding_window=windows[0]),
                                        config.num_hidden_layers, rngs=rngs)
        else:
            self.layers = nnx.List([LlamaDecoderLayer(config, layout, quantization=quantization, rngs=rngs,
                                                      sliding_window=w) for w in windows])
        self.norm = make_norm(config, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = Linear(config.hidden_size, layout.padded_vocab, param_dtype=dtype, rngs=rngs)

    @property
    def scan_layers(self) -> bool:
        """True when the layers run under ``lax.scan`` (stacked parameters), False when unrolled."""
        return isinstance(self.layers, ScannedLayers)

    @property
    def tensor_parallel_size(self) -> int:
        return self.layout.size

    def __call__(self, input_ids: jax.Array, kv_cache: KVCache, md: AttentionMetadata,
                 attn_fn: AttentionFn, mesh: Mesh | None = None, lora: LoRABatch | None = None,
                 mm_embeds: jax.Array | None = None, mm_mask: jax.Array | None = None,
                 kv_groups: KVGroups | None = None,
                 mrope_positions: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Hidden states ``[T, hidden]`` of every scheduled token (replicated), and the updated KV
        cache. ``mesh``: the tensor-parallel mesh the arrays live on (its axes split the heads).
        ``lora``: this step's adapter slots (None: the base program, with no LoRA op in it).
        ``mm_embeds [T, hidden]``, where ``mm_mask [T]`` is set, replace the token embeddings: an
        image's encoder output at its placeholder tokens (a vision-language model). ``kv_groups``:
        the per-group block tables when the layers' attention differs (the cache's first axis is
        then the KV slots, not the layers). ``mrope_positions [3, T]``: an M-RoPE model's (t, h, w)
        rotary positions; without them a token's three are its sequence position (text only)."""
        hidden, kv, _ = self.forward(input_ids, kv_cache, md, attn_fn, mesh, lora, mm_embeds, mm_mask, kv_groups,
                                     mrope_positions)
        return hidden, kv

    def forward(self, input_ids: jax.Array, kv_cache: KVCache, md: AttentionMetadata,
                attn_fn: AttentionFn, mesh: Mesh | None = None, lora: LoRABatch | None = None,
                mm_embeds: jax.Array | None = None,
                mm_mask: jax.Array | None = None,
                kv_groups: KVGroups | None = None,
                mrope_positions: jax.Array | None = None) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """``__call__``'s outputs and, for a MoE model, the routed (token, expert) pairs per layer
        and expert ``[L, E]`` int32 over the step's real tokens (None for a dense model)."""
        hidden, kv, loads, _ = self.forward_with_aux(input_ids, kv_cache, md, attn_fn, mesh, lora, mm_embeds, mm_mask,
                                                     kv_groups, mrope_positions)
        return hidden, kv, loads

    def forward_with_aux(self, input_ids: jax.Array, kv_cache: KVCache, md: AttentionMetadata,
                         attn_fn: AttentionFn, mesh: Mesh | None = None, lora: LoRABatch | None = None,
                         mm_embeds: jax.Array | None = None, mm_mask: jax.Array | None = None,
                         kv_groups: KVGroups | None = None, mrope_positions: jax.Array | None = None,
                         aux_layers: tuple[int, ...] = ()
                         ) -> tuple[jax.Array, KVCache, jax.Array | None, jax.Array | None]:
        """:meth:`forward`'s outputs and the residual stream entering each layer of ``aux_layers``
        (in increasing layer order), concatenated ``[T, len(aux_layers) * hidden]``: the inputs
        an EAGLE-3 head reads (None when ``aux_layers`` is empty)."""
        k_cache, v_cache = kv_cache
        num_slots, num_blocks = k_cache.shape[:2]  # a slot per layer, or per layer of a KV group
        pool_shape = (num_slots * num_blocks, *k_cache.shape[2:])
        rope_positions = md.positions
        if self.config.rope.mrope_section:
            rope_positions = mrope_positions if mrope_positions is not None else jnp.stack([md.positions] * 3)
        cos, sin = self.rotary_emb(rope_positions)
        local = None if self.local_rotary_emb is None else self.local_rotary_emb(md.positions)
        ctx = ForwardContext(md=md, attn_fn=attn_fn, cos=cos, sin=sin, num_blocks=num_blocks, mesh=mesh,
                             lora=lora, kv_groups=kv_groups, local_rope=local)

        wanted = tuple(sorted(aux_layers))

        def run_layer(layer, index, carry):
            hidden, kv, loads, aux = carry
            if aux is not None:  # index may be traced (scanned layers): a select per wanted layer
                aux = jnp.stack([jnp.where(index == j, hidden, aux[i]) for i, j in enumerate(wanted)])
            out = layer(hidden, kv, index, ctx)
            # A dense layer may return (hidden, kv), as a user's replacement layer does; a MoE
            # layer adds its per-expert load.
            hidden, kv, load = out if len(out) == 3 else (*out, None)
            return hidden, kv, (None if load is None else loads.at[index].set(load)), aux

        embeds = self.embed_tokens(input_ids, mesh)
        if self.config.embed_scale is not None:  # Gemma: the scale cast to the weights' dtype first
            embeds = embeds * jnp.asarray(self.config.embed_scale, embeds.dtype)
        if lora is not None and "embed" in lora.a:  # after the scale: PEFT adds it to the scaled module's output
            embeds = embeds + lora.embedding_delta(input_ids, mesh).astype(embeds.dtype)
        if mm_embeds is not None and mm_mask is not None:
            embeds = jnp.where(mm_mask[:, None], mm_embeds.astype(embeds.dtype), embeds)
        loads = (jnp.zeros((self.config.num_hidden_layers, self.config.num_experts), jnp.int32)
                 if self.config.is_moe else None)
        aux = jnp.zeros((len(wanted), *embeds.shape), embeds.dtype) if wanted else None
        carry = (embeds, (k_cache.reshape(pool_shape), v_cache.reshape(pool_shape)), loads, aux)
        if isinstance(self.layers, ScannedLayers):
            carry = self.layers.scan(run_layer, carry)
        else:
            for i, layer in enumerate(self.layers):
                carry = run_layer(layer, jnp.int32(i), carry)
        hidden, (k_pool, v_pool), loads, aux = carry
        aux_out = None if aux is None else jnp.concatenate(list(aux), axis=-1)
        return hidden, (k_pool.reshape(k_cache.shape), v_pool.reshape(v_cache.shape)), loads, aux_out

    def compute_logits(self, hidden: jax.Array, mesh: Mesh | None = None, lora: LoRABatch | None = None
                       ) -> jax.Array:
        """Final norm and LM head on the selected rows; logits in float32 over the vocabulary.
        ``lora`` with an LM-head table: each row (``lora.slot_ids``: one per row) adds its
        adapter's delta in float32, before any soft-cap.

        Split, each shard computes its vocabulary slice (and its slice of the LoRA delta) and the
        slices are gathered (replicated): the sampler's top-k/top-p, penalties, logprobs and
        grammar masks all want the full row, and gathering ``[rows, vocab]`` costs far less than
        any weight."""
        h = self.norm(hidden)
        head_lora = lora if lora is not None and "lm_head" in lora.a else None
        if mesh is not None and mesh.size > 1:
            logits = self._vocab_parallel_logits(h, mesh, head_lora)
        else:
            logits = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
            if head_lora is not None:
                logits = logits.astype(jnp.float32) + head_lora.head_delta(h).astype(jnp.float32)
        logits = logits[..., : self.config.vocab_size].astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def _vocab_parallel_logits(self, h: jax.Array, mesh: Mesh, lora: LoRABatch | None = None) -> jax.Array:
        """Each device multiplies by its own vocabulary slice of the head (under ``shard_map``:
        left to itself, the partitioner may gather the whole head instead) and adds its slice of
        the LoRA delta, then the logits are gathered."""
        tied = self.lm_head is None
        if isinstance(self.embed_tokens, BlockQuantEmbedding):  # kept blocks: the tied head, split on its rows
            logits = self.embed_tokens.attend(h, mesh)
        else:
            weight = self.embed_tokens.embedding[...] if self.lm_head is None else self.lm_head.kernel[...]
            logits = vocab_parallel_logits(h, weight, tied, mesh)
        if lora is not None:  # split on the vocabulary as the logits are: added on each device, no collective;
            # in float32 as with one device (so a LoRA step gathers float32 logits)
            logits = logits.astype(jnp.float32) + lora.head_delta(h, mesh).astype(jnp.float32)
        return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, PartitionSpec()))
