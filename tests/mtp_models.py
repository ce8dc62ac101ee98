"""Tiny MiMo checkpoints (``MiMoForCausalLM``: a Qwen2 decoder plus multi-token-prediction layers
``model.mtp_layers.{i}.*``, config ``num_nextn_predict_layers``) made from a tiny Qwen2 folder: the
same decoder tensors, so the Qwen2 folder is the plain engine to compare with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from jaxserve.models.safetensors_io import SafetensorsFile, save_file


def mtp_layer_tensors(config: dict, seed: int, pass_through: bool = True) -> dict[str, np.ndarray]:
    """One MTP layer's tensors (names after ``model.mtp_layers.{i}.``), HF ``[out, in]``. With
    ``pass_through``, ``input_proj`` is near ``[0 | I]`` and the MLP scaled down: the layer's output
    is near the (normed) embedding of the token it reads, so with a tied LM head its drafts mostly
    repeat that token, which a tiny random tied model's repetitive greedy output often accepts."""
    h, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d, m = h // heads, config["intermediate_size"]
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    proj = rand(h, 2 * h)
    if pass_through:
        proj += np.concatenate([np.zeros((h, h)), np.eye(h)], axis=1).astype(np.float32)
    t = {"token_layernorm.weight": 1 + rand(h), "hidden_layernorm.weight": 1 + rand(h), "input_proj.weight": proj,
         "final_layernorm.weight": 1 + rand(h), "input_layernorm.weight": 1 + rand(h),
         "post_attention_layernorm.weight": 1 + rand(h),
         "self_attn.q_proj.weight": rand(heads * d, h), "self_attn.q_proj.bias": rand(heads * d),
         "self_attn.k_proj.weight": rand(kv_heads * d, h), "self_attn.k_proj.bias": rand(kv_heads * d),
         "self_attn.v_proj.weight": rand(kv_heads * d, h), "self_attn.v_proj.bias": rand(kv_heads * d),
         "self_attn.o_proj.weight": rand(h, heads * d),
         "mlp.gate_proj.weight": rand(m, h), "mlp.up_proj.weight": rand(m, h), "mlp.down_proj.weight": rand(h, m)}
    if pass_through:
        t["mlp.down_proj.weight"] *= 0.1
    return t


def write_mimo(folder: str | Path, qwen2_folder: str | Path, *, num_layers: int = 1, written: int | None = None,
               seed: int = 0, rename: dict[str, str] | None = None, **config_overrides) -> str:
    """``qwen2_folder`` copied as a MiMo checkpoint with ``written`` (default ``num_layers``) MTP
    layers in its safetensors and ``num_nextn_predict_layers=num_layers`` in its config;
    ``rename``: MTP tensor names (after ``model.mtp_layers.``) written under another name."""
    folder = Path(folder)
    shutil.copytree(qwen2_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    file = SafetensorsFile(folder / "model.safetensors")
    tensors = {name: np.array(file.get(name)) for name in file.keys()}
    del file
    for i in range(num_layers if written is None else written):
        for key, value in mtp_layer_tensors(config, seed + i).items():
            name = f"{i}.{key}"
            tensors["model.mtp_layers." + (rename or {}).get(name, name)] = value
    save_file(tensors, folder / "model.safetensors")
    config.update({"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "num_nextn_predict_layers": num_layers,
                   **config_overrides})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)
