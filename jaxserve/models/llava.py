"""A LLaVA checkpoint's language model: the Llama-family decoder read from its ``text_config`` and
its ``language_model.*`` tensors (the image side is :mod:`.llava_vision`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flax import nnx

from jaxserve.models.config import ModelConfig, llava_text_config
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.loader import Placement, _abstract_model, _with_dtype, check_tensors, state_from_tensors
from jaxserve.models.safetensors_io import open_checkpoint_files

VLM_ARCHITECTURES = ("LlavaForConditionalGeneration",)


def is_llava_config(hf: dict[str, Any]) -> bool:
    return any(a in VLM_ARCHITECTURES for a in hf.get("architectures") or [])


def text_model_config(hf: dict[str, Any]) -> ModelConfig:
    """The language model's config from a LLaVA ``config.json``."""
    return ModelConfig.from_dict(llava_text_config(hf))


def _text_name(name: str) -> str | None:
    """A LLaVA tensor name -> the text model's HF name (``model.layers...``, ``lm_head.weight``)."""
    for prefix, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return new + name[len(prefix):]
    return None


def load_llava_language_model(folder: str | Path, dtype: str | None = None,
                              scan_layers: bool | None = None, *, tensor_parallel_size: int = 1,
                              place: Placement | None = None) -> LlamaForCausalLM:
    hf = json.loads((Path(folder) / "config.json").read_text())
    cfg = _with_dtype(text_model_config(hf), dtype)
    files = open_checkpoint_files(folder)
    names = {new: old for old in files if (new := _text_name(old)) is not None}
    check_tensors(cfg, {new: files[old].shape(old) for new, old in names.items()})
    abstract, graphdef, shapes = _abstract_model(cfg, scan_layers, tensor_parallel_size)
    state = state_from_tensors(lambda n: files[names[n]].get(names[n]), cfg, shapes, abstract.scan_layers,
                               layout=abstract.layout, place=place)
    return nnx.merge(graphdef, state)
