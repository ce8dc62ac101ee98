"""Random EAGLE and EAGLE-3 heads written as checkpoint folders in their published layouts
(config.json and model.safetensors with the names vLLM loads), for a given target."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.models.safetensors_io import save_file


def write_eagle_head(folder: str | Path, target_folder: str | Path, method: str, *, seed: int = 0,
                     draft_vocab_size: int | None = None, drop: tuple[str, ...] = (), fc_bias: bool = False,
                     **config_overrides) -> str:
    """A one-layer head for the target in ``target_folder``: EAGLE-1 (``layers.0.*``, ``fc [h, 2h]``)
    or EAGLE-3 (``midlayer.*``, ``fc [h, 3h]``, ``norm``, ``lm_head`` over ``draft_vocab_size`` tokens
    and ``d2t``, an increasing pick of target ids). ``drop``: tensor names left out."""
    target = json.loads((Path(target_folder) / "config.json").read_text())
    h, heads, kv_heads = target["hidden_size"], target["num_attention_heads"], target["num_key_value_heads"]
    d = target.get("head_dim") or h // heads
    inter, vocab = 2 * h, target["vocab_size"]
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    e3 = method == "eagle3"
    prefix = "midlayer." if e3 else "layers.0."
    qkv_in = 2 * h if e3 else h
    tensors = {
        "fc.weight": rand(h, 3 * h if e3 else 2 * h),
        f"{prefix}self_attn.q_proj.weight": rand(heads * d, qkv_in),
        f"{prefix}self_attn.k_proj.weight": rand(kv_heads * d, qkv_in),
        f"{prefix}self_attn.v_proj.weight": rand(kv_heads * d, qkv_in),
        f"{prefix}self_attn.o_proj.weight": rand(h, heads * d),
        f"{prefix}mlp.gate_proj.weight": rand(inter, h),
        f"{prefix}mlp.up_proj.weight": rand(inter, h),
        f"{prefix}mlp.down_proj.weight": rand(h, inter),
        f"{prefix}input_layernorm.weight": 1 + rand(h),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(h),
    }
    if fc_bias:
        tensors["fc.bias"] = rand(h)
    config = {"architectures": ["LlamaForCausalLMEagle3" if e3 else "LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": d, "num_hidden_layers": 1, "vocab_size": vocab,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "torch_dtype": "float32", "tie_word_embeddings": False}
    if e3:
        dv = draft_vocab_size or vocab
        picked = np.sort(rng.choice(vocab, dv, replace=False)).astype(np.int64)
        tensors.update({f"{prefix}hidden_norm.weight": 1 + rand(h), "norm.weight": 1 + rand(h),
                        "lm_head.weight": rand(dv, h), "d2t": picked - np.arange(dv), "t2d": np.zeros(vocab, np.bool_)})
        config["draft_vocab_size"] = dv
    config.update(config_overrides)
    for name in drop:
        tensors.pop(name)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, folder / "model.safetensors")
    return str(folder)


def make_near_pass_through(folder: str | Path) -> str:
    """Rewrite an EAGLE-1 head in ``folder`` so that its output stays near the target hidden state
    it reads (``fc`` near ``[0 | I]``, the MLP's output scaled down): its drafts then follow the
    target's own logits one position back, so that some are accepted."""
    from jaxserve.models.safetensors_io import SafetensorsFile

    file = SafetensorsFile(f"{folder}/model.safetensors")
    tensors = {name: np.array(file.get(name)) for name in file.keys()}
    del file
    h = tensors["fc.weight"].shape[0]
    tensors["fc.weight"] = (np.concatenate([np.zeros((h, h)), np.eye(h)], axis=1)
                            + 0.1 * tensors["fc.weight"]).astype(np.float32)
    tensors["layers.0.mlp.down_proj.weight"] *= 0.1
    save_file(tensors, f"{folder}/model.safetensors")
    return str(folder)
