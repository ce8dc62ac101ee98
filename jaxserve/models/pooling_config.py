"""How a pooling model turns hidden states into one vector: vLLM's ``PoolerConfig`` and its sources.

The pooling comes, in vLLM's order of precedence, from ``--pooler-config`` (JSON), then from the
checkpoint's Sentence-Transformers files (``modules.json`` naming a ``Pooling`` module whose
``config.json`` sets one ``pooling_mode_*``, and a ``Normalize`` module), then from the task's
default (embed: last token, normalized; classify: last token, no normalize). Pure Python over the
checkpoint's JSON files; no JAX here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal

from jaxserve.exceptions import ConfigError

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[str, ...] = ("LAST", "MEAN", "CLS")
PoolingTask = Literal["embed", "classify"]
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")

# Sentence-Transformers' ``pooling_mode_*`` keys, mapped to vLLM's pooling type names.
_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
# Modes Sentence-Transformers has that jaxserve (like vLLM) does not pool by.
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_POOLER_KEYS = ("pooling_type", "normalize", "dimensions", "activation")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    """LAST (the last token's hidden state), MEAN (over the prompt) or CLS (the first token)."""
    normalize: bool = True
    """L2-normalize the pooled vector (embed); ignored by classify."""
    dimensions: int | None = None
    """Matryoshka: keep the first ``dimensions`` values (then normalize again); None = all."""
    activation: bool = True
    """classify: apply softmax (several labels) or sigmoid (one label) to the head's logits."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"pooler_config.pooling_type: must be one of {', '.join(POOLING_TYPES)}, "
                              f"got {self.pooling_type!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ConfigError(f"pooler_config.dimensions: must be a positive integer, got {self.dimensions!r}")


def parse_pooler_config(text: str | None) -> dict[str, Any]:
    """``--pooler-config``'s JSON object, checked key by key (the keys it sets override the rest)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"pooler_config: not JSON ({e.msg}), got {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"pooler_config: must be a JSON object, got {text!r}")
    unknown = sorted(set(value) - set(_POOLER_KEYS))
    if unknown:
        raise ConfigError(f"pooler_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(_POOLER_KEYS)}")
    if "pooling_type" in value:
        value["pooling_type"] = str(value["pooling_type"]).upper()
    for key in ("normalize", "activation"):
        if key in value and not isinstance(value[key], bool):
            raise ConfigError(f"pooler_config.{key}: must be true or false, got {value[key]!r}")
    PoolerConfig(**value)  # validates the values now, at configuration time
    return value


def sentence_transformers_pooling(folder: str | None) -> dict[str, Any]:
    """The pooling a Sentence-Transformers checkpoint declares ({} when the folder has none)."""
    if folder is None or not os.path.isfile(os.path.join(folder, "modules.json")):
        return {}
    with open(os.path.join(folder, "modules.json")) as f:
        modules = json.load(f)
    found: dict[str, Any] = {}
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Normalize"):
            found["normalize"] = True
        elif kind.endswith(".Pooling"):
            path = os.path.join(folder, module.get("path", ""), "config.json")
            with open(path) as f:
                pooling = json.load(f)
            modes = [_ST_POOLING_MODES[k] for k in _ST_POOLING_MODES if pooling.get(k)]
            odd = [k for k in _ST_UNSUPPORTED if pooling.get(k)]
            if odd or len(modes) != 1:
                raise ConfigError(f"{path}: exactly one of {', '.join(_ST_POOLING_MODES)} must be set "
                                  f"(not {', '.join(odd) or 'none'}); pass --pooler-config to choose")
            found["pooling_type"] = modes[0]
    if found:
        found.setdefault("normalize", False)  # a Sentence-Transformers model without Normalize
    return found


def resolve_pooler_config(task: str, folder: str | None, override: str | None) -> PoolerConfig:
    """The task's default, then the checkpoint's files, then ``--pooler-config``: the last wins."""
    values: dict[str, Any] = {"pooling_type": "LAST", "normalize": task == "embed"}
    if task == "classify":
        values.pop("normalize")
    st = sentence_transformers_pooling(folder)
    if task == "classify":
        st.pop("normalize", None)
    values.update(st)
    values.update(parse_pooler_config(override))
    return PoolerConfig(**values)


def is_sentence_transformers_folder(folder: str | None) -> bool:
    return folder is not None and os.path.isfile(os.path.join(folder, "modules.json"))


def resolve_pooling_task(architectures: list[str] | None, folder: str | None, runner: str,
                         convert: str) -> PoolingTask | None:
    """Which pooling task the engine serves (None: it generates), vLLM's detection rules.

    ``*ForSequenceClassification`` classifies; ``*Model`` and a Sentence-Transformers folder embed;
    ``*ForCausalLM`` generates unless ``--runner pooling`` or ``--convert`` says otherwise.
    """
    if runner not in RUNNERS:
        raise ConfigError(f"runner: must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ConfigError(f"convert: must be one of {', '.join(CONVERTS)}, got {convert!r}")
    names = list(architectures or [])
    if convert in ("embed", "classify"):
        if runner == "generate":
            raise ConfigError(f"convert: {convert!r} makes a pooling model, which runner 'generate' cannot run")
        return convert  # type: ignore[return-value]
    native: PoolingTask | None = None
    if any(n.endswith("ForSequenceClassification") for n in names):
        native = "classify"
    elif any(n.endswith("Model") for n in names) or is_sentence_transformers_folder(folder):
        native = "embed"
    if runner == "generate":
        if native is not None and not any(n.endswith("ForCausalLM") for n in names):
            raise ConfigError(f"runner: {names!r} has no language-model head; it cannot generate "
                              "(use --runner pooling)")
        return None
    if runner == "pooling":
        return native or "embed"  # a causal LM run as a pooler embeds, as in vLLM
    return native
