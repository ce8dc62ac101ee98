"""Adapters loaded in host memory, at most ``max_cpu_loras``, the least recently used evicted.

Keyed by name; :meth:`get` reloads a name whose folder was replaced on disk (another digest), so
the caller's prefix-cache key (``name@digest``) follows the weights actually served.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from jaxserve.models.config import ModelConfig
from jaxserve.models.lora_adapter import LoRAAdapter, load_lora_adapter


class LoRAAdapterCache:
    def __init__(self, cfg: ModelConfig, max_cpu_loras: int, max_lora_rank: int):
        self.cfg, self.max_cpu_loras, self.max_lora_rank = cfg, max_cpu_loras, max_lora_rank
        self._adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.loads = 0  # folders read (a hit reads nothing)

    def get(self, name: str, path: str | Path, *, reload: bool = False) -> LoRAAdapter:
        adapter = self._adapters.get(name)
        if adapter is None or reload or adapter.path != str(Path(path)):
            adapter = load_lora_adapter(path, self.cfg, self.max_lora_rank)
            self.loads += 1
            self._adapters[name] = adapter
        self._adapters.move_to_end(name)
        while len(self._adapters) > self.max_cpu_loras:
            self._adapters.popitem(last=False)
        return adapter

    def remove(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None

    def names(self) -> list[str]:
        return list(self._adapters)
