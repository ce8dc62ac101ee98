"""GPU targets described without a GPU: the ``GpuTargetConfig`` text protos in ``targets/`` and what
the roofline and the KV sizing read of them. Imports neither jax nor the engine, so the command
line can list the GPUs without loading jax."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

TARGETS_DIR = Path(__file__).with_name("targets")
# Dense bf16 tensor-core peak (NVIDIA's H100/H200 SXM figure); the target config has no such field.
BF16_PEAK_FLOPS = {"h200": 989.4e12}


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What the roofline and the KV sizing need of a GPU, read from its target config."""

    name: str
    description: str
    memory_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    sm_count: int


def target_config_path(gpu: str) -> Path:
    return TARGETS_DIR / f"{gpu}_target_config.txtpb"


def _field(text: str, name: str) -> str:
    match = re.search(rf"\b{name}:\s*\"?([^\"\n]+)\"?", text)
    if match is None:
        raise ValueError(f"target config has no {name}")
    return match.group(1)


def gpu_spec(gpu: str, text: str) -> GpuSpec:
    return GpuSpec(name=gpu, description=_field(text, "device_description_str"),
                   memory_bytes=int(_field(text, "device_memory_size")),
                   hbm_bytes_per_s=float(_field(text, "memory_bandwidth")),
                   bf16_flops=BF16_PEAK_FLOPS[gpu], sm_count=int(_field(text, "core_count")))
