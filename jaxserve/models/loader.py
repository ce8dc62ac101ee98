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
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, cast

import jax
import numpy as np
from flax import nnx

from jaxserve.exceptions import ConfigError
from jaxserve.layers.block_quant_linear import GGUF_PREFIX, block_format_of, embedding_block_format_of
from jaxserve.models.compressed_tensors import (
    COMPRESSED_TENSORS,
    CompressedTensorsScheme,
    checkpoint_scheme,
    column_scales,
    stored_getter,
)
from jaxserve.models.config import QUANTIZATION_METHODS, ModelConfig, normalize_dtype_name
from jaxserve.models.gguf_cache import GGUFCache
from jaxserve.models.gguf_loader import GGUFCheckpoint, GGUFTensor, dequantize, is_gguf
from jaxserve.models.hf_tensors import expected_tensors, moe_names
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.mtp import MTP_PREFIX
from jaxserve.models.quantize import quantize_columns
from jaxserve.models.safetensors_io import open_checkpoint_files
from jaxserve.models.tp_layout import TPLayout, check_tensor_parallel_size, split_axis
from pallas_kernels.block_quant_matmul import BLOCK, BLOCK_FORMATS, split_gguf_blocks

# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Multi-token-prediction layers (MiMo's): read by speculative decoding's method mtp, not by the decoder.
_IGNORED_PREFIXES = (MTP_PREFIX,)


def check_tensors(cfg: ModelConfig, available: dict[str, tuple[int, ...]]) -> None:
    """Raise a ValueError naming missing, unexpected and mis-shaped tensors."""
    expected = expected_tensors(cfg)
    missing = sorted(set(expected) - set(available))
    unexpected = sorted(
        n for n in set(available) - set(expected)
        if not n.endswith(_IGNORED_SUFFIXES) and not n.startswith(_IGNORED_PREFIXES)
        and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
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
    ``.gguf`` file's dequantized tensors. A checkpoint whose ``config.json`` declares a
    compressed-tensors ``quantization_config`` is loaded as stored, int8 or fp8
    (:mod:`.compressed_tensors`), with ``quantization`` None or "compressed-tensors"."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)}, got {quantization!r}")
    if quantization == "gguf" and not is_gguf(folder):
        raise ConfigError(f"quantization gguf keeps a .gguf file's quant blocks; model {folder} is not a .gguf file")
    if is_gguf(folder):
        return load_gguf_model(folder, dtype, scan_layers, tensor_parallel_size=tensor_parallel_size, place=place,
                               quantization=quantization)
    cfg = _with_dtype(ModelConfig.from_pretrained(folder), dtype)
    scheme = checkpoint_scheme(folder)
    if scheme is not None:
        if quantization not in (None, COMPRESSED_TENSORS):
            raise ConfigError(f"quantization: {folder} is pre-quantized ({COMPRESSED_TENSORS}, {scheme.method}); "
                              f"leave quantization unset or {COMPRESSED_TENSORS!r}, got {quantization!r}")
        quantization = scheme.method
    elif quantization == COMPRESSED_TENSORS:
        raise ConfigError(f"quantization {COMPRESSED_TENSORS}: {folder}'s config.json has no quantization_config")
    abstract, graphdef, shapes = _abstract_model(cfg, scan_layers, tensor_parallel_size, quantization)
    return nnx.merge(graphdef, read_state(folder, cfg, shapes, scanned=abstract.scan_layers,
                                          layout=abstract.layout, place=place, quantization=quantization,
                                          scheme=scheme))


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
    if quantization == "gguf":
        return _load_gguf_blocks(path, dtype, scan_layers, tensor_parallel_size, place, policy)
    cache = GGUFCache(path)
    checkpoint = _lazy_checkpoint(path)

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


