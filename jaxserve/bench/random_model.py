"""Random-weight checkpoints of a given shape for benchmarks (weights from :mod:`jaxserve.models.random_weights`).

Presets name the shapes the issues benchmark: ``cpu-bench`` (small Qwen3 for the CPU throughput
target), ``qwen3-0.6b`` and ``qwen3-8b`` (those models' shapes in bfloat16, for the GPU). The
folder is a normal HF checkpoint (config.json + model.safetensors) loaded through the real loader;
it has no tokenizer, so benchmarks feed token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxserve.models.config import ModelConfig
from jaxserve.models.random_weights import random_tensors
from jaxserve.models.safetensors_io import save_checkpoint_weights

PRESETS = {
    "cpu-bench": dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32, intermediate_size=768, tie_word_embeddings=True,
                      dtype="float32", max_position_embeddings=2048),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
                       dtype="bfloat16", max_position_embeddings=40960),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, tie_word_embeddings=False,
                     dtype="bfloat16", max_position_embeddings=40960),
}


def preset_config(preset: str) -> dict:
    """The ``config.json`` of a preset (a Qwen3 of that shape)."""
    shape = PRESETS[preset]
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "torch_dtype": shape["dtype"], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", **{k: v for k, v in shape.items() if k != "dtype"}}


def build_random_checkpoint(folder: str | Path, preset: str, seed: int = 0) -> Path:
    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = preset_config(preset)
    cfg = ModelConfig.from_dict(config)
    save_checkpoint_weights(random_tensors(cfg, seed=seed, std=0.02), folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
