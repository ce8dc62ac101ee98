"""Loader: both config dialects, and an error that names the problem for each kind of bad folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxserve.models import ModelConfig, load_model
from jaxserve.models.safetensors_io import SafetensorsFile, save_file


def copy_checkpoint(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


def load_tensors(folder: Path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(folder / "model.safetensors")
    return {k: np.array(f.get(k)) for k in f.keys()}


def test_hub_and_transformers5_config_forms_agree(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["LlamaForCausalLM"]
    new_form = ModelConfig.from_pretrained(src)
    hub = copy_checkpoint(src, tmp_path / "hub")
    cfg = json.loads((hub / "config.json").read_text())
    theta = cfg["rope_parameters"]["rope_theta"]
    rewrite_config(hub, rope_parameters=None, dtype=None, rope_theta=theta, torch_dtype="float32", rope_scaling=None)
    assert ModelConfig.from_pretrained(hub) == new_form


def test_hub_form_llama3_rope_scaling(tiny_checkpoints, tmp_path):
    hub = copy_checkpoint(tiny_checkpoints["LlamaForCausalLM"], tmp_path / "hub")
    rewrite_config(hub, rope_parameters=None, dtype=None, rope_theta=500000.0, torch_dtype="bfloat16",
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg = ModelConfig.from_pretrained(hub)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.factor == 8.0 and cfg.rope.theta == 500000.0
    assert cfg.dtype == "bfloat16"


def test_unknown_architecture_lists_supported(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["Qwen3ForCausalLM"], tmp_path / "gpt")
    rewrite_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(folder)


def test_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["Qwen2ForCausalLM"], tmp_path / "missing")
    tensors = load_tensors(folder)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder)


def test_unexpected_tensor_is_named(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["Qwen2ForCausalLM"], tmp_path / "extra")
    tensors = load_tensors(folder)
    tensors["model.layers.0.self_attn.mystery.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.mystery\.weight"):
        load_model(folder)


def test_shape_mismatch_is_named(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["LlamaForCausalLM"], tmp_path / "shape")
    tensors = load_tensors(folder)
    tensors["model.norm.weight"] = np.ones((3,), np.float32)
    save_file(tensors, folder / "model.safetensors")
    expected = r"shape mismatch for model\.norm\.weight: checkpoint has \(3,\), config implies \(64,\)"
    with pytest.raises(ValueError, match=expected):
        load_model(folder)


def test_pickle_only_checkpoint_is_refused(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["LlamaForCausalLM"], tmp_path / "pickle")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*Convert it to safetensors"):
        load_model(folder)


def test_missing_config_and_required_field(tiny_checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    folder = copy_checkpoint(tiny_checkpoints["LlamaForCausalLM"], tmp_path / "nofield")
    rewrite_config(folder, hidden_size=None)
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        load_model(folder)


def test_unsupported_dtype_is_named(tiny_checkpoints):
    with pytest.raises(ValueError, match="dtype: unsupported value 'int8'"):
        load_model(tiny_checkpoints["LlamaForCausalLM"], dtype="int8")
