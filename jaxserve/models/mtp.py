"""Multi-token prediction (vLLM's speculative method ``mtp``, its ``mimo_mtp.py``): a target that
ships its own draft layers, read from the target's checkpoint and run as an EAGLE-1-like head
(:mod:`jaxserve.models.eagle`'s proposer, the target's embedding and LM head, KV in the target's
blocks).

MiMo's layout (``MiMoForCausalLM``: a Qwen2 decoder plus ``num_nextn_predict_layers`` layers named
``model.mtp_layers.{i}.*``). At position ``p``, reading the target's hidden state ``hidden`` at
``p`` (after its final norm) and the token at ``p + 1``::

    e = embed(token), zero at position 0
    x = input_proj(concat(hidden_layernorm(hidden), token_layernorm(e)))   # input_proj [h, 2h], no bias
    y = final_layernorm(decoder_layer(x))                                  # a Qwen2 layer, input norm included

``y`` is both the next hidden state and the input of the target's LM head. As vLLM's MiMo MTP,
every draft step runs the first layer (MiMo-7B ships one); the others are checked by name and
shape, not read. DeepSeek-V3's layout (``model.layers.{L + i}.{enorm,hnorm,eh_proj,shared_head}``)
is not read: jaxserve serves no DeepSeek target.

Tensor parallel: as an EAGLE head (the weights under the same names, so the same plan places them):
``mesh`` is the target's, its embedding read vocabulary-parallel in place; ``attn_mesh`` is given
when the decoder layer is split as a target layer (q/k/v and gate/up by output columns, o and down
by input rows, the pool on its key/value heads), None when it is replicated. ``input_proj`` and
the four norms stay replicated: the two hidden states they read are whole on every device.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.exceptions import ConfigError
from jaxserve.layers.attention import AttentionFn, AttentionMetadata
from jaxserve.layers.embedding import vocab_parallel_rows
from jaxserve.layers.norm import rms_norm
from jaxserve.models.config import ModelConfig
from jaxserve.models.eagle import EagleConfig, TargetTables, Weights, _attention, _mlp
from jaxserve.models.safetensors_io import open_checkpoint_files

MTP_PREFIX = "model.mtp_layers."
MTP_ARCHITECTURES = ("MiMoForCausalLM",)
_OWN_TENSORS = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")  # not a decoder layer's


def _err(folder: Path, what: str) -> ConfigError:
    return ConfigError(f"speculative_config.method=mtp ({folder}): {what}")


def mtp_layer_shapes(layer: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """One MTP layer's tensors (names after ``model.mtp_layers.{i}.``) -> shape: the required ones
    and the optional q/k/v biases (required too when the target's layers have them)."""
    h, m = layer.hidden_size, layer.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_layernorm.weight": (h,), "hidden_layernorm.weight": (h,), "input_proj.weight": (h, 2 * h),
        "final_layernorm.weight": (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (layer.q_size, h), "self_attn.k_proj.weight": (layer.kv_size, h),
        "self_attn.v_proj.weight": (layer.kv_size, h), "self_attn.o_proj.weight": (h, layer.q_size),
        "mlp.gate_proj.weight": (m, h), "mlp.up_proj.weight": (m, h), "mlp.down_proj.weight": (h, m),
    }
    biases: dict[str, tuple[int, ...]] = {f"self_attn.{p}_proj.bias": (layer.q_size if p == "q" else layer.kv_size,)
                                          for p in "qkv"}
    if layer.attention_bias:
        return {**shapes, **biases}, {}
    return shapes, biases


def mtp_head_config(target: ModelConfig) -> EagleConfig:
    """The head an MTP layer of ``target`` is: one decoder layer of the target's shape."""
    return EagleConfig("mtp", dataclasses.replace(target, num_hidden_layers=1, layer_types=None), (),
                       target.vocab_size)


def served_mtp_key(key: str) -> str:
    """Where an MTP tensor (its name after ``model.mtp_layers.{i}.``) is served: under the EAGLE
    head's name where the layer is the same (``layers.0.*``), its own name otherwise."""
    return key if key.split(".")[0] in _OWN_TENSORS else "layers.0." + key


def load_mtp_head(folder: str | Path, target: ModelConfig, dtype: jnp.dtype) -> tuple[EagleConfig, Weights]:
    """The first MTP layer of the target checkpoint in ``folder`` (its config.json names
    ``num_nextn_predict_layers``), every layer's tensors checked by name and shape first. Weights
    under the EAGLE head's names where the layer is the same (``layers.0.*``), projections ``[in, out]``."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise _err(folder, "the target is not a checkpoint folder; its MTP layers are read from its safetensors")
    raw = json.loads((folder / "config.json").read_text())
    archs = raw.get("architectures") or []
    if not any(a in MTP_ARCHITECTURES for a in archs):
        raise _err(folder, f"the target's architectures {archs} have no multi-token-prediction layers jaxserve "
                           f"reads (it reads {', '.join(MTP_ARCHITECTURES)}'s model.mtp_layers.*)")
    n = raw.get("num_nextn_predict_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise _err(folder, f"config.json: num_nextn_predict_layers must be an integer >= 1, got {n!r}")
    cfg = mtp_head_config(target)
    required, optional = mtp_layer_shapes(cfg.layer)
    files = open_checkpoint_files(folder)
    present = {name for name in files if name.startswith(MTP_PREFIX)}
    known = {f"{MTP_PREFIX}{i}.{k}" for i in range(n) for k in (*required, *optional)}
    unexpected = sorted(present - known)
    if unexpected:
        raise _err(folder, f"unexpected tensor(s) {', '.join(unexpected[:5])} (an MTP layer of "
                           f"num_nextn_predict_layers={n} has {', '.join(sorted(required))})")
    for i in range(n):
        if not any(name.startswith(f"{MTP_PREFIX}{i}.") for name in present):
            raise _err(folder, f"no MTP layer {MTP_PREFIX}{i} (config.json: num_nextn_predict_layers={n})")
        for key, shape in [*required.items(), *optional.items()]:
            name = f"{MTP_PREFIX}{i}.{key}"
            if name not in present:
                if key in required:
                    raise _err(folder, f"no tensor {name}")
                continue
            got = tuple(files[name].shape(name))
            if got != shape:
                raise _err(folder, f"{name} has shape {list(got)}, expected {list(shape)}")
    weights: Weights = {}
    for key in (*required, *optional):
        name = f"{MTP_PREFIX}0.{key}"
        if name not in present:
            continue
        a = jnp.asarray(np.asarray(files[name].get(name), np.float32), dtype)
        weights[served_mtp_key(key)] = a.T if a.ndim == 2 else a  # [out, in] -> [in, out]
    return cfg, weights


def mtp_forward(cfg: EagleConfig, w: Weights, target: TargetTables, input_ids: jax.Array, hidden: jax.Array,
                kv: tuple[jax.Array, jax.Array], md: AttentionMetadata, attn_fn: AttentionFn,
                mesh: Mesh | None = None, attn_mesh: Mesh | None = None
                ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """:func:`jaxserve.models.eagle.eagle_forward`'s contract for an MTP layer: ``input_ids [T]``
    (the token after each position), ``hidden [T, h]`` (the target's after its final norm, or the
    layer's own); returns the logit rows, the next hidden states (the same array) and the pools.
    ``mesh`` / ``attn_mesh``: as :func:`jaxserve.models.eagle.eagle_forward`'s."""
    eps = cfg.layer.rms_norm_eps
    embeds = vocab_parallel_rows(target.embedding, input_ids, mesh).astype(hidden.dtype)
    # MiMo's MTP was trained with no token at the sequence's first position.
    embeds = jnp.where((md.positions == 0)[:, None], jnp.zeros_like(embeds), embeds)
    x = jnp.concatenate([rms_norm(hidden, w["hidden_layernorm.weight"], eps),
                         rms_norm(embeds, w["token_layernorm.weight"], eps)], axis=-1) @ w["input_proj.weight"]
    p = "layers.0."
    attn, kv = _attention(cfg.layer, w, rms_norm(x, w[p + "input_layernorm.weight"], eps), kv, md, attn_fn, attn_mesh)
    residual = x + attn
    out = residual + _mlp(w, rms_norm(residual, w[p + "post_attention_layernorm.weight"], eps))
    out = rms_norm(out, w["final_layernorm.weight"], eps)
    return out, out, kv
