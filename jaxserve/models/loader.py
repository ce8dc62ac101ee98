"""Load a Hugging Face checkpoint folder into a :class:`LlamaForCausalLM` module.

The module is built abstractly (shapes only, no initialisation), then each of its parameters is
read from the checkpoint: linear weights transposed to ``[in, out]``, q|k|v and gate|up fused into
one ``kernel`` each (one matmul instead of several), cast to the model's dtype, and, for scanned
layers, stacked over the layer axis. Only safetensors are read and no code from the checkpoint is
ever run.

Tensor parallel: the parameters follow the model's :class:`.tp_layout.TPLayout` (fused columns in
shard-major order, key/value heads replicated when fewer than the shards, vocabulary padded).
Given a ``place`` function (a parameter's path and shape -> its sharding), each device's block is
read on its own from the memory-mapped files and put on that device
(``jax.make_array_from_callback``): no device and no host buffer ever holds a split tensor whole.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx

from jaxserve.exceptions import ConfigError
from jaxserve.models.config import ModelConfig, normalize_dtype_name
from jaxserve.models.gguf_cache import GGUFCache
from jaxserve.models.gguf_loader import GGUFCheckpoint, GGUFTensor, dequantize, is_gguf
from jaxserve.models.hf_tensors import expected_tensors
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.quantize import QUANTIZATION_METHODS, quantize_columns
from jaxserve.models.safetensors_io import open_checkpoint_files
from jaxserve.models.tp_layout import TPLayout, check_tensor_parallel_size, split_axis

# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
# A parameter's path and shape -> the sharding its array gets (None: the default device, whole).
Placement = Callable[[ParamPath, tuple[int, ...]], "jax.sharding.Sharding | None"]
# Reads shard ``s`` (of the layout's size) of one parameter; a replicated one ignores ``s``.
ShardReader = Callable[[int], np.ndarray]


def load_model(folder: str | Path, dtype: str | None = None, scan_layers: bool | None = None, *,
               tensor_parallel_size: int = 1, place: Placement | None = None,
               quantization: str | None = None) -> LlamaForCausalLM:
    """Read ``config.json`` and the safetensors weights into the model (its config is
    ``model.config``); ``dtype`` ("auto"/None keeps the config's); ``scan_layers`` None picks by
    depth (:func:`jaxserve.models.llama.default_scan_layers`). ``tensor_parallel_size`` fixes the
    layout (checked against the heads before any weight is read); ``place`` puts each
    parameter's shards on their devices. ``quantization`` ("int8", "fp8") quantizes the decoder
    layers' projections as they are read (:mod:`.quantize`), from a checkpoint's floats or a
    ``.gguf`` file's dequantized tensors."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)}, got {quantization!r}")
    if is_gguf(folder):
        return load_gguf_model(folder, dtype, scan_layers, tensor_parallel_size=tensor_parallel_size, place=place,
                               quantization=quantization)
    cfg = _with_dtype(ModelConfig.from_pretrained(folder), dtype)
    abstract, graphdef, shapes = _abstract_model(cfg, scan_layers, tensor_parallel_size, quantization)
    return nnx.merge(graphdef, read_state(folder, cfg, shapes, scanned=abstract.scan_layers,
                                          layout=abstract.layout, place=place, quantization=quantization))


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The config of a checkpoint folder or a ``.gguf`` file, weights unread."""
    if is_gguf(path):
        return ModelConfig.from_dict(GGUFCache(path).config(lambda: GGUFCheckpoint(path).hf_config()))
    return ModelConfig.from_pretrained(path)


# What becomes of one GGUF tensor at load: ``dequantize`` (floats in the serving dtype), or a
# policy that keeps it quantized.
TensorPolicy = Callable[[GGUFTensor, str], np.ndarray]


def load_gguf_model(path: str | Path, dtype: str | None = None, scan_layers: bool | None = None, *,
                    tensor_parallel_size: int = 1, place: Placement | None = None,
                    policy: TensorPolicy = dequantize, quantization: str | None = None) -> LlamaForCausalLM:
    """A ``.gguf`` file into the model: the config from its metadata, then one ``policy`` call per
    tensor (default: dequantized into the serving dtype), read as a checkpoint's tensors are.
    Dequantized tensors, like the config, are kept in the start-up cache (:mod:`.gguf_cache`):
    parsing the file and decoding its blocks happen once per file and dtype."""
    cache = GGUFCache(path)
    opened: list[GGUFCheckpoint] = []

    def checkpoint() -> GGUFCheckpoint:  # parsing the file costs seconds: only on a miss
        if not opened:
            opened.append(GGUFCheckpoint(path))
        return opened[0]

    cfg = _with_dtype(ModelConfig.from_dict(cache.config(lambda: checkpoint().hf_config())), dtype)
    abstract, graphdef, shapes = _abstract_model(cfg, scan_layers, tensor_parallel_size, quantization)
    kept = cache.tensor_shapes(cfg.dtype) if policy is dequantize else None
    check_tensors(cfg, kept if kept is not None else checkpoint().tensor_shapes())  # before any is decoded

    def decode() -> dict[str, np.ndarray]:
        return {t.name: policy(t, cfg.dtype) for t in checkpoint().tensors()}

    weights = cache.tensors(cfg.dtype, decode) if policy is dequantize else decode()
    state = state_from_tensors(weights.__getitem__, cfg, shapes, scanned=abstract.scan_layers,
                               layout=abstract.layout, place=place, quantization=quantization)
    return nnx.merge(graphdef, state)


def _with_dtype(cfg: ModelConfig, dtype: str | None) -> ModelConfig:
    if dtype in (None, "auto"):
        return cfg
    return dataclasses.replace(cfg, dtype=normalize_dtype_name(dtype))


def _abstract_model(cfg: ModelConfig, scan_layers: bool | None, tensor_parallel_size: int,
                    quantization: str | None = None):
    """The module built from shapes only (no initialisation), its graph and abstract state."""
    check_tensor_parallel_size(cfg, tensor_parallel_size)
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, scan_layers=scan_layers,
                                                       tensor_parallel_size=tensor_parallel_size,
                                                       quantization=quantization, rngs=nnx.Rngs(0)))
    graphdef, shapes = nnx.split(abstract)
    return abstract, graphdef, shapes


def read_state(folder: str | Path, cfg: ModelConfig, shapes: nnx.State, scanned: bool,
               layout: TPLayout | None = None, place: Placement | None = None,
               quantization: str | None = None) -> nnx.State:
    """The checkpoint's weights at the paths of ``shapes`` (the model's abstract state), each of
    the shape and dtype found there, in ``layout`` (default: one shard), placed by ``place``;
    the projections quantized with ``quantization`` when it is given."""
    files = open_checkpoint_files(folder)
    check_tensors(cfg, {name: f.shape(name) for name, f in files.items()})
    return state_from_tensors(lambda name: files[name].get(name), cfg, shapes, scanned, layout, place,
                              quantization)


def state_from_tensors(get: Callable[[str], np.ndarray], cfg: ModelConfig, shapes: nnx.State, scanned: bool,
                       layout: TPLayout | None = None, place: Placement | None = None,
                       quantization: str | None = None) -> nnx.State:
    """The model's state from ``get`` (an HF tensor name -> its ``[out, in]`` array), vetted by
    :func:`check_tensors`: fused, transposed, stacked and sharded as ``read_state`` says, the
    projections quantized with ``quantization`` when it is given."""
    layout = layout or TPLayout.of(cfg, 1)
    top = _top_level_readers(get, layout)
    per_layer = _layer_readers(get, layout)
    if quantization is not None:
        per_layer = _quantized_readers(per_layer, layout, quantization)
    prefixes = [f"model.layers.{i}." for i in range(cfg.num_hidden_layers)]

    def reader(path: ParamPath) -> ShardReader:
        if path[0] != "layers":
            return top[path]
        read = per_layer[path[2:]]
        if scanned:  # ("layers", "stacked", ...): one weight over all layers at a time
            return lambda s: np.stack([read(p, s) for p in prefixes])
        return lambda s: read(prefixes[path[1]], s)  # ("layers", i, ...)

    flat = {}
    for path, var in nnx.to_flat_state(shapes):
        sharding = place(path, var.shape) if place is not None else None
        flat[path] = _build_array(path, var, reader(path), layout.size, sharding)
    return nnx.from_flat_state(flat)


def _build_array(path: ParamPath, var, read: ShardReader, num_shards: int, sharding) -> jax.Array:
    """One parameter as a jax array: whole on the default device (no ``sharding``), or each
    device's block read and put there on its own."""
    name = ".".join(map(str, path))
    axis = split_axis(path)
    if axis is not None and "stacked" in path:  # a scanned stack's leading layer axis
        axis += 1

    def block(shard: int) -> np.ndarray:
        return np.asarray(read(shard)).astype(var.dtype, copy=False)

    def whole() -> np.ndarray:
        if axis is None:
            return block(0)
        return np.concatenate([block(s) for s in range(num_shards)], axis=axis)

    if sharding is None:
        value = jax.numpy.asarray(whole())
        if value.shape != var.shape:  # check_tensors vetted the checkpoint: this is a loader bug
            raise RuntimeError(f"{name}: read {value.shape}, the model holds {var.shape}")
        return value

    def device_block(index: tuple[slice, ...]) -> np.ndarray:
        if axis is None:
            data = block(0)
        else:
            per_shard = var.shape[axis] // num_shards
            start = index[axis].start or 0
            stop = var.shape[axis] if index[axis].stop is None else index[axis].stop
            data = np.concatenate([block(s) for s in range(start // per_shard, stop // per_shard)], axis=axis)
        if data.shape != sharding.shard_shape(var.shape):
            raise RuntimeError(f"{name}: read a block of {data.shape}, the sharding wants "
                               f"{sharding.shard_shape(var.shape)}")
        return data

    return jax.make_array_from_callback(var.shape, sharding, device_block)


def _vocab_rows(get: Callable[[str], np.ndarray], name: str, layout: TPLayout, shard: int) -> np.ndarray:
    """Shard ``shard``'s rows of a ``[vocab, hidden]`` tensor, zero rows past the vocabulary."""
    per = layout.padded_vocab // layout.size
    rows = get(name)[shard * per : (shard + 1) * per]
    if rows.shape[0] == per:
        return rows
    return np.concatenate([rows, np.zeros((per - rows.shape[0], rows.shape[1]), rows.dtype)])


def _top_level_readers(get: Callable[[str], np.ndarray], layout: TPLayout) -> dict[ParamPath, ShardReader]:
    return {
        ("embed_tokens", "embedding"): lambda s: _vocab_rows(get, "model.embed_tokens.weight", layout, s),
        ("norm", "scale"): lambda s: get("model.norm.weight"),
        ("lm_head", "kernel"): lambda s: _vocab_rows(get, "lm_head.weight", layout, s).T,
    }


def _layer_readers(get: Callable[[str], np.ndarray],
                   layout: TPLayout) -> dict[ParamPath, Callable[[str, int], np.ndarray]]:
    """A decoder layer parameter's path -> how to read shard ``s`` of it for the layer whose names
    start with ``p``. Holds every optional parameter; the model's structure says which ones exist.
    Every read slices the memory-mapped tensor first, so only the shard's bytes are copied."""
    d, n = layout.head_dim, layout.size

    def rows(p: str, name: str, s: int) -> np.ndarray:
        """Shard ``s`` of the output rows of ``[out, ...]`` tensor (an HF weight or bias)."""
        full = get(p + name)
        per = full.shape[0] // n
        return full[s * per : (s + 1) * per]

    def kv_rows(p: str, name: str, s: int) -> np.ndarray:
        """The rows of the key/value heads shard ``s`` stores (heads repeat when replicated)."""
        full = get(p + name)
        return np.concatenate([full[h * d : (h + 1) * d] for h in layout.kv_heads_of_shard(s)])

    def qkv(p: str, kind: str, s: int) -> np.ndarray:
        parts = [rows(p, f"self_attn.q_proj.{kind}", s), kv_rows(p, f"self_attn.k_proj.{kind}", s),
                 kv_rows(p, f"self_attn.v_proj.{kind}", s)]
        return np.concatenate(parts)

    def gate_up(p: str, kind: str, s: int) -> np.ndarray:
        return np.concatenate([rows(p, f"mlp.gate_proj.{kind}", s), rows(p, f"mlp.up_proj.{kind}", s)])

    def in_cols(p: str, name: str, s: int) -> np.ndarray:
        """Shard ``s`` of the input columns of an HF ``[out, in]`` weight, as ``[in / n, out]``."""
        full = get(p + name)
        per = full.shape[1] // n
        return full[:, s * per : (s + 1) * per].T

    return {
        ("input_layernorm", "scale"): lambda p, s: get(p + "input_layernorm.weight"),
        ("post_attention_layernorm", "scale"): lambda p, s: get(p + "post_attention_layernorm.weight"),
        ("self_attn", "qkv_proj", "kernel"): lambda p, s: qkv(p, "weight", s).T,
        ("self_attn", "qkv_proj", "bias"): lambda p, s: qkv(p, "bias", s),
        ("self_attn", "o_proj", "kernel"): lambda p, s: in_cols(p, "self_attn.o_proj.weight", s),
        ("self_attn", "o_proj", "bias"): lambda p, s: get(p + "self_attn.o_proj.bias"),
        ("self_attn", "q_norm", "scale"): lambda p, s: get(p + "self_attn.q_norm.weight"),
        ("self_attn", "k_norm", "scale"): lambda p, s: get(p + "self_attn.k_norm.weight"),
        ("mlp", "gate_up_proj", "kernel"): lambda p, s: gate_up(p, "weight", s).T,
        ("mlp", "gate_up_proj", "bias"): lambda p, s: gate_up(p, "bias", s),
        ("mlp", "down_proj", "kernel"): lambda p, s: in_cols(p, "mlp.down_proj.weight", s),
        ("mlp", "down_proj", "bias"): lambda p, s: get(p + "mlp.down_proj.bias"),
    }


# The decoder layer's projections that --quantization quantizes (the embedding and LM head stay float).
QUANTIZED_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                         ("mlp", "down_proj"))


def _shard_of(array: np.ndarray, axis: int | None, shard: int, num_shards: int) -> np.ndarray:
    if axis is None:
        return array
    per = array.shape[axis] // num_shards
    return np.take(array, np.arange(shard * per, (shard + 1) * per), axis=axis)


def _quantized_readers(per_layer: dict[ParamPath, Callable[[str, int], np.ndarray]], layout: TPLayout,
                       method: str) -> dict[ParamPath, Callable[[str, int], np.ndarray]]:
    """``per_layer`` with each projection's ``kernel`` quantized and its ``kernel_scale`` beside it.

    A column's scale needs the whole column, which a row-split weight (o, down) spreads over the
    shards: the whole float kernel is read and quantized, then cut into the layout's blocks, so
    every shard holds the same scales a single device would. The last two quantized kernels are
    kept (kernel and scale are read one after the other)."""
    readers = dict(per_layer)
    n = layout.size
    for module in QUANTIZED_PROJECTIONS:
        read = per_layer[(*module, "kernel")]
        axis = split_axis((*module, "kernel"))

        @functools.lru_cache(maxsize=2)
        def whole(p: str, read=read, axis=axis) -> tuple[np.ndarray, np.ndarray]:
            full = read(p, 0) if axis is None else np.concatenate([read(p, s) for s in range(n)], axis=axis)
            return quantize_columns(full, method)

        readers[(*module, "kernel")] = lambda p, s, whole=whole, axis=axis: _shard_of(whole(p)[0], axis, s, n)
        # The scale follows the output columns: split with a column-split kernel, else replicated.
        readers[(*module, "kernel_scale")] = (
            lambda p, s, whole=whole, axis=axis: _shard_of(whole(p)[1], 0 if axis == 1 else None, s, n))
    return readers
