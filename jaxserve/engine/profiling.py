"""Profiling a workload with ``jax.profiler``: ``LLM.start_profile()`` ... ``LLM.stop_profile()``.

Between the two calls JAX records every host thread's Python and runtime events and every XLA
program's execution, into ``<log_dir>/plugins/profile/<run>/``: a ``*.xplane.pb`` that
TensorBoard's profile plugin opens (``tensorboard --logdir <log_dir>``) and a
``perfetto_trace.json.gz`` that opens at the Perfetto UI (drag the file in). ``Profile`` finds
those files and sums the trace's events per thread, for a first look without a viewer.

Invariant: one trace at a time per process (a JAX limit); a second ``start`` raises.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from jaxserve import envs

PERFETTO_FILE = "perfetto_trace.json.gz"


@dataclasses.dataclass(frozen=True)
class Profile:
    """A finished trace: the folder given to the profiler and the files this run wrote."""

    log_dir: Path  # what TensorBoard's --logdir takes
    run_dir: Path  # plugins/profile/<run>: this run's files
    perfetto_trace: Path | None  # opens in the Perfetto UI (None if JAX wrote none)
    xplane: Path | None  # opens in TensorBoard's profile plugin

    def events(self) -> list[dict[str, Any]]:
        """The trace's complete events (``ph == "X"``) with their thread names added as ``thread``."""
        if self.perfetto_trace is None:
            return []
        with gzip.open(self.perfetto_trace, "rt", encoding="utf-8") as f:
            trace = json.load(f)
        raw = trace["traceEvents"] if isinstance(trace, dict) else trace
        names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in raw
                 if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e}
        return [dict(e, thread=names.get((e.get("pid"), e.get("tid")), str(e.get("tid"))))
                for e in raw if e.get("ph") == "X"]

    def seconds_by_thread(self) -> dict[str, float]:
        """Per thread, the summed duration of its top-level events (nested ones not counted twice)."""
        by_thread: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for e in self.events():
            by_thread[e["thread"]].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
        return {thread: _covered_us(spans) / 1e6 for thread, spans in by_thread.items()}


def _covered_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` spans (microseconds)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class Profiler:
    """Starts and stops one ``jax.profiler`` trace."""

    def __init__(self) -> None:
        self._log_dir: Path | None = None
        self._before: set[Path] = set()
        self._started = 0.0

    @property
    def running(self) -> bool:
        return self._log_dir is not None

    def start(self, log_dir: str | None = None) -> Path:
        """Begin tracing into ``log_dir`` (default :func:`jaxserve.envs.profiler_dir`); returns it."""
        import jax

        if self.running:
            raise RuntimeError(f"a profile is already being recorded into {self._log_dir}")
        folder = Path(log_dir).expanduser() if log_dir else envs.profiler_dir()
        folder.mkdir(parents=True, exist_ok=True)
        self._before = set(_run_dirs(folder))
        self._started = time.time()
        jax.profiler.start_trace(str(folder), create_perfetto_trace=True)
        self._log_dir = folder
        return folder

    def stop(self) -> Profile:
        """End the trace, wait for its files, and describe them."""
        import jax

        if self._log_dir is None:
            raise RuntimeError("no profile is being recorded (call start_profile first)")
        folder, self._log_dir = self._log_dir, None
        jax.profiler.stop_trace()
        # A run folder is named by the second it began: a second run in the same second reuses it.
        written = [p for p in _run_dirs(folder) if p not in self._before or _last_write(p) >= self._started]
        if not written:
            raise RuntimeError(f"jax.profiler wrote no run folder under {folder}")
        run = max(written, key=_last_write)
        perfetto = run / PERFETTO_FILE
        xplane = next(iter(sorted(run.glob("*.xplane.pb"))), None)
        return Profile(folder, run, perfetto if perfetto.is_file() else None, xplane)


def _last_write(run_dir: Path) -> float:
    """When a file of ``run_dir`` was last written (a folder's own time misses rewritten files)."""
    return max((f.stat().st_mtime for f in run_dir.iterdir() if f.is_file()), default=run_dir.stat().st_mtime)


def _run_dirs(log_dir: Path) -> list[Path]:
    root = log_dir / "plugins" / "profile"
    return [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
