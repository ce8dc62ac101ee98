"""The drafts of a speculating engine for the deviceless GPU compile (:mod:`.gpu_aot`), shapes only.

``speculative_config``'s method decides what the compile-only runner is given in place of what
the engine would load from ``speculative_config.model``:

- **draft_model**: ``model`` names a benchmark preset (:mod:`.presets`; ``quantization`` keeps
  its projections so, as the engine's flag does), built without weights; it must have the
  target's vocabulary, as a real draft must.
- **eagle** / **eagle3**: a head of the target's shape (one Llama layer of the target's width and
  heads; EAGLE-3 reading the target's default three layers over a 32,000-token draft vocabulary
  (at most the target's) with its ``d2t`` map, as published EAGLE-3 heads do). ``model`` only labels it.
- **mtp**: the target's own multi-token-prediction layer, of the target's shape as a MiMo
  checkpoint's is (``input_proj``, its norms and a Qwen2 decoder layer); the target must be a
  MiMo preset (``mimo-7b``), whose config names ``num_nextn_predict_layers``.

:func:`draft_programs` lists every program the runner's proposer compiles at warm-up, each with
the shapes a copy of would be a weight or pool copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.bench.presets import PRESETS
from jaxserve.config import EngineConfig
from jaxserve.config.speculative import HEAD_METHODS, SpeculativeConfig
from jaxserve.exceptions import ConfigError
from jaxserve.models.config import ModelConfig
from jaxserve.models.eagle import EagleConfig, Weights, as_served, eagle_config_from, eagle_weight_shapes
from jaxserve.models.mtp import mtp_head_config, mtp_layer_shapes, served_mtp_key
from jaxserve.runner.draft_runner import draft_layout_size, draft_pool_kv
from jaxserve.runner.eagle_runner import head_pool_kv
from jaxserve.runner.kv_cache import ProposerKV

EAGLE3_DRAFT_VOCAB = 32000  # the draft vocabulary of published EAGLE-3 heads (Llama 3's, Qwen3's)


def abstract_draft(spec: SpeculativeConfig, target: ModelConfig, scan_layers: bool = False,
                   preset: str | None = None, config: EngineConfig | None = None) -> Any:
    """What the compile-only runner is given for ``spec`` (None for n-gram): an abstract draft
    model, or an EAGLE head or MTP layer as (EagleConfig, weight shapes); ``preset``: the
    target's (mtp reads its configuration); ``config``: the engine's, whose tensor parallelism
    lays the draft model out as the engine would (split when its shapes divide; default: one device)."""
    from jaxserve.bench.gpu_aot import abstract_model

    if spec.method == "ngram":
        return None
    if spec.method in ("eagle", "eagle3"):
        return abstract_eagle_head(spec.method, target)
    if spec.method == "mtp":
        if not PRESETS.get(preset or "", {}).get("num_nextn_predict_layers"):
            mimo = sorted(name for name, shape in PRESETS.items() if shape.get("num_nextn_predict_layers"))
            raise ConfigError(f"speculative_config.method=mtp: the preset {preset!r} has no multi-token-prediction "
                              f"layers; the compile check's MTP targets are {', '.join(mimo)}")
        return abstract_mtp_head(target)
    if spec.model not in PRESETS:
        raise ConfigError(f"speculative_config.model: {spec.model!r} is not a preset for the compile check; "
                          f"one of {', '.join(sorted(PRESETS))}")
    draft = abstract_model(spec.model, scan_layers, 1, quantization=spec.quantization)
    size = 1 if config is None else draft_layout_size(config, draft.config, config.tensor_parallel_size)
    if size > 1:
        draft = abstract_model(spec.model, scan_layers, size, quantization=spec.quantization)
    if draft.config.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative_config.model: the preset {spec.model}'s vocabulary ({draft.config.vocab_size} "
                          f"tokens) is not the target's ({target.vocab_size})")
    return draft


def abstract_eagle_head(method: str, target: ModelConfig) -> tuple[EagleConfig, Weights]:
    """An ``eagle`` / ``eagle3`` head of ``target``'s shape, its weights shapes in the target's dtype."""
    raw = {"hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
           "num_attention_heads": target.num_attention_heads, "num_key_value_heads": target.num_key_value_heads,
           "head_dim": target.head_dim, "vocab_size": target.vocab_size, "rms_norm_eps": target.rms_norm_eps,
           "rope_theta": target.rope.theta, "max_position_embeddings": target.max_position_embeddings}
    if method == "eagle3":
        raw["draft_vocab_size"] = min(EAGLE3_DRAFT_VOCAB, target.vocab_size)
    cfg = eagle_config_from(raw, method, target, f"a random {method} head")
    shapes, optional = eagle_weight_shapes(cfg)
    dtype = jnp.dtype(target.dtype)
    weights: Weights = {k: jax.ShapeDtypeStruct(as_served(k, s), dtype) for k, s in shapes.items()}
    if method == "eagle3":
        weights["d2t"] = jax.ShapeDtypeStruct(optional["d2t"], jnp.int32)
    return cfg, weights


def abstract_mtp_head(target: ModelConfig) -> tuple[EagleConfig, Weights]:
    """An MTP layer of the MiMo target ``target``, its weights' shapes in the target's dtype as
    :func:`jaxserve.models.mtp.load_mtp_head` serves them."""
    cfg = mtp_head_config(target)
    required, _ = mtp_layer_shapes(cfg.layer)
    dtype = jnp.dtype(target.dtype)
    return cfg, {served_mtp_key(k): jax.ShapeDtypeStruct(s[::-1], dtype) for k, s in required.items()}


def proposer_memory(spec: SpeculativeConfig, draft: Any, config: EngineConfig,
                    max_model_len: int) -> tuple[ProposerKV | None, int]:
    """What the proposer of ``draft`` (from :func:`abstract_draft`) takes of the KV budget: its
    pool as the engine's sizing counts it, and its weights' bytes."""
    if draft is None:
        return None, 0
    if spec.method in HEAD_METHODS:
        cfg, weights = draft
        return head_pool_kv(config, cfg), sum(x.size * x.dtype.itemsize for x in weights.values())
    from jaxserve.bench.gpu_aot import weight_bytes

    return (draft_pool_kv(config, draft.config, max_model_len, spec.num_speculative_tokens),
            weight_bytes(draft))


@dataclasses.dataclass(frozen=True)
class DraftProgram:
    """One program of a proposer: ``name`` (e.g. ``draft-decode-r8``), ``lower`` (lowers it,
    compiles nothing), and the (HLO dtype, dims) a copy of which is a weight or a pool copy."""

    name: str
    lower: Callable[[], Any]
    weights: Any  # the arrays read in place: the draft's weights (EAGLE: the head's and the target's tables)
    pools: Any


def draft_programs(runner: Any, sizes: list[int] | None = None) -> list[DraftProgram]:
    """The programs ``runner``'s proposer compiles at warm-up (none for n-gram or no
    speculation); ``sizes``: only those token (or row) buckets."""
    keep = (lambda n: True) if not sizes else (lambda n: n in sizes)
    if runner.drafter is not None:
        d = runner.drafter
        return [DraftProgram(f"draft-{'catch-up-' if kind == 'catch_up' else 'decode-r'}{size}",
                             lambda kind=kind, size=size: d.lowered(kind, size), d.weights, d.kv)
                for kind, size in d.programs() if keep(size)]
    if runner.eagle is not None:
        e = runner.eagle
        dtype = jnp.dtype(runner.mc.dtype)
        out = [DraftProgram(f"{e.cfg.method}-{bucket}", lambda bucket=bucket: e.lowered(bucket, dtype),
                            (e.weights, e.tables), e.kv)
               for bucket in sorted(e.step_rows) if keep(bucket)]
        if e.on_device:  # async scheduling: the overlap's program, run from a step's device outputs
            out += [DraftProgram(f"{e.cfg.method}-device-{bucket}",
                                 lambda bucket=bucket: e.lowered_on_device(bucket, dtype), (e.weights, e.tables), e.kv)
                    for bucket in sorted(e.step_rows) if keep(bucket)]
        return out
    return []