# The HF projections whose GGUF blocks --quantization gguf keeps, and the arrays each becomes.
GGUF_BLOCK_PROJECTIONS = tuple(f"{name}.weight" for name in (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
BLOCK_PARTS = ("qs", "d", "m")  # "m" only for a format with minimums (Q4_1): the model holds none else


def _projection_block_format(tensor_types: dict[str, str], file_name: str) -> str:
    """The one GGUF block format every decoder projection of the file is stored in, or a
    ConfigError saying why its blocks cannot be kept."""
    types = {qtype for name, qtype in tensor_types.items() if name.endswith(GGUF_BLOCK_PROJECTIONS)}
    if len(types) != 1 or not types <= set(BLOCK_FORMATS):
        raise ConfigError(f"quantization gguf keeps {', '.join(BLOCK_FORMATS)} blocks, one format for every "
                          f"projection; {file_name} stores them as {', '.join(sorted(types))}: "
                          "serve it dequantized (no --quantization)")
    return types.pop()


def _check_block_split(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """A ConfigError naming the row-split projection whose input a ``tensor_parallel_size`` split
    would cut inside a 32-wide block (each shard must hold whole blocks)."""
    for name, width in (("self_attn.o_proj", cfg.num_attention_heads * cfg.head_dim),
                        ("mlp.down_proj", cfg.intermediate_size)):
        per = width // tensor_parallel_size
        if per % BLOCK:
            raise ConfigError(f"quantization gguf with tensor_parallel_size {tensor_parallel_size}: {name} splits "
                              f"its {width} inputs into {per} a device, not a whole number of {BLOCK}-wide blocks; "
                              "use a smaller tensor_parallel_size or serve the file dequantized (no --quantization)")


def _block_readers(get: Callable[[str], np.ndarray],
                   layout: TPLayout) -> dict[ParamPath, Callable[[str, int], np.ndarray]]:
    """The projections' quant blocks (``qs``, ``d``, ``m``, each ``[out, ...]``), split as the float
    kernels are: q|k|v and gate|up by output rows, fused shard-major (the float kernels' columns);
    o and down by input in whole blocks (``_check_block_split`` vetted the widths)."""
    fused = _fused_row_readers(get, layout)
    n = layout.size

    def in_blocks(p: str, name: str, s: int) -> np.ndarray:
        full = get(p + name)
        per = full.shape[1] // n
        return full[:, s * per : (s + 1) * per]

    readers: dict[ParamPath, Callable[[str, int], np.ndarray]] = {}
    for part in BLOCK_PARTS:
        kind = f"weight.{part}"
        readers[("self_attn", "qkv_proj", part)] = functools.partial(fused.qkv, kind=kind)
        readers[("mlp", "gate_up_proj", part)] = functools.partial(fused.gate_up, kind=kind)
        for module in ("self_attn.o_proj", "mlp.down_proj"):
            path = (*module.split("."), part)
            readers[path] = functools.partial(_by_name, in_blocks, f"{module}.{kind}")
    return readers


def _by_name(read: Callable[[str, str, int], np.ndarray], name: str, p: str, s: int) -> np.ndarray:
    return read(p, name, s)


def _embedding_block_reader(get: Callable[[str], np.ndarray], part: str, layout: TPLayout) -> ShardReader:
    return lambda s: _vocab_rows(get, f"model.embed_tokens.weight.{part}", layout, s)


def _load_gguf_blocks(path: str | Path, dtype: str | None, scan_layers: bool | None, tensor_parallel_size: int,
                      place: Placement | None, policy: TensorPolicy) -> LlamaForCausalLM:
    """``--quantization gguf``: the projections (and a tied embedding in a block format) kept in the
    file's blocks, the other tensors through ``policy``. With the default policy, the config, the
    tensor table and the arrays are kept in the start-up cache (:mod:`.gguf_cache`) like a
    dequantized load's, so a second start never parses the file."""
    cache = GGUFCache(path)
    checkpoint = _lazy_checkpoint(path)

    cfg = _with_dtype(ModelConfig.from_dict(cache.config(lambda: checkpoint().hf_config())), dtype)
    table = cache.metadata(lambda: {"types": checkpoint().tensor_types(),
                                    "shapes": {n: list(s) for n, s in checkpoint().tensor_shapes().items()}})
    quantization = GGUF_PREFIX + _projection_block_format(table["types"], Path(path).name)
    embed_format = table["types"].get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and embed_format in BLOCK_FORMATS:  # the tied head reads it every step
        quantization += ":" + embed_format
    abstract, graphdef, shapes = _abstract_model(cfg, scan_layers, tensor_parallel_size, quantization)
    _check_block_split(cfg, tensor_parallel_size)
    check_tensors(cfg, {n: tuple(s) for n, s in table["shapes"].items()})  # before any tensor is decoded

    def decode() -> dict[str, np.ndarray]:
        weights: dict[str, np.ndarray] = {}
        for t in checkpoint().tensors():
            if t.name.endswith(GGUF_BLOCK_PROJECTIONS) or (
                    t.name == "model.embed_tokens.weight" and embedding_block_format_of(quantization)):
                weights.update({f"{t.name}.{part}": v for part, v in split_gguf_blocks(t.data, t.qtype).items()})
            else:
                weights[t.name] = policy(t, cfg.dtype)
        return weights

    weights = cache.arrays(f"blocks-{cfg.dtype}", decode) if policy is dequantize else decode()
    state = state_from_tensors(weights.__getitem__, cfg, shapes, scanned=abstract.scan_layers,
                               layout=abstract.layout, place=place, quantization=quantization)
    return nnx.merge(graphdef, state)


def _lazy_checkpoint(path: str | Path) -> Callable[[], GGUFCheckpoint]:
    """The file's parsed checkpoint, parsed on the first call only (it costs seconds: a start-up
    cache hit never needs it)."""
    return functools.cache(lambda: GGUFCheckpoint(path))


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
               quantization: str | None = None, scheme: CompressedTensorsScheme | None = None) -> nnx.State:
    """The checkpoint's weights at the paths of ``shapes`` (the model's abstract state), each of
    the shape and dtype found there, in ``layout`` (default: one shard), placed by ``place``;
    the projections quantized with ``quantization`` when it is given, or read as stored with
    their scales for a pre-quantized ``scheme``."""
    files = open_checkpoint_files(folder)
    shapes_in_files = {name: f.shape(name) for name, f in files.items()}
    if scheme is not None:  # every projection weight has its scale; nothing else is extra
        weights = [n for n in expected_tensors(cfg) if n.startswith("model.layers.") and n.endswith("_proj.weight")]
        missing = [n + "_scale" for n in weights if n + "_scale" not in shapes_in_files]
        if missing:
            raise ConfigError(f"pre-quantized checkpoint lacks scales: {', '.join(missing[:10])}")
        for n in weights:
            shapes_in_files.pop(n + "_scale")
    check_tensors(cfg, shapes_in_files)
    get: Callable[[str], np.ndarray] = lambda name: files[name].get(name)  # noqa: E731
    if scheme is not None:
        get = stored_getter(get, scheme)
    return state_from_tensors(get, cfg, shapes, scanned, layout, place, quantization,
                              prequantized=scheme is not None)


def state_from_tensors(get: Callable[[str], np.ndarray], cfg: ModelConfig, shapes: nnx.State, scanned: bool,
                       layout: TPLayout | None = None, place: Placement | None = None,
                       quantization: str | None = None, prequantized: bool = False) -> nnx.State:
    """The model's state from ``get`` (an HF tensor name -> its ``[out, in]`` array), vetted by
    :func:`check_tensors`: fused, transposed, stacked and sharded as ``read_state`` says, the
    projections quantized with ``quantization`` when it is given."""
    layout = layout or TPLayout.of(cfg, 1)
    top = _top_level_readers(get, layout)
    per_layer = _layer_readers(get, layout)
    if quantization is not None and block_format_of(quantization) is not None:
        per_layer.update(_block_readers(get, layout))
        top.update({("embed_tokens", "head", part): _embedding_block_reader(get, part, layout)
                    for part in BLOCK_PARTS})
    elif prequantized:
        per_layer = _prequantized_readers(get, layout)
    elif quantization is not None:
        per_layer = _quantized_readers(per_layer, layout, quantization)
    if cfg.clamped_swiglu is not None:
        per_layer.update(_gpt_oss_moe_readers(get, cfg, layout))
    elif cfg.is_moe:  # the experts stay float under every --quantization
        per_layer.update(_moe_readers(get, cfg, layout))
    prefixes = [f"model.layers.{i}." for i in range(cfg.num_hidden_layers)]

    def reader(path: ParamPath) -> ShardReader:
        if path[0] != "layers":
            return top[path]
        read = per_layer[path[2:]]
        if scanned:  # ("layers", "stacked", ...): one weight over all layers at a time
            return lambda s: np.stack([read(p, s) for p in prefixes])
        layer = path[1]
        assert isinstance(layer, int)
        return lambda s: read(prefixes[layer], s)  # ("layers", i, ...)

    flat: dict = {}
    for key, var in nnx.to_flat_state(shapes):
        path = cast(ParamPath, key)  # nnx's keys are the names and indices of the module tree
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

    def device_block(index: tuple[slice, ...] | None) -> np.ndarray:
        if axis is None:
            data = block(0)
        else:
            assert index is not None  # jax passes the block's slices for a sharded array
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


class _FusedRows(NamedTuple):
    """Shard ``s`` of the fused projections' rows, for the layer whose names start with ``p``:
    ``qkv(p, s, kind=...)`` is ``[q_s | k_s | v_s]``, ``gate_up`` is ``[gate_s | up_s]``, of the HF
    tensors ``...q_proj.{kind}`` (``kind``: "weight", "bias", or a kept block part, "weight.qs")."""

    qkv: Callable[..., np.ndarray]
    gate_up: Callable[..., np.ndarray]


def _fused_row_readers(get: Callable[[str], np.ndarray], layout: TPLayout) -> _FusedRows:
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

    def qkv(p: str, s: int, *, kind: str) -> np.ndarray:
        parts = [rows(p, f"self_attn.q_proj.{kind}", s), kv_rows(p, f"self_attn.k_proj.{kind}", s),
                 kv_rows(p, f"self_attn.v_proj.{kind}", s)]
        return np.concatenate(parts)

    def gate_up(p: str, s: int, *, kind: str) -> np.ndarray:
        return np.concatenate([rows(p, f"mlp.gate_proj.{kind}", s), rows(p, f"mlp.up_proj.{kind}", s)])

    return _FusedRows(qkv, gate_up)


def _layer_readers(get: Callable[[str], np.ndarray],
                   layout: TPLayout) -> dict[ParamPath, Callable[[str, int], np.ndarray]]:
    """A decoder layer parameter's path -> how to read shard ``s`` of it for the layer whose names
    start with ``p``. Holds every optional parameter; the model's structure says which ones exist.
    Every read slices the memory-mapped tensor first, so only the shard's bytes are copied."""
    n = layout.size
    fused = _fused_row_readers(get, layout)

    def qkv(p: str, kind: str, s: int) -> np.ndarray:
        return fused.qkv(p, s, kind=kind)

    def gate_up(p: str, kind: str, s: int) -> np.ndarray:
        return fused.gate_up(p, s, kind=kind)

    def in_cols(p: str, name: str, s: int) -> np.ndarray:
        """Shard ``s`` of the input columns of an HF ``[out, in]`` weight, as ``[in / n, out]``."""
        full = get(p + name)
        per = full.shape[1] // n
        return full[:, s * per : (s + 1) * per].T

    return {
        ("input_layernorm", "scale"): lambda p, s: get(p + "input_layernorm.weight"),
        ("post_attention_layernorm", "scale"): lambda p, s: get(p + "post_attention_layernorm.weight"),
        ("pre_feedforward_layernorm", "scale"): lambda p, s: get(p + "pre_feedforward_layernorm.weight"),
        ("post_feedforward_layernorm", "scale"): lambda p, s: get(p + "post_feedforward_layernorm.weight"),
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


def _moe_readers(get: Callable[[str], np.ndarray], cfg: ModelConfig,
                 layout: TPLayout) -> dict[ParamPath, Callable[[str, int], np.ndarray]]:
    """The router as a ``[hidden, E]`` kernel (replicated) and the experts stacked: ``gate_up_proj
    [E, hidden, 2 * inter]`` (``[gate | up]`` columns) and ``down_proj [E, inter, hidden]``; shard
    ``s`` reads only its own whole experts (expert parallelism, :mod:`.tp_layout`)."""
    block, gate, up, down = moe_names(cfg)
    per = cfg.num_experts // layout.size

    def experts(s: int) -> range:
        return range(s * per, (s + 1) * per)

    def gate_up(p: str, s: int) -> np.ndarray:
        return np.stack([np.concatenate([get(f"{p}{block}experts.{e}.{gate}.weight"),
                                         get(f"{p}{block}experts.{e}.{up}.weight")]).T for e in experts(s)])

    return {
        ("mlp", "gate", "kernel"): lambda p, s: get(p + block + "gate.weight").T,
        ("mlp", "experts", "gate_up_proj"): gate_up,
        ("mlp", "experts", "down_proj"): lambda p, s: np.stack(
            [get(f"{p}{block}experts.{e}.{down}.weight").T for e in experts(s)]),
    }


def _gpt_oss_moe_readers(get: Callable[[str], np.ndarray], cfg: ModelConfig,
                         layout: TPLayout) -> dict[ParamPath, Callable[[str, int], np.ndarray]]:
    """gpt-oss's router (with bias) and its stacked experts, their gate/up columns (interleaved in
    the checkpoint: gate even, up odd) split into ``[gate | up]``; shard ``s`` reads its own experts."""
    per = cfg.num_experts // layout.size
    heads = cfg.num_attention_heads // layout.size  # shard s's query heads, in order

    def mine(p: str, name: str, s: int) -> np.ndarray:
        return get(f"{p}mlp.experts.{name}")[s * per : (s + 1) * per]

    def split(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)

    return {
        ("mlp", "gate", "kernel"): lambda p, s: get(p + "mlp.router.weight").T,
        ("mlp", "gate", "bias"): lambda p, s: get(p + "mlp.router.bias"),
        ("mlp", "experts", "gate_up_proj"): lambda p, s: split(mine(p, "gate_up_proj", s)),
        ("mlp", "experts", "gate_up_proj_bias"): lambda p, s: split(mine(p, "gate_up_proj_bias", s)),
        ("mlp", "experts", "down_proj"): lambda p, s: mine(p, "down_proj", s),
        ("mlp", "experts", "down_proj_bias"): lambda p, s: mine(p, "down_proj_bias", s),
        ("self_attn", "sinks"): lambda p, s: get(p + "self_attn.sinks")[s * heads : (s + 1) * heads],
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
        kernel, scale = module + ("kernel",), module + ("kernel_scale",)
        read = per_layer[kernel]
        axis = split_axis(kernel)

        @functools.lru_cache(maxsize=2)
        def whole(p: str, read=read, axis=axis) -> tuple[np.ndarray, np.ndarray]:
            full = read(p, 0) if axis is None else np.concatenate([read(p, s) for s in range(n)], axis=axis)
            return quantize_columns(full, method)

        readers[kernel] = _part_reader(whole, 0, axis, n)
        # The scale follows the output columns: split with a column-split kernel, else replicated.
        readers[scale] = _part_reader(whole, 1, 0 if axis == 1 else None, n)
    return readers


def _part_reader(whole: Callable[[str], tuple[np.ndarray, np.ndarray]], part: int, axis: int | None,
                 num_shards: int) -> Callable[[str, int], np.ndarray]:
    """Shard ``s`` of part ``part`` (0: the quantized kernel, 1: its scale) of a layer's whole
    quantized projection."""
    return lambda p, s: _shard_of(whole(p)[part], axis, s, num_shards)


# The HF name of each row-split projection (its scales follow whole output columns: replicated).
_ROW_SPLIT_NAMES = {("self_attn", "o_proj"): "self_attn.o_proj", ("mlp", "down_proj"): "mlp.down_proj"}


def _prequantized_readers(get: Callable[[str], np.ndarray],
                          layout: TPLayout) -> dict[ParamPath, Callable[[str, int], np.ndarray]]:
    """The layer readers of a pre-quantized checkpoint: the stored int8/fp8 kernels read, fused
    and split as float ones are, and each ``kernel_scale`` read as its weight's rows are, through
    a ``get`` that turns ``x.weight`` into x's per-row scales (a per-tensor scale broadcast, so
    q, k and v keep their own)."""
    readers = _layer_readers(get, layout)
    scales = _layer_readers(lambda name: column_scales(get, name.removesuffix(".weight")), layout)
    for module in QUANTIZED_PROJECTIONS:
        kernel = module + ("kernel",)
        if split_axis(kernel) == 1:  # column-split (qkv, gate|up): the scales split with the columns
            readers[module + ("kernel_scale",)] = scales[kernel]
        else:
            readers[module + ("kernel_scale",)] = functools.partial(_replicated_scales, get, _ROW_SPLIT_NAMES[module])
    return readers


def _replicated_scales(get: Callable[[str], np.ndarray], name: str, p: str, s: int) -> np.ndarray:
    """A row-split projection's scales: whole on every shard (``s`` unused)."""
    return column_scales(get, p + name)
