"""Adapters loaded in host memory, at most ``max_cpu_loras``, the least recently used evicted.

Keyed by name; :meth:`get` reloads a name whose folder changed on disk (another path, or a file
with another size or modification time), so the caller's prefix-cache key (``name@digest``)
follows the weights actually served: a reload under the same name never reuses stale KV.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from jaxserve.models.config import ModelConfig
from jaxserve.models.lora_adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapter, load_lora_adapter


def _signature(path: Path) -> tuple:
    """What tells a rewritten adapter folder apart without reading it (one stat per file)."""
    out: list = [str(path)]
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (path / name).stat()
            out += [st.st_size, st.st_mtime_ns, st.st_ino]
        except OSError:
            out.append(None)
    return tuple(out)


class LoRAAdapterCache:
    def __init__(self, cfg: ModelConfig, max_cpu_loras: int, max_lora_rank: int):
        self.cfg, self.max_cpu_loras, self.max_lora_rank = cfg, max_cpu_loras, max_lora_rank
        self._adapters: OrderedDict[str, tuple[tuple, LoRAAdapter]] = OrderedDict()
        self.loads = 0  # folders read (a hit reads nothing)
        self._lock = threading.Lock()  # the server's input threads resolve adapters concurrently

    def get(self, name: str, path: str | Path, *, reload: bool = False) -> LoRAAdapter:
        with self._lock:
            return self._get(name, path, reload)

    def _get(self, name: str, path: str | Path, reload: bool) -> LoRAAdapter:
        sig = _signature(Path(path))
        held = self._adapters.get(name)
        if held is None or reload or held[0] != sig:
            # LM-head and embedding pairs are read too: the engine checks them against its slot tables.
            adapter = load_lora_adapter(path, self.cfg, self.max_lora_rank, allow_lm_head=True, allow_embedding=True)
            self.loads += 1
            self._adapters[name] = (sig, adapter)
        else:
            adapter = held[1]
        self._adapters.move_to_end(name)
        while len(self._adapters) > self.max_cpu_loras:
            self._adapters.popitem(last=False)
        return adapter

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._adapters.pop(name, None) is not None

    def names(self) -> list[str]:
        return list(self._adapters)
