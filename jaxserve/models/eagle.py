"""EAGLE and EAGLE-3 draft heads (vLLM's ``llama_eagle.py`` / ``llama_eagle3.py``): one Llama
decoder layer that reads the target's hidden states besides the tokens.

The head at position ``p`` reads the token at ``p + 1`` and the target's hidden state at ``p``,
and predicts the token at ``p + 2``; drafting on, it reads its own output hidden state.

- **eagle** (EAGLE-1): ``x = fc(concat(embed(token), hidden))`` (``fc [h, 2h]``, maybe a bias),
  then the layer without its input norm (the residual is ``x``); the output ``y`` is both the next
  hidden state and the input of the target's LM head (no final norm). ``hidden`` is the target's
  last hidden state after its final norm. The embedding and LM head are the target's.
- **eagle3**: the target's hidden states entering three of its layers (``eagle_aux_hidden_state_layer_ids``,
  default ``(2, L // 2, L - 3)``) go through ``fc [h, 3h]`` once; the layer's q/k/v read
  ``concat(input_layernorm(embed(token)), hidden_norm(hidden))`` (width ``2h``), the residual is
  ``hidden`` (``hidden_norm(hidden)`` with ``norm_before_residual``); the pre-norm output is the next
  hidden state, ``norm`` then the head's own ``lm_head`` over ``draft_vocab_size`` tokens give the
  logits, and ``d2t`` maps draft id ``d`` to target id ``d + d2t[d]``. The embedding is the target's
  unless the checkpoint has one.

Weights are a flat dict of arrays (projections stored ``[in, out]``), the configuration a frozen
dataclass closed over by the compiled programs.

Tensor parallel: ``mesh`` is the target's, over which its embedding is split on the vocabulary
(looked up vocabulary-parallel); ``attn_mesh`` is given when the head's own layer is split (its
attention then runs per shard of heads, as a target layer's does), None when it is replicated.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.exceptions import ConfigError
from jaxserve.layers.attention import AttentionFn, AttentionMetadata, paged_attention, to_cache_dtype
from jaxserve.layers.embedding import vocab_parallel_logits, vocab_parallel_rows
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import RotaryEmbedding, apply_rope
from jaxserve.models.config import ModelConfig
from jaxserve.models.torch_pickle import open_state_dict_files

Weights = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """A loaded head. ``layer``: its decoder layer's shape (one layer, Llama), which also sizes
    its KV pool; ``aux_layers``: the target layers whose input an EAGLE-3 head reads (empty for
    EAGLE-1, which reads the final hidden state)."""

    method: str
    layer: ModelConfig
    aux_layers: tuple[int, ...]
    draft_vocab_size: int
    norm_before_residual: bool = False

    @property
    def target_hidden_width(self) -> int:
        """Width of the target hidden state the runner hands over per token."""
        h = self.layer.hidden_size
        return h * len(self.aux_layers) if self.aux_layers else h


def _field(name: str, folder: Path | str) -> str:
    return f"speculative_config.model ({folder}): {name}"


def eagle_config(folder: str | Path, method: str, target: ModelConfig) -> EagleConfig:
    """The head's configuration from its config.json, checked against the target's."""
    folder = Path(folder)
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(_field("no config.json", folder))
    return eagle_config_from(json.loads(file.read_text()), method, target, folder)


def eagle_config_from(raw: dict[str, Any], method: str, target: ModelConfig, folder: Path | str) -> EagleConfig:
    """The head's configuration from its config.json's dict (``folder`` names it in errors),
    checked against the target's."""
    # The head's layer is a Llama layer whatever the checkpoint's architecture name says.
    layer = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                                   "dtype": target.dtype})
    if layer.hidden_size != target.hidden_size:
        raise ConfigError(_field(f"hidden_size {layer.hidden_size} is not the target's ({target.hidden_size})", folder))
    if layer.vocab_size != target.vocab_size:
        raise ConfigError(_field(f"vocab_size {layer.vocab_size} is not the target's ({target.vocab_size}); "
                                 "the head was trained for another model", folder))
    aux: tuple[int, ...] = ()
    if method == "eagle3":
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        n = target.num_hidden_layers
        aux = tuple(ids) if ids else (2, n // 2, n - 3)
        if not all(isinstance(i, int) and 0 <= i < n for i in aux):
            raise ConfigError(_field(f"eagle_aux_hidden_state_layer_ids {list(aux)} are not layers of the "
                                     f"{n}-layer target", folder))
        aux = tuple(sorted(aux))  # the target hands them over in layer order, as vLLM's do
        width = raw.get("target_hidden_size") or layer.hidden_size
        if width != target.hidden_size:
            raise ConfigError(_field(f"target_hidden_size {width} is not the target's ({target.hidden_size})",
                                     folder))
    draft_vocab = int(raw.get("draft_vocab_size") or layer.vocab_size) if method == "eagle3" else layer.vocab_size
    return EagleConfig(method, layer, aux, draft_vocab, bool(raw.get("norm_before_residual", False)))


def eagle_weight_shapes(cfg: EagleConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The head's tensors as published (``[out, in]`` projections): the required ones and the
    optional ones (biases; EAGLE-3's own embedding and ``d2t``), by name and shape."""
    mc = cfg.layer
    h, e3 = mc.hidden_size, cfg.method == "eagle3"
    fc_in = (cfg.target_hidden_width if e3 else 2 * h)
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, fc_in),
        "layers.0.self_attn.q_proj.weight": (mc.q_size, 2 * h if e3 else h),
        "layers.0.self_attn.k_proj.weight": (mc.kv_size, 2 * h if e3 else h),
        "layers.0.self_attn.v_proj.weight": (mc.kv_size, 2 * h if e3 else h),
        "layers.0.self_attn.o_proj.weight": (h, mc.q_size),
        "layers.0.mlp.gate_proj.weight": (mc.intermediate_size, h),
        "layers.0.mlp.up_proj.weight": (mc.intermediate_size, h),
        "layers.0.mlp.down_proj.weight": (h, mc.intermediate_size),
        "layers.0.post_attention_layernorm.weight": (h,),
    }
    optional: dict[str, tuple[int, ...]] = {"fc.bias": (h,)}
    for p in ("q", "k", "v"):
        optional[f"layers.0.self_attn.{p}_proj.bias"] = (mc.q_size if p == "q" else mc.kv_size,)
    if e3:
        shapes.update({"layers.0.input_layernorm.weight": (h,), "layers.0.hidden_norm.weight": (h,),
                       "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h)})
        optional.update({"embed_tokens.weight": (mc.vocab_size, h), "d2t": (cfg.draft_vocab_size,)})
    return shapes, optional


def as_served(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A published tensor's shape as :func:`load_eagle_weights` keeps it (projections ``[in, out]``)."""
    return shape[::-1] if len(shape) == 2 and key != "embed_tokens.weight" else shape


def load_eagle_weights(folder: str | Path, cfg: EagleConfig, dtype: jnp.dtype) -> Weights:
    """The head's tensors by their published names (``model.`` prefixes dropped, EAGLE-3's
    ``midlayer.`` read as ``layers.0.``), checked by shape; projections transposed to ``[in, out]``.
    From ``model.safetensors`` (or shards), or ``pytorch_model.bin`` when that is all the folder has."""
    folder = Path(folder)
    files = open_state_dict_files(folder)
    names = {}
    for name in files:
        short = name.removeprefix("model.").replace("midlayer.", "layers.0.")
        names[short] = name
    mc, h = cfg.layer, cfg.layer.hidden_size
    shapes, optional = eagle_weight_shapes(cfg)
    out: dict[str, np.ndarray] = {}
    for key, shape in [*shapes.items(), *optional.items()]:
        if key not in names:
            if key in shapes:
                raise ConfigError(_field(f"no tensor {key} (an {cfg.method} head needs it)", folder))
            continue
        value = files[names[key]].get(names[key])
        if tuple(value.shape) != shape:
            raise ConfigError(_field(f"{key} has shape {list(value.shape)}, expected {list(shape)} for the "
                                     f"target's hidden size {h}", folder))
        out[key] = value
    if cfg.method == "eagle3" and "d2t" not in out and cfg.draft_vocab_size != mc.vocab_size:
        raise ConfigError(_field(f"no tensor d2t: a draft vocabulary of {cfg.draft_vocab_size} tokens needs the "
                                 f"map to the target's {mc.vocab_size}", folder))
    weights: Weights = {}
    for key, value in out.items():
        if key == "d2t":
            weights[key] = jnp.asarray(value.astype(np.int32))
            continue
        a = jnp.asarray(np.asarray(value, np.float32), dtype)
        # [out, in] -> [in, out] for the projections and fc; norms, biases and tables as stored
        weights[key] = a.T if a.ndim == 2 and key != "embed_tokens.weight" else a
    return weights


@dataclasses.dataclass(frozen=True)
class TargetTables:
    """What the head borrows from the target: its embedding ``[V, h]`` and its LM head ``[h, V]``
    (None: tied to the embedding). Rows past the vocabulary (tensor-parallel padding) are unused."""

    embedding: jax.Array
    lm_head: jax.Array | None


jax.tree_util.register_dataclass(TargetTables, data_fields=["embedding", "lm_head"], meta_fields=[])


def combine_target_hidden(cfg: EagleConfig, w: Weights, hidden: jax.Array) -> jax.Array:
    """The target's hidden states as the head reads them: EAGLE-3's three layers through ``fc``;
    EAGLE-1's as they are (its ``fc`` also takes the token's embedding, in :func:`eagle_forward`)."""
    if cfg.method != "eagle3":
        return hidden
    out = hidden.astype(w["fc.weight"].dtype) @ w["fc.weight"]
    return out + w["fc.bias"] if "fc.bias" in w else out


def eagle_forward(cfg: EagleConfig, w: Weights, target: TargetTables, input_ids: jax.Array, hidden: jax.Array,
                  kv: tuple[jax.Array, jax.Array], md: AttentionMetadata, attn_fn: AttentionFn,
                  mesh: Mesh | None = None, attn_mesh: Mesh | None = None
                  ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """One pass over ``T`` tokens: ``input_ids [T]`` (the token after each position), ``hidden
    [T, h]`` (combined target hidden states or the head's own). Returns the rows the logits read,
    the next hidden states and the updated pools (``[num_blocks, block_size, Hkv, D]`` each)."""
    mc = cfg.layer
    eps = mc.rms_norm_eps
    own = "embed_tokens.weight" in w  # the head's own embedding is replicated, the target's split
    embeds = w["embed_tokens.weight"][input_ids] if own else vocab_parallel_rows(target.embedding, input_ids, mesh)
    embeds = embeds.astype(hidden.dtype)
    p = "layers.0."
    if cfg.method == "eagle3":
        normed = rms_norm(hidden, w[p + "hidden_norm.weight"], eps)
        residual = normed if cfg.norm_before_residual else hidden
        x = jnp.concatenate([rms_norm(embeds, w[p + "input_layernorm.weight"], eps), normed], axis=-1)
    else:  # the first layer's input norm is skipped: fc's output goes in as it is
        x = jnp.concatenate([embeds, hidden], axis=-1) @ w["fc.weight"]
        x = x + w["fc.bias"] if "fc.bias" in w else x
        residual = x
    attn, kv = _attention(mc, w, x, kv, md, attn_fn, attn_mesh)
    residual = residual + attn
    out = residual + _mlp(w, rms_norm(residual, w[p + "post_attention_layernorm.weight"], eps))
    if cfg.method == "eagle3":
        return rms_norm(out, w["norm.weight"], eps), out, kv
    return out, out, kv


def greedy_tokens(cfg: EagleConfig, w: Weights, target: TargetTables, rows: jax.Array,
                  mesh: Mesh | None = None) -> jax.Array:
    """The argmax token of each row of :func:`eagle_forward`'s logit rows, as a target id;
    ``mesh``: the target's, its LM head split on the vocabulary over it."""
    if cfg.method == "eagle3":
        best = jnp.argmax((rows @ w["lm_head.weight"]).astype(jnp.float32), axis=-1).astype(jnp.int32)
        return best + w["d2t"][best] if "d2t" in w else best
    tied = target.lm_head is None
    weight = target.embedding if target.lm_head is None else target.lm_head
    rows = rows.astype(weight.dtype)
    if mesh is None or mesh.size == 1:
        logits = rows @ (weight.T if tied else weight)
    else:  # each device its vocabulary slice, then the logits gathered (as the target's own head)
        logits = jax.lax.with_sharding_constraint(vocab_parallel_logits(rows, weight, tied, mesh),
                                                  NamedSharding(mesh, PartitionSpec()))
    logits = logits[..., : cfg.layer.vocab_size]
    return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


def _attention(mc: ModelConfig, w: Weights, x: jax.Array, kv: tuple[jax.Array, jax.Array], md: AttentionMetadata,
               attn_fn: AttentionFn, mesh: Mesh | None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    p = "layers.0.self_attn."
    proj = {}
    for n in ("q", "k", "v"):
        y = x @ w[f"{p}{n}_proj.weight"]
        proj[n] = y + w[f"{p}{n}_proj.bias"] if f"{p}{n}_proj.bias" in w else y
    t, d = x.shape[0], mc.head_dim
    q = proj["q"].reshape(t, mc.num_attention_heads, d)
    k = proj["k"].reshape(t, mc.num_key_value_heads, d)
    v = proj["v"].reshape(t, mc.num_key_value_heads, d)
    cos, sin = RotaryEmbedding(mc.rope, d)(md.positions)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_pool, v_pool = kv
    out, k_pool, v_pool = paged_attention(q, to_cache_dtype(k, k_pool.dtype), to_cache_dtype(v, v_pool.dtype),
                                          k_pool, v_pool, 0, k_pool.shape[0], md, attn_fn, sm_scale=d ** -0.5,
                                          mesh=mesh)
    return out.reshape(t, -1).astype(x.dtype) @ w[p + "o_proj.weight"], (k_pool, v_pool)


def _mlp(w: Weights, x: jax.Array) -> jax.Array:
    p = "layers.0.mlp."
    return (jax.nn.silu(x @ w[p + "gate_proj.weight"]) * (x @ w[p + "up_proj.weight"])) @ w[p + "down_proj.weight"]
