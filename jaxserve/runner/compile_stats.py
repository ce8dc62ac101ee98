"""Counters of compilation work (variants compiled, seconds spent, persistent-cache hits) and of steps."""

from __future__ import annotations

import dataclasses
import threading

from jax import monitoring

_lock = threading.Lock()
_listener_installed = False
# JAX reports a hit in the thread that compiles, so a per-thread count tells which of several
# programs compiled at once came from the cache.
_per_thread = threading.local()


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _per_thread.hits = getattr(_per_thread, "hits", 0) + 1


def install_listener() -> None:
    global _listener_installed
    with _lock:
        if not _listener_installed:
            monitoring.register_event_listener(_on_event)
            _listener_installed = True


def thread_persistent_cache_hits() -> int:
    """Persistent-cache hits of compiles run by the calling thread."""
    return getattr(_per_thread, "hits", 0)


@dataclasses.dataclass
class CompileStats:
    num_compiles: int = 0
    compile_seconds: float = 0.0  # summed over variants (several compile at once at warm-up)
    persistent_cache_hits: int = 0
    unexpected_compiles: int = 0  # a shape outside the warm-up table: should stay 0
    compile_seconds_per_bucket: dict[str, float] = dataclasses.field(default_factory=dict)
    cached_variants: list[str] = dataclasses.field(default_factory=list)  # read from the persistent cache
    lower_seconds: float = 0.0  # tracing and lowering to StableHLO, before each compile
    warm_up_compile_seconds: float = 0.0  # wall time of warm-up's tracing and compiling
    compile_threads: int = 0  # XLA compiles running at once during warm-up
    warm_up_run_seconds: float = 0.0  # the first run of each variant, on padding
    background_compiles: int = 0  # deferred variants compiled after warm-up, while serving
    background_compile_seconds: float = 0.0  # wall time until the last of them was in
    num_steps: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    device_wait_seconds: float = 0.0  # the host blocked on a step's sampled tokens
    # MoE: routed (token, expert) pairs per expert over all steps (layers summed); None for a dense model.
    expert_routed: list[int] | None = None

    @property
    def padding_ratio(self) -> float:
        """Share of computed token slots that were padding, over all steps."""
        return 0.0 if self.padded_tokens == 0 else 1.0 - self.real_tokens / self.padded_tokens

    def record_step(self, real: int, bucket: int) -> None:
        self.num_steps += 1
        self.real_tokens += real
        self.padded_tokens += bucket

    def record_expert_load(self, load: list[int]) -> None:
        """One step's routed pairs per expert, added to the totals."""
        totals = self.expert_routed
        self.expert_routed = list(load) if totals is None else [a + b for a, b in zip(totals, load)]

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("expert_routed")  # a list per expert: /metrics has it, by expert
        d["padding_ratio"] = self.padding_ratio
        return d
