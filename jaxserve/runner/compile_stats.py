"""Counters of compilation work (variants compiled, seconds spent, persistent-cache hits) and of steps."""

from __future__ import annotations

import dataclasses
import threading

from jax import monitoring

_lock = threading.Lock()
_persistent_cache_hits = 0
_listener_installed = False


def _on_event(event: str, **kwargs) -> None:
    global _persistent_cache_hits
    if event == "/jax/compilation_cache/cache_hits":
        with _lock:
            _persistent_cache_hits += 1


def install_listener() -> None:
    global _listener_installed
    with _lock:
        if not _listener_installed:
            monitoring.register_event_listener(_on_event)
            _listener_installed = True


def persistent_cache_hits() -> int:
    return _persistent_cache_hits


@dataclasses.dataclass
class CompileStats:
    num_compiles: int = 0
    compile_seconds: float = 0.0
    persistent_cache_hits: int = 0
    unexpected_compiles: int = 0  # a shape outside the warm-up table: should stay 0
    compile_seconds_per_bucket: dict[str, float] = dataclasses.field(default_factory=dict)
    num_steps: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    device_wait_seconds: float = 0.0  # the host blocked on a step's sampled tokens

    @property
    def padding_ratio(self) -> float:
        """Share of computed token slots that were padding, over all steps."""
        return 0.0 if self.padded_tokens == 0 else 1.0 - self.real_tokens / self.padded_tokens

    def record_step(self, real: int, bucket: int) -> None:
        self.num_steps += 1
        self.real_tokens += real
        self.padded_tokens += bucket

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["padding_ratio"] = self.padding_ratio
        return d
