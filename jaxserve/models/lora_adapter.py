"""Read a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) into numpy.

No torch: the weights are read by :mod:`jaxserve.models.safetensors_io`. The result is one
``(A, B)`` pair per (layer, projection), with the LoRA scaling folded into ``B`` so the runner
computes ``x @ A.T @ B.T`` and nothing else. Every adapter feature the runner cannot apply
exactly is refused with a ``ConfigError`` naming the field, rather than silently ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.exceptions import ConfigError
from jaxserve.models.config import ModelConfig
from jaxserve.models.safetensors_io import SafetensorsFile

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections a LoRA may target, with the module path under each decoder layer.
PROJECTIONS: dict[str, str] = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}

# Config fields that change the math; each must hold its neutral value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, [], ()),
    "layer_replication": (None, [], ()),
    "target_parameters": (None, [], ()),
    "trainable_token_indices": (None, [], {}, ()),
    "megatron_config": (None, {}),
    "use_qalora": (False, None),
    "lora_bias": (False, None),
    "alora_invocation_tokens": (None, [], ()),
}

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
_LM_HEAD_KEY = re.compile(r"^base_model\.model\.lm_head\.lora_(A|B)\.weight$")
_EMBED_KEY = re.compile(r"^base_model\.model\.model\.embed_tokens\.lora_embedding_(A|B)(\.weight)?$")


def whole_module_targets(path: str | Path) -> set[str]:
    """Which of ``lm_head`` / ``embed_tokens`` the adapter folder holds LoRA pairs for, read from
    the weight file's header alone (no tensor); empty when the folder has no weight file (loading
    it then fails, naming what is missing)."""
    weights_file = Path(path) / WEIGHTS_FILE
    if not weights_file.is_file():
        return set()
    keys = SafetensorsFile(weights_file).keys()
    return ({"lm_head"} if any(_LM_HEAD_KEY.match(k) for k in keys) else set()) | (
        {"embed_tokens"} if any(_EMBED_KEY.match(k) for k in keys) else set())


def projection_shape(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    """``(in_features, out_features)`` of a base projection."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
            "o_proj": (cfg.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[proj]


@dataclass(frozen=True)
class LoRALayerWeights:
    """One projection's adapter: ``delta(x) = x @ a.T @ b.T`` (``b`` already scaled)."""

    a: np.ndarray  # (rank, in_features), float32
    b: np.ndarray  # (out_features, rank), float32, times the LoRA scaling

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter: its weights by ``(layer, projection)`` and a digest of them."""

    path: str
    rank: int  # the largest rank over its projections
    weights: dict[tuple[int, str], LoRALayerWeights] = field(repr=False)
    digest: str  # sha256 of the config and the weight file: part of the prefix-cache key
    lm_head: LoRALayerWeights | None = field(default=None, repr=False)  # a: (r, hidden), b: (vocab, r)
    embedding: LoRALayerWeights | None = field(default=None, repr=False)  # a: (r, vocab), b: (hidden, r)

    @property
    def projections(self) -> tuple[str, ...]:
        return tuple(sorted({p for _, p in self.weights}))


def _check_config(conf: dict[str, Any], source: str) -> None:
    peft_type = conf.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ConfigError(f"{source}: peft_type={peft_type!r} is not supported (only LORA)")
    for name, neutral in _NEUTRAL.items():
        if conf.get(name) not in neutral:
            raise ConfigError(f"{source}: {name}={conf[name]!r} is not supported by jaxserve's LoRA")
    if conf.get("bias", "none") != "none":
        raise ConfigError(f"{source}: bias={conf['bias']!r} is not supported (only 'none')")
    init = conf.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda", "eva", "loftq")):
        # These rewrite the base weights at init time; the adapter alone does not reproduce them.
        raise ConfigError(f"{source}: init_lora_weights={init!r} is not supported (it changes the base weights)")


def _alpha_for(conf: dict[str, Any], key: str) -> float:
    """``lora_alpha``, or the first ``alpha_pattern`` entry matching the module key (PEFT's rule)."""
    for pattern, alpha in (conf.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return float(alpha)
    return float(conf.get("lora_alpha", 8))


def load_lora_adapter(path: str | Path, cfg: ModelConfig, max_lora_rank: int, allow_lm_head: bool = False,
                      allow_embedding: bool = False) -> LoRAAdapter:
    """Read and check a PEFT adapter folder against the base model ``cfg``. ``allow_lm_head`` /
    ``allow_embedding``: read an LM-head / embedding LoRA (applied by the model when its slot table
    has them); off, such a pair is refused naming the module. The engine reads both and checks
    them against the slot tables it allocated."""
    folder = Path(path)
    conf_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not conf_file.is_file():
        raise ConfigError(f"LoRA adapter {path}: no {CONFIG_FILE}")
    if not weights_file.is_file():
        has_bin = (folder / "adapter_model.bin").is_file()
        hint = " (adapter_model.bin is not read: convert it to safetensors)" if has_bin else ""
        raise ConfigError(f"LoRA adapter {path}: no {WEIGHTS_FILE}{hint}")
    raw_conf = conf_file.read_bytes()
    conf = json.loads(raw_conf)
    source = f"LoRA adapter {path}"
    _check_config(conf, source)

    st = SafetensorsFile(weights_file)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    head: dict[str, np.ndarray] = {}
    embed: dict[str, np.ndarray] = {}
    for key in st.keys():
        mh = _LM_HEAD_KEY.match(key)
        if mh is not None and allow_lm_head:
            head[mh[1]] = np.asarray(st.get(key), dtype=np.float32)
            continue
        me = _EMBED_KEY.match(key)
        if me is not None and allow_embedding:
            embed[me[1]] = np.asarray(st.get(key), dtype=np.float32)
            continue
        m = _KEY.match(key)
        if m is None:
            what = "embedding" if "embed" in key else "LM head" if "lm_head" in key else "module"
            if what != "module" and "lora_" not in key:
                # PEFT's save_embedding_layers copy of a base weight: it may differ from the base's
                # (a resized vocabulary), so it is refused rather than assumed equal.
                raise ConfigError(f"{source}: tensor {key!r} is a full {what} weight, not a LoRA pair "
                                  f"(save the adapter with save_embedding_layers=False)")
            raise ConfigError(f"{source}: tensor {key!r} targets an unsupported {what} "
                              f"(supported: {', '.join(PROJECTIONS)} of the decoder layers"
                              f"{', lm_head' if allow_lm_head else ''}{', embed_tokens' if allow_embedding else ''})")
        layer, block, proj, ab = int(m[1]), m[2], m[3], m[4]
        if proj not in PROJECTIONS or PROJECTIONS[proj] != f"{block}.{proj}":
            raise ConfigError(f"{source}: tensor {key!r} targets {block}.{proj}, which is not supported")
        if layer >= cfg.num_hidden_layers:
            raise ConfigError(f"{source}: tensor {key!r} names layer {layer}, the model has {cfg.num_hidden_layers}")
        pairs.setdefault((layer, proj), {})[ab] = np.asarray(st.get(key), dtype=np.float32)

    h, v = cfg.hidden_size, cfg.vocab_size
    lm_head = _pair_weights("lm_head", ("lora_A", "lora_B"), head, (h, v), conf, max_lora_rank,
                            source) if head else None
    embedding = _pair_weights("embed_tokens", ("lora_embedding_A", "lora_embedding_B"), embed, (v, h), conf,
                              max_lora_rank, source) if embed else None
    if not pairs and lm_head is None and embedding is None:
        raise ConfigError(f"{source}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], LoRALayerWeights] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        name = f"layers.{layer}.{PROJECTIONS[proj]}"
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"{source}: {name} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        a, b = ab["A"], ab["B"]
        in_f, out_f = projection_shape(cfg, proj)
        r = a.shape[0]
        if a.shape != (r, in_f) or b.shape != (out_f, r):
            raise ConfigError(f"{source}: {name} has lora_A {a.shape} and lora_B {b.shape}; "
                              f"the base model needs ({r}, {in_f}) and ({out_f}, {r})")
        if r > max_lora_rank:
            raise ConfigError(f"{source}: {name} has rank r={r} above max_lora_rank={max_lora_rank}")
        alpha = _alpha_for(conf, f"model.layers.{layer}.{PROJECTIONS[proj]}")
        scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
        weights[(layer, proj)] = LoRALayerWeights(a=np.ascontiguousarray(a),
                                                  b=np.ascontiguousarray(b * np.float32(scale)))

    digest = hashlib.sha256(raw_conf + weights_file.read_bytes()).hexdigest()
    rank = max(w.rank for w in [*weights.values(), *(w for w in (lm_head, embedding) if w is not None)])
    return LoRAAdapter(path=str(folder), rank=rank, weights=weights, digest=digest, lm_head=lm_head,
                       embedding=embedding)


def _scale(conf: dict[str, Any], key: str, r: int) -> float:
    alpha = _alpha_for(conf, key)
    return alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r


def _pair_weights(name: str, labels: tuple[str, str], ab: dict[str, np.ndarray], needs: tuple[int, int],
                  conf: dict[str, Any], max_lora_rank: int, source: str) -> LoRALayerWeights:
    """A whole-module pair, ``a`` ``(r, needs[0])`` and ``b`` ``(needs[1], r)`` (``b`` scaled): the LM
    head (a Linear LoRA: hidden, vocab) or PEFT's embedding pair (vocab, hidden)."""
    if set(ab) != {"A", "B"}:
        raise ConfigError(f"{source}: {name} has {labels[0 if 'A' in ab else 1]} without its pair")
    a, b = ab["A"], ab["B"]
    r = a.shape[0]
    if a.shape != (r, needs[0]) or b.shape != (needs[1], r):
        raise ConfigError(f"{source}: {name} has {labels[0]} {a.shape} and {labels[1]} {b.shape}; the base model "
                          f"needs ({r}, {needs[0]}) and ({needs[1]}, {r})")
    if r > max_lora_rank:
        raise ConfigError(f"{source}: {name} has rank r={r} above max_lora_rank={max_lora_rank}")
    scale = _scale(conf, name, r)
    return LoRALayerWeights(a=np.ascontiguousarray(a), b=np.ascontiguousarray(b * np.float32(scale)))
