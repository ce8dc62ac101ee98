"""Ragged paged attention as a C++ kernel called through XLA's FFI: the engine's ``cpu`` backend.

On the CPU, XLA can only express paged attention as a gather of pages into a new array followed
by small batched dots (:mod:`.xla_attention`); in a decode step that gather's memory traffic is
most of the attention time. ``csrc/paged_attention_cpu.cc`` reads each K/V row from its page
once per work item and keeps scores and the online softmax in cache-sized scratch, spreading work
items over XLA's own intra-op threads.

The library is built on first use with the system C++ compiler (``$CXX``, else ``g++``) into a
build folder (the caller's, else :func:`default_build_dir`) under a name that hashes the source,
the flags, jaxlib's version and the CPU (``-march=native``), so an upgrade or another machine
never loads a stale build. When no compiler
is found or the build fails, :func:`cpu_attention_available` says why and ``auto`` picks ``xla``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ._common import check_options, check_shapes

TARGET = "jaxserve_paged_attention_cpu"
SYMBOL = "JaxservePagedAttentionCpu"
SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cc"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
DTYPES = (jnp.float32, jnp.bfloat16)

_lock = threading.Lock()
_build_lock = threading.Lock()  # one compiler run per process: a second caller waits, then finds the file
_state: dict[str, object] = {}  # "registered": True, or "error": the reason it cannot be


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def default_build_dir() -> Path:
    """``$XDG_CACHE_HOME/pallas_kernels`` (``~/.cache/pallas_kernels``); jaxserve passes its own."""
    return Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "pallas_kernels"


def library_path(compiler: str, build_dir: Path) -> Path:
    """Where the build for this source, compiler, jaxlib and CPU lives."""
    import jaxlib

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
                 jaxlib.__version__.encode(), _cpu_identity().encode()):
        key.update(part)
    return build_dir / f"paged_attention_cpu-{key.hexdigest()[:16]}.so"


def build_library(build_dir: Path | None = None) -> Path:
    """Compile the kernel unless this exact build exists; returns the shared library's path."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError(f"no C++ compiler found (looked for {os.environ.get('CXX', 'g++')!r}; set CXX)")
    target = library_path(compiler, build_dir or default_build_dir())
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{' '.join(cmd)}\n{done.stderr[-4000:]}")
        os.replace(partial, target)  # atomic: a concurrent builder finds a whole file or none
    return target


def prebuild(build_dir: Path | None = None) -> None:
    """Build the library now unless it exists, for a background thread started early: the compiler
    then runs while the caller loads its model. A failure is left for :func:`register` to report."""
    try:
        _build_once(build_dir)
    except RuntimeError:
        pass


def _build_once(build_dir: Path | None) -> Path:
    with _build_lock:
        return build_library(build_dir)


def register(build_dir: Path | None = None) -> None:
    """Build (once per machine) and register the FFI target with XLA (once per process)."""
    with _lock:
        if _state.get("registered"):
            return
        if "error" in _state:
            raise RuntimeError(_state["error"])
        try:
            lib = ctypes.cdll.LoadLibrary(str(_build_once(build_dir)))
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="cpu")
        except (RuntimeError, OSError, AttributeError) as e:
            _state["error"] = str(e)
            raise RuntimeError(_state["error"]) from e
        _state["registered"] = True


def cpu_attention_available(build_dir: Path | None = None) -> tuple[bool, str]:
    """(True, "") when the kernel is built (into ``build_dir``) and registered, else (False, the reason)."""
    if jax.default_backend() != "cpu":
        return False, f"the default JAX backend is {jax.default_backend()}, not cpu"
    try:
        register(build_dir)
    except RuntimeError as e:
        return False, str(e)
    return True, ""


def ragged_paged_attention_cpu(
    q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    interpret: bool = False,
):
    """The contract of :mod:`pallas_kernels`, computed by the C++ kernel on the CPU."""
    del interpret
    check_options(sliding_window, soft_cap)
    check_shapes(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc)
    if (q.dtype not in DTYPES or k_cache.dtype not in (q.dtype, jnp.float8_e4m3fn)
            or v_cache.dtype != k_cache.dtype):
        raise ValueError(f"the cpu attention backend takes float32 or bfloat16 q, and k_cache/v_cache of q's "
                         f"dtype or float8_e4m3fn, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    register()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = jnp.int32
    return call(
        q, k_cache, v_cache, kv_lens.astype(i32), block_tables.astype(i32), query_start_loc.astype(i32),
        jnp.asarray(num_seqs, i32).reshape(1),
        sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )
