"""Where the compiled step's time goes, per XLA operation (fusion, dot, loop), from a JAX trace.

``jaxserve bench throughput --profile-ops N`` wraps the timed ``generate`` in ``jax.profiler``
and sums the device-side events by operation name. On the CPU the events exist only when XLA is
asked for them (``--xla_cpu_enable_xprof_traceme``), so :func:`request_cpu_op_events` must run
before the backend starts. The trace is read back with JAX's own xplane reader, a private module:
when it is missing the profile says so instead of failing the benchmark.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import tempfile
from typing import Any

TRACEME_FLAG = "--xla_cpu_enable_xprof_traceme=true"
# Host-side bookkeeping of the runtime, not operations of the program.
_NOT_OPS = ("ThunkExecutor", "SlinkyThreadPool", "end: ")


def request_cpu_op_events() -> None:
    """Ask XLA:CPU to emit one trace event per operation (read when the backend starts)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if TRACEME_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {TRACEME_FLAG}".strip()


def _op_lines(plane_name: str, line_name: str) -> bool:
    # CPU: the runtime's worker threads; GPU: the per-stream "XLA Ops" lines of the device plane.
    return "XLAEigen" in line_name or (plane_name.startswith("/device:") and "XLA Ops" in line_name)


@contextlib.contextmanager
def trace_ops(result: dict[str, Any], top: int, num_steps_of=lambda: 0):
    """Trace the block and fill ``result`` with time per operation family (``by_kind``) and the
    ``top`` operations. Times are self times: a ``while`` keeps only what its body's operations
    on the same thread do not account for (loop control, and waits for work on other threads).
    An operation is named within its program (one per bucket), so ``top`` rows carry the program
    id and how many times it ran."""
    import jax

    folder = tempfile.mkdtemp(prefix="jaxserve-trace-")
    jax.profiler.start_trace(folder)
    try:
        yield
    finally:
        jax.profiler.stop_trace()
        result.update(summarize(folder, top, num_steps_of()))


def summarize(folder: str, top: int, num_steps: int) -> dict[str, Any]:
    try:
        from jax._src.lib import _profile_data  # private: the xplane reader JAX's tests use
    except ImportError as e:
        return {"unavailable": f"no xplane reader in this jaxlib ({e})"}
    paths = sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        return {"unavailable": "the profiler wrote no trace"}
    total = collections.Counter()  # (program, op) -> ns
    calls = collections.Counter()
    runs = collections.defaultdict(set)  # program -> run ids: tells a bucket's program by its count
    for plane in _profile_data.ProfileData.from_file(paths[-1]).planes:
        for line in plane.lines:
            if not _op_lines(plane.name, line.name):
                continue
            events = sorted((e for e in line.events if not e.name.startswith(_NOT_OPS)),
                            key=lambda e: (e.start_ns, -e.duration_ns))
            open_events: list[tuple[int, tuple]] = []  # (end, key) of the enclosing events
            for event in events:
                stats = dict(event.stats)
                key = (stats.get("program_id", -1), event.name)  # op names repeat across programs
                while open_events and open_events[-1][0] <= event.start_ns:
                    open_events.pop()
                if open_events:  # a loop's body op: count its time once, as its own
                    total[open_events[-1][1]] -= event.duration_ns
                total[key] += event.duration_ns
                calls[key] += 1
                runs[key[0]].add(stats.get("run_id"))
                open_events.append((event.start_ns + event.duration_ns, key))
    if not total:
        return {"unavailable": "no operation events (on CPU, XLA_FLAGS needs " + TRACEME_FLAG + ")"}
    busy = sum(total.values())
    by_kind = collections.Counter()
    for (_, name), ns in total.items():
        by_kind[op_kind(name)] += ns
    return {
        "op_busy_ms": busy / 1e6,  # summed over threads/streams: can exceed wall time
        "num_steps": num_steps,
        "by_kind": {kind: {"ms": ns / 1e6, "share": ns / busy} for kind, ns in by_kind.most_common()},
        "top": [{"op": name, "program": program, "program_runs": len(runs[program]), "ms": ns / 1e6,
                 "share": ns / busy, "calls": calls[(program, name)]}
                for (program, name), ns in total.most_common(top)],
    }


def op_kind(name: str) -> str:
    """An operation's family: its name without the instance number (``ynn_fusion.17`` -> ``ynn_fusion``)."""
    base, _, suffix = name.rpartition(".")
    return base if base and suffix.isdigit() else name
