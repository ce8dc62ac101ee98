"""Where an engine's start-up time went, phase by phase.

Phases, in the order they run: ``model`` (finding the files: a folder, a hub snapshot, or the demo
model, built on first use), ``weights`` (reading them into the model), ``runner`` (KV cache,
attention backend: the cpu kernel is built here on first use), ``compile`` (tracing and compiling
every step variant, or reading it from the persistent cache), ``first_runs`` (each variant run once
on padding) and ``tokenizer``. The compiled variants' own figures are in the runner's
``CompileStats``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator


@dataclasses.dataclass
class StartupTimes:
    """Seconds per phase, in the order the phases ran."""

    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def summary(self, num_variants: int, cached_variants: int) -> str:
        """One line: the total, then each phase (the compile phase with its variant counts)."""
        parts = []
        for name, seconds in self.phases.items():
            part = f"{name.replace('_', ' ')} {seconds:.1f} s"
            if name == "compile":
                part += f" ({num_variants} variants, {cached_variants} from the persistent cache)"
            parts.append(part)
        return f"engine ready in {self.total:.1f} s: " + ", ".join(parts)
