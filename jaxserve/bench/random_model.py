"""Random-weight checkpoints of a given shape for benchmarks (weights from :mod:`jaxserve.models.random_weights`).

The shapes are the presets of :mod:`.presets` (``cpu-bench``, ``qwen3-0.6b``, ``qwen3-8b``). The
folder is a normal HF checkpoint (config.json + model.safetensors) loaded through the real loader;
it has no tokenizer, so benchmarks feed token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxserve.bench.presets import preset_config
from jaxserve.models.config import ModelConfig
from jaxserve.models.random_weights import random_tensors
from jaxserve.models.safetensors_io import save_checkpoint_weights


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
