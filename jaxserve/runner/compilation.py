"""Compiling the runner's step: one program per variant, all compiled and warmed up at start-up.

A variant is a token bucket of the ``BucketTable`` plus whether the step is decode-only (the
Pallas backend has a decode kernel). Every variant is compiled before the first request, so no
request waits for a compile; a compile after warm-up is counted as unexpected. JAX's persistent
compilation cache makes the next start-up read the programs instead of compiling them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import jax
from tqdm.auto import tqdm

from jaxserve.runner import compile_stats
from jaxserve.runner.compile_stats import CompileStats

logger = logging.getLogger("jaxserve")

# Tracing and lowering run one at a time, compiles concurrently: lowering is short next to the
# compile, and jax-triton builds its kernels with Python's ast while lowering, which is not
# thread-safe ("AST constructor recursion depth mismatch" under concurrent warm-up).
_LOWERING_LOCK = threading.Lock()


def enable_persistent_compilation_cache(cache_dir: Optional[str]) -> None:
    """Point JAX's persistent compilation cache at ``cache_dir`` (process-wide setting).

    JAX opens its cache once per process; a later engine asking for another folder gets the
    cache re-initialised so its programs really land there.
    """
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    if previous and previous != cache_dir:
        try:
            from jax._src import compilation_cache as _cc

            _cc.reset_cache()
        except (ImportError, AttributeError):  # private API; the folder change then waits for a restart
            logger.warning("compilation cache already open at %s; %s takes effect on restart", previous, cache_dir)
    # Small programs are never cached otherwise, and ours are small on CPU.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclasses.dataclass(frozen=True)
class StepVariant:
    bucket: int  # padded token count
    decode_only: bool = False  # every request advances one token (the decode kernel's case)
    # The GPU step's sampler, chosen by the host: True = every row greedy, False = some row draws.
    # None: the sampler decides on the device (the CPU step, with conds).
    all_greedy: bool | None = None

    @property
    def name(self) -> str:
        sampler = {None: "", True: "-greedy", False: "-random"}[self.all_greedy]
        return f"{self.bucket}{'-decode' if self.decode_only else ''}{sampler}"


# A variant's trace arguments: the positional arguments (abstract where possible) and the static
# keywords of the jitted step.
TraceArgs = Callable[[StepVariant], tuple[tuple, dict[str, Any]]]


class CompiledSteps:
    """The compiled executables of one jitted step function, by variant.

    Invariant: after ``warm_up``, ``stats.unexpected_compiles`` counts every variant compiled
    on demand (a shape outside the table; it should stay 0).
    """

    def __init__(self, jitted: Any, trace_args: TraceArgs, stats: CompileStats):
        self._jitted = jitted
        self._trace_args = trace_args
        self._compiled: dict[StepVariant, Any] = {}
        self.stats = stats
        self.warmed_up = False
        self._stats_lock = threading.Lock()
        compile_stats.install_listener()

    def get(self, variant: StepVariant) -> Any:
        if variant not in self._compiled:
            self._compile(variant)
            self.stats.unexpected_compiles += self.warmed_up
        return self._compiled[variant]

    def lowered(self, variant: StepVariant) -> Any:
        """The variant's lowered program (for inspection; compiles nothing)."""
        args, static = self._trace_args(variant)
        with _LOWERING_LOCK:
            return self._jitted.trace(*args, **static).lower()

    def _compile(self, variant: StepVariant) -> None:
        hits_before = compile_stats.persistent_cache_hits()
        self._compile_only(variant)
        self.stats.persistent_cache_hits += compile_stats.persistent_cache_hits() - hits_before

    def _compile_only(self, variant: StepVariant) -> None:
        start = time.perf_counter()
        compiled = self.lowered(variant).compile()
        seconds = time.perf_counter() - start
        with self._stats_lock:  # warm-up compiles from several threads
            self._compiled[variant] = compiled
            self.stats.num_compiles += 1
            self.stats.compile_seconds += seconds
            self.stats.compile_seconds_per_bucket[variant.name] = seconds

    def warm_up(self, variants: list[StepVariant], run_padding: Callable[[StepVariant], None],
                show_progress: bool, workers: int | None = None) -> None:
        """Compile every variant, ``workers`` at a time (default: half the cores; XLA's compile
        releases the GIL), then run each once on padding: a program's first run pays one-time
        costs (its buffers' first allocation and page faults) that would otherwise land on the
        first requests; vLLM's dummy runs at start-up do the same."""
        workers = workers or max(1, (os.cpu_count() or 1) // 2)
        todo = [v for v in variants if v not in self._compiled]
        hits_before = compile_stats.persistent_cache_hits()
        progress = tqdm(total=len(variants), desc="Compiling step buckets", disable=not show_progress, unit="variant")
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for future in concurrent.futures.as_completed([pool.submit(self._compile_only, v) for v in todo]):
                future.result()
                progress.update()
        self.stats.persistent_cache_hits += compile_stats.persistent_cache_hits() - hits_before
        for variant in variants:
            run_padding(variant)
        progress.update(len(variants) - len(todo))
        progress.close()
        self.warmed_up = True
