"""Compiling the runner's step: one program per variant, all compiled and warmed up at start-up.

A variant is a token bucket of the ``BucketTable`` plus whether the step is decode-only (the
Pallas backend has a decode kernel). Every variant is compiled before the first request, so no
request waits for a compile; a compile after warm-up is counted as unexpected. JAX's persistent
compilation cache makes the next start-up read the programs instead of compiling them.

Warm-up traces and lowers the variants one after another (Python, under the GIL) and hands each
lowered program to a thread pool: XLA compiles (or reads from the persistent cache) with the GIL
released, so compiles overlap the tracing of the next variants and, with cores to spare, each
other.

Variants that only save padding (the decode midpoints) may be deferred: warm-up returns without
them and, once the engine is ready, one background thread compiles them while it serves; until a
bucket's variants are all in, steps use the next larger bucket (``pending_buckets``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
from tqdm.auto import tqdm

from jaxserve.runner import compile_stats
from jaxserve.runner.compile_stats import CompileStats

logger = logging.getLogger("jaxserve")

# Tracing and lowering run one at a time, whichever thread asks (warm-up lowers in its own thread;
# scripts/gpu_aot_check.py from several): jax-triton builds its kernels with Python's ast while
# lowering, which is not thread-safe ("AST constructor recursion depth mismatch").
_LOWERING_LOCK = threading.Lock()


def enable_persistent_compilation_cache(cache_dir: str | None) -> None:
    """Point JAX's persistent compilation cache at ``cache_dir`` (process-wide setting).

    JAX opens its cache once per process; a later engine asking for another folder gets the
    cache re-initialised so its programs really land there.
    """
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    previous = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # a flag jax's stubs do not list
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
    # LoRA: the step applies the adapters' slot table (some token has an adapter); a LoRA-enabled
    # engine's base-only steps run the variant without it, the plain engine's program.
    lora: bool = False
    # Images: the step replaces the embeddings of its image placeholder tokens with encoder
    # outputs (an input with a mask); a vision model's text-only steps run the variant without it.
    mm: bool = False

    @property
    def name(self) -> str:
        sampler = {None: "", True: "-greedy", False: "-random"}[self.all_greedy]
        return (f"{self.bucket}{'-decode' if self.decode_only else ''}{sampler}{'-lora' if self.lora else ''}"
                f"{'-mm' if self.mm else ''}")


# A variant's trace arguments: the positional arguments (abstract where possible) and the static
# keywords of the jitted step.
TraceArgs = Callable[[StepVariant], tuple[tuple, dict[str, Any]]]


class CompiledSteps:
    """The compiled executables of one jitted step function, by variant.

    Invariants: after ``warm_up``, ``stats.unexpected_compiles`` counts every variant compiled
    on demand (a shape outside the table; it should stay 0). A bucket is in ``pending_buckets``
    from ``warm_up`` until every deferred variant of it is compiled, and only then.
    """

    def __init__(self, jitted: Any, trace_args: TraceArgs, stats: CompileStats):
        self._jitted = jitted
        self._trace_args = trace_args
        self._compiled: dict[StepVariant, Any] = {}
        self.stats = stats
        self.warmed_up = False
        self.pending_buckets: set[int] = set()
        self._deferred: list[StepVariant] = []
        self._background: threading.Thread | None = None
        self._stop = threading.Event()
        compile_stats.install_listener()

    def get(self, variant: StepVariant) -> Any:
        """The variant's executable. A deferred one still compiling is waited for (steps never ask
        for one; inspection may), any other missing one compiled now."""
        if variant not in self._compiled and variant in self._deferred:
            self.wait_for_deferred()
        if variant not in self._compiled:
            self._compile(variant)
            self.stats.unexpected_compiles += self.warmed_up and variant not in self._deferred
        return self._compiled[variant]

    def traced(self, variant: StepVariant) -> Any:
        """The variant's traced program (``.jaxpr``, ``.lower()``; for inspection, compiles nothing)."""
        args, static = self._trace_args(variant)
        with _LOWERING_LOCK:
            return self._jitted.trace(*args, **static)

    def lowered(self, variant: StepVariant, traced: Any = None) -> Any:
        """The variant's lowered program (for inspection; compiles nothing), from ``traced`` when
        given (the same variant's ``traced``)."""
        traced = traced if traced is not None else self.traced(variant)
        with _LOWERING_LOCK:
            return traced.lower()

    def _lower_timed(self, variant: StepVariant) -> Any:
        """``lowered``, its seconds added to ``stats.lower_seconds``."""
        start = time.perf_counter()
        lowered = self.lowered(variant)
        self.stats.lower_seconds += time.perf_counter() - start
        return lowered

    def _compile(self, variant: StepVariant) -> None:
        self._record(variant, *_compile_lowered(self._lower_timed(variant)))

    def _record(self, variant: StepVariant, executable: Any, seconds: float, cache_hit: bool) -> None:
        self._compiled[variant] = executable
        self.stats.num_compiles += 1
        self.stats.compile_seconds += seconds
        self.stats.compile_seconds_per_bucket[variant.name] = seconds
        if cache_hit:
            self.stats.persistent_cache_hits += 1
            self.stats.cached_variants.append(variant.name)
        logger.debug("step variant %s: %s in %.2f s", variant.name,
                     "read from the persistent cache" if cache_hit else "compiled", seconds)

    def warm_up(self, variants: list[StepVariant], run_padding: Callable[[StepVariant], None],
                show_progress: bool, max_workers: int | None = None,
                deferred: list[StepVariant] | None = None) -> None:
        """Compile every variant (``max_workers`` at once, default :func:`default_compile_threads`),
        then run each once on padding: a program's first run pays one-time costs (its buffers'
        first allocation and page faults) that would otherwise land on the first requests; vLLM's
        dummy runs at start-up do the same. The ``deferred`` variants are left pending for
        :meth:`start_deferred` (no first run: it would race the engine's steps for the donated
        state)."""
        todo = [v for v in variants if v not in self._compiled]
        start = time.perf_counter()
        workers = max(1, min(len(todo), max_workers or default_compile_threads()))
        self.stats.compile_threads = workers
        with ThreadPoolExecutor(workers, thread_name_prefix="jaxserve-compile") as pool, \
                tqdm(total=len(todo), desc="Compiling step variants", disable=not show_progress,
                     unit="variant") as bar:
            futures = []
            for variant in todo:
                future = pool.submit(_compile_lowered, self._lower_timed(variant))
                future.add_done_callback(lambda _: bar.update())
                futures.append((variant, future))
            for variant, future in futures:
                self._record(variant, *future.result())
        self.stats.warm_up_compile_seconds += time.perf_counter() - start
        start = time.perf_counter()
        for variant in variants:
            run_padding(variant)
        self.stats.warm_up_run_seconds += time.perf_counter() - start
        self.warmed_up = True
        self._deferred = [v for v in deferred or [] if v not in self._compiled]
        self.pending_buckets = {v.bucket for v in self._deferred}

    def start_deferred(self) -> None:
        """Compile the deferred variants in a background thread. Called once the engine is ready,
        not from warm-up: tracing holds the GIL and would slow what start-up still does."""
        if not self._deferred or self._background is not None:
            return
        self._background = threading.Thread(target=self._compile_deferred, args=(self._deferred,),
                                            name="jaxserve-compile-deferred", daemon=True)
        _BACKGROUND.add(self)
        self._background.start()

    def _compile_deferred(self, deferred: list[StepVariant]) -> None:
        """Compile bucket by bucket, smallest first; a bucket leaves ``pending_buckets`` once all
        its variants are in. A failure is logged and leaves the bucket pending (steps keep using
        the next larger one), never reaches a request."""
        start = time.perf_counter()
        try:
            self._compile_buckets(deferred)
        finally:
            _BACKGROUND.discard(self)
        self.stats.background_compile_seconds = time.perf_counter() - start
        logger.info("%d deferred step variants compiled in the background in %.1f s",
                    self.stats.background_compiles, self.stats.background_compile_seconds)

    def _compile_buckets(self, deferred: list[StepVariant]) -> None:
        for bucket in sorted(self.pending_buckets):
            try:
                for variant in (v for v in deferred if v.bucket == bucket and v not in self._compiled):
                    if self._stop.is_set():
                        return
                    self._compile(variant)
                    self.stats.background_compiles += 1
            except Exception:  # the engine serves on without this bucket
                logger.exception("compiling deferred bucket %d failed; its steps use the next bucket", bucket)
                continue
            # a new set, so a step reading the old one never sees it change
            self.pending_buckets = self.pending_buckets - {bucket}

    def wait_for_deferred(self, timeout: float | None = None) -> bool:
        """Block until the background compiles are done; False if ``timeout`` ran out first."""
        if self._background is not None:
            self._background.join(timeout)
            return not self._background.is_alive()
        return True

    def stop_background(self) -> None:
        """Stop after the compile in progress (at engine shutdown and interpreter exit)."""
        self._stop.set()
        self.wait_for_deferred()


