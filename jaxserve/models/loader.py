"""Load a Hugging Face checkpoint folder into a :class:`LlamaForCausalLM` module.

The module is built abstractly (shapes only, no initialisation), then each of its parameters is
read from the checkpoint: linear weights transposed to ``[in, out]``, q|k|v and gate|up fused into
one ``kernel`` each (one matmul instead of several), cast to the model's dtype, and, for scanned
layers, stacked over the layer axis. Only safetensors are read and no code from the checkpoint is
ever run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.exceptions import ConfigError
from jaxserve.models.config import ModelConfig, normalize_dtype_name
from jaxserve.models.llama import LlamaForCausalLM
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
        raise ConfigError(f"checkpoint does not match its {cfg.architecture} config: " + "; ".join(problems))


ParamPath = tuple[str | int, ...]  # a parameter's path in the module, as nnx.to_flat_state spells it


def load_model(folder: str | Path, dtype: str | None = None,
               scan_layers: bool | None = None) -> LlamaForCausalLM:
    """Read ``config.json`` and the safetensors weights into the model (its config is
    ``model.config``); ``dtype`` ("auto"/None keeps the config's); ``scan_layers`` None picks by
    depth (:func:`jaxserve.models.llama.default_scan_layers`)."""
    cfg = ModelConfig.from_pretrained(folder)
    if dtype not in (None, "auto"):
        cfg = dataclasses.replace(cfg, dtype=normalize_dtype_name(dtype))
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, scan_layers=scan_layers, rngs=nnx.Rngs(0)))
    graphdef, shapes = nnx.split(abstract)
    return nnx.merge(graphdef, read_state(folder, cfg, shapes, scanned=abstract.scan_layers))


def read_state(folder: str | Path, cfg: ModelConfig, shapes: nnx.State, scanned: bool) -> nnx.State:
    """The checkpoint's weights at the paths of ``shapes`` (the model's abstract state), each of
    the shape and dtype found there."""
    files = open_checkpoint_files(folder)
    check_tensors(cfg, {name: f.shape(name) for name, f in files.items()})

    def get(name: str) -> np.ndarray:
        return files[name].get(name)

    top = _top_level_readers(get)
    per_layer = _layer_readers(get)
    prefixes = [f"model.layers.{i}." for i in range(cfg.num_hidden_layers)]

    def read(path: ParamPath) -> np.ndarray:
        if path[0] != "layers":
            return top[path]()
        if scanned:  # ("layers", "stacked", ...)
            # One weight over all layers at a time: the host holds one stack at most.
            return np.stack([per_layer[path[2:]](p) for p in prefixes])
        return per_layer[path[2:]](prefixes[path[1]])  # ("layers", i, ...)

    flat = {}
    for path, var in nnx.to_flat_state(shapes):
        value = jnp.asarray(read(path), dtype=var.dtype)
        if value.shape != var.shape:  # check_tensors vetted the checkpoint: this is a loader bug
            raise RuntimeError(f"{'.'.join(map(str, path))}: read {value.shape}, the model holds {var.shape}")
        flat[path] = value
    return nnx.from_flat_state(flat)


def _top_level_readers(get: Callable[[str], np.ndarray]) -> dict[ParamPath, Callable[[], np.ndarray]]:
    return {
        ("embed_tokens", "embedding"): lambda: get("model.embed_tokens.weight"),
        ("norm", "scale"): lambda: get("model.norm.weight"),
        ("lm_head", "kernel"): lambda: get("lm_head.weight").T,
    }


def _layer_readers(get: Callable[[str], np.ndarray]) -> dict[ParamPath, Callable[[str], np.ndarray]]:
    """A decoder layer parameter's path -> how to read it for the layer whose names start with
    ``p``. Holds every optional parameter; the model's structure says which ones exist."""

    def cat_t(p: str, *names: str) -> np.ndarray:
        return np.concatenate([get(p + n).T for n in names], axis=1)

    def cat(p: str, *names: str) -> np.ndarray:
        return np.concatenate([get(p + n) for n in names])

    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    gate_up = ("mlp.gate_proj", "mlp.up_proj")
    return {
        ("input_layernorm", "scale"): lambda p: get(p + "input_layernorm.weight"),
        ("post_attention_layernorm", "scale"): lambda p: get(p + "post_attention_layernorm.weight"),
        ("self_attn", "qkv_proj", "kernel"): lambda p: cat_t(p, *(n + ".weight" for n in qkv)),
        ("self_attn", "qkv_proj", "bias"): lambda p: cat(p, *(n + ".bias" for n in qkv)),
        ("self_attn", "o_proj", "kernel"): lambda p: get(p + "self_attn.o_proj.weight").T,
        ("self_attn", "o_proj", "bias"): lambda p: get(p + "self_attn.o_proj.bias"),
        ("self_attn", "q_norm", "scale"): lambda p: get(p + "self_attn.q_norm.weight"),
        ("self_attn", "k_norm", "scale"): lambda p: get(p + "self_attn.k_norm.weight"),
        ("mlp", "gate_up_proj", "kernel"): lambda p: cat_t(p, *(n + ".weight" for n in gate_up)),
        ("mlp", "gate_up_proj", "bias"): lambda p: cat(p, *(n + ".bias" for n in gate_up)),
        ("mlp", "down_proj", "kernel"): lambda p: get(p + "mlp.down_proj.weight").T,
        ("mlp", "down_proj", "bias"): lambda p: get(p + "mlp.down_proj.bias"),
    }
