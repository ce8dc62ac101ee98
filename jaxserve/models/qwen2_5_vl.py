"""A Qwen2.5-VL checkpoint (``Qwen2_5_VLForConditionalGeneration``): its language model is the
Qwen2 decoder with M-RoPE (``rope_parameters.mrope_section``), read from ``text_config`` and the
``model.language_model.*`` tensors; its vision tower is :mod:`.qwen2_5_vl_vision`. Image tokens
are ``<|vision_start|>`` + ``<|image_pad|>`` x n + ``<|vision_end|>``, n = t * h * w / merge^2."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from flax import nnx

from jaxserve.models.config import ModelConfig, qwen2_5_vl_text_config
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.loader import Placement, _abstract_model, _with_dtype, check_tensors, state_from_tensors
from jaxserve.models.qwen2_5_vl_vision import Qwen25VisionConfig, Qwen25VisionTower, load_qwen25_vision_tower
from jaxserve.models.safetensors_io import open_checkpoint_files

QWEN2_5_VL_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


def is_qwen2_5_vl_config(hf: dict[str, Any]) -> bool:
    return QWEN2_5_VL_ARCHITECTURE in (hf.get("architectures") or [])


@dataclasses.dataclass(frozen=True)
class Qwen25VLTokens:
    """The special tokens an image is spelled with, and the merge that sizes it."""

    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    merge_size: int

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen25VLTokens:
        missing = [k for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id") if k not in hf]
        if missing:
            raise ValueError(f"config.json: Qwen2.5-VL needs {missing}")
        return cls(int(hf["image_token_id"]), int(hf["vision_start_token_id"]), int(hf["vision_end_token_id"]),
                   int((hf.get("vision_config") or {}).get("spatial_merge_size", 2)))

    def num_image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.merge_size ** 2)

    def expand(self, token_ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
        """Replace the i-th ``<|image_pad|>`` (one per image, as the chat template writes it) by
        ``num_image_tokens(grids[i])`` of them. Returns the ids and each image's first pad offset."""
        found = token_ids.count(self.image_token_id)
        if found != len(grids):
            raise ValueError(f"prompt has {found} image placeholders for {len(grids)} images")
        out: list[int] = []
        offsets: list[int] = []
        images = iter(grids)
        for tok in token_ids:
            if tok == self.image_token_id:
                offsets.append(len(out))
                out += [tok] * self.num_image_tokens(next(images))
            else:
                out.append(tok)
        return out, offsets


def text_model_config(hf: dict[str, Any]) -> ModelConfig:
    return ModelConfig.from_dict(qwen2_5_vl_text_config(hf))


def load_qwen2_5_vl_language_model(folder: str | Path, dtype: str | None = None,
                                   scan_layers: bool | None = None, *, tensor_parallel_size: int = 1,
                                   place: Placement | None = None) -> LlamaForCausalLM:
    hf = json.loads((Path(folder) / "config.json").read_text())
    cfg = _with_dtype(text_model_config(hf), dtype)
    if not cfg.rope.mrope_section:
        raise ValueError("config.json: Qwen2.5-VL's rope_parameters (or rope_scaling) has no mrope_section")
    files = open_checkpoint_files(folder)
    names = {new: old for old in files if not _is_visual(old) and (new := _text_name(old)) is not None}
    check_tensors(cfg, {new: files[old].shape(old) for new, old in names.items()})
    abstract, graphdef, shapes = _abstract_model(cfg, scan_layers, tensor_parallel_size)
    state = state_from_tensors(lambda n: files[names[n]].get(names[n]), cfg, shapes, abstract.scan_layers,
                               layout=abstract.layout, place=place)
    return nnx.merge(graphdef, state)


def _text_name(name: str) -> str | None:
    """A checkpoint tensor -> the text model's HF name. The hub's files (and transformers 5's
    saves) name the decoder ``model.layers...``; transformers 5 in memory ``model.language_model.``."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith(("model.", "lm_head.")) and not _is_visual(name):
        return name
    return None


def _is_visual(name: str) -> bool:
    return name.startswith(("visual.", "model.visual."))


def load_qwen2_5_vl_vision_from_folder(folder: str | Path) -> tuple[Qwen25VisionConfig, Qwen25VisionTower]:
    """The vision tower and its config from a Qwen2.5-VL HF folder (its ``visual.*`` tensors only)."""
    hf = json.loads((Path(folder) / "config.json").read_text())
    cfg = Qwen25VisionConfig.from_hf(hf.get("vision_config") or {})
    files = open_checkpoint_files(folder)
    tensors = {name: f.get(name) for name, f in files.items() if _is_visual(name)}
    return cfg, load_qwen25_vision_tower(cfg, tensors)