# Background compilers still running; stopped at exit so no XLA compile runs while the
# interpreter tears down.
_BACKGROUND: set[CompiledSteps] = set()


def _stop_all_background() -> None:
    for steps in list(_BACKGROUND):
        steps.stop_background()


# Stopped at the start of interpreter exit, before any atexit handler: weakref's handler (registered
# once the first trace has run, so it runs before ours would) calls every pending finalizer, and
# JAX's tracer finalizers then drop the constants of a trace still in progress in the background
# thread (its lowering fails with a KeyError). concurrent.futures stops its workers the same way.
threading._register_atexit(_stop_all_background)  # type: ignore[attr-defined]  # private, Python 3.9+


def default_compile_threads() -> int:
    """Half the CPU cores: one XLA compile already keeps about two cores busy, so on a 2-core CPU
    a second compile at once only slows the first (docs/benchmarks.md); tracing the next variants
    still overlaps the one compile."""
    return max(1, (os.cpu_count() or 1) // 2)


def _compile_lowered(lowered: Any) -> tuple[Any, float, bool]:
    """Compile (or read from the persistent cache) in the calling thread: the executable, the
    seconds it took and whether it came from the cache."""
    hits = compile_stats.thread_persistent_cache_hits()
    start = time.perf_counter()
    executable = lowered.compile()
    return executable, time.perf_counter() - start, compile_stats.thread_persistent_cache_hits() > hits
