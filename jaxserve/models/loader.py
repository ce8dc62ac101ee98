"""Load a Hugging Face checkpoint folder into jaxserve's stacked, fused weight layout.

Layout (``L`` layers, weights stored ``[in, out]``): ``embed [V, H]``, ``final_norm [H]``,
``lm_head [H, V]`` when untied, and ``layers`` with a leading ``L`` axis: ``input_norm``,
``post_norm``, ``qkv`` (q|k|v fused: one matmul instead of three), ``o``, ``gate_up`` (gate|up
fused), ``down``, plus ``q_norm``/``k_norm`` (Qwen3) and biases where the config has them.
Unscanned (``scan_layers=False``), ``layers`` is instead a list of ``L`` dicts of the same names,
each without the leading axis. Only safetensors are read and no code from the checkpoint is ever run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import ModelConfig, normalize_dtype_name
from jaxserve.models.llama import LlamaModel, Params, default_scan_layers
from jaxserve.models.safetensors_io import open_checkpoint_files

# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the checkpoint must hold, with its shape."""
    h, q, kv, inter, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    names = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if cfg.attention_bias:
            names.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                          p + "self_attn.v_proj.bias": (kv,)})
        if cfg.o_proj_bias:
            names[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            names.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                          p + "mlp.down_proj.bias": (h,)})
        if cfg.qk_norm:
            names.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return names


def check_tensors(cfg: ModelConfig, available: dict[str, tuple[int, ...]]) -> None:
    """Raise a ValueError naming missing, unexpected and mis-shaped tensors."""
    expected = expected_tensors(cfg)
    missing = sorted(set(expected) - set(available))
    unexpected = sorted(
        n for n in set(available) - set(expected)
        if not n.endswith(_IGNORED_SUFFIXES) and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:20])}" + (" ..." if len(unexpected) > 20 else ""))
    for name in sorted(set(expected) & set(available)):
        if tuple(available[name]) != expected[name]:
            problems.append(f"shape mismatch for {name}: checkpoint has {tuple(available[name])}, "
                            f"config implies {expected[name]}")
    if problems:
        raise ValueError(f"checkpoint does not match its {cfg.architecture} config: " + "; ".join(problems))


def load_params(folder: str | Path, cfg: ModelConfig, scan_layers: bool = True) -> Params:
    """The checkpoint's weights in jaxserve's layout; ``layers`` stacked (for ``lax.scan``) or,
    with ``scan_layers=False``, a list of per-layer dicts (see :meth:`LlamaModel.forward`)."""
    files = open_checkpoint_files(folder)
    check_tensors(cfg, {name: f.shape(name) for name, f in files.items()})
    dtype = jnp.dtype(cfg.dtype)

    def get(name: str) -> np.ndarray:
        return files[name].get(name)

    def cat_t(p: str, *names: str) -> np.ndarray:
        return np.concatenate([get(p + n).T for n in names], axis=1)

    def cat(p: str, *names: str) -> np.ndarray:
        return np.concatenate([get(p + n) for n in names])

    # name -> how to read it for the layer with prefix p
    spec = {
        "input_norm": lambda p: get(p + "input_layernorm.weight"),
        "post_norm": lambda p: get(p + "post_attention_layernorm.weight"),
        "qkv": lambda p: cat_t(p, "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "o": lambda p: get(p + "self_attn.o_proj.weight").T,
        "gate_up": lambda p: cat_t(p, "mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "down": lambda p: get(p + "mlp.down_proj.weight").T,
    }
    if cfg.attention_bias:
        spec["qkv_bias"] = lambda p: cat(p, "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
    if cfg.o_proj_bias:
        spec["o_bias"] = lambda p: get(p + "self_attn.o_proj.bias")
    if cfg.mlp_bias:
        spec["gate_up_bias"] = lambda p: cat(p, "mlp.gate_proj.bias", "mlp.up_proj.bias")
        spec["down_bias"] = lambda p: get(p + "mlp.down_proj.bias")
    if cfg.qk_norm:
        spec["q_norm"] = lambda p: get(p + "self_attn.q_norm.weight")
        spec["k_norm"] = lambda p: get(p + "self_attn.k_norm.weight")

    prefixes = [f"model.layers.{i}." for i in range(cfg.num_hidden_layers)]
    layers: Any
    if scan_layers:  # one weight at a time over all layers: host memory holds one stack at most
        layers = {k: jnp.asarray(np.stack([read(p) for p in prefixes]), dtype=dtype) for k, read in spec.items()}
    else:
        layers = [{k: jnp.asarray(read(p), dtype=dtype) for k, read in spec.items()} for p in prefixes]
    params: Params = {
        "embed": jnp.asarray(get("model.embed_tokens.weight"), dtype=dtype),
        "final_norm": jnp.asarray(get("model.norm.weight"), dtype=dtype),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(get("lm_head.weight").T, dtype=dtype)
    return params


def load_model(folder: str | Path, dtype: str | None = None,
               scan_layers: bool | None = None) -> tuple[LlamaModel, Params]:
    """Read ``config.json`` and the safetensors weights; ``dtype`` ("auto"/None keeps the config's);
    ``scan_layers`` None picks by depth (:func:`default_scan_layers`)."""
    cfg = ModelConfig.from_pretrained(folder)
    if dtype not in (None, "auto"):
        cfg = dataclasses.replace(cfg, dtype=normalize_dtype_name(dtype))
    if scan_layers is None:
        scan_layers = default_scan_layers(cfg.num_hidden_layers)
    return LlamaModel(cfg), load_params(folder, cfg, scan_layers)
