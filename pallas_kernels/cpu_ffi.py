"""C++ kernels for the CPU, built on first use and registered with XLA's FFI.

A :class:`CpuFfiKernel` is one source file in ``csrc/`` exporting one handler symbol. It is
compiled with the system C++ compiler (``$CXX``, else ``g++``) into a build folder (the caller's,
else :func:`default_build_dir`) under a name that hashes the source, the flags, the compiler,
jaxlib's version and the CPU (``-march=native``), so an upgrade or another machine never loads a
stale build; one compiler run per process and kernel (a second caller waits, then finds the
file), and the library is renamed into place atomically, so concurrent processes see a whole file
or none.
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

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
CSRC = Path(__file__).parent / "csrc"


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


class CpuFfiKernel:
    """One C++ source, its build and its registration as the FFI target ``target``."""

    def __init__(self, source: str, target: str, symbol: str):
        self.source = CSRC / source
        self.target = target
        self.symbol = symbol
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._state: dict[str, object] = {}  # "registered": True, or "error": why it cannot be

    def library_path(self, compiler: str, build_dir: Path) -> Path:
        """Where the build for this source, compiler, jaxlib and CPU lives."""
        import jaxlib

        key = hashlib.sha256()
        for part in (self.source.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
                     jaxlib.__version__.encode(), _cpu_identity().encode()):
            key.update(part)
        return build_dir / f"{self.source.stem}-{key.hexdigest()[:16]}.so"

    def build_library(self, build_dir: Path | None = None) -> Path:
        """Compile unless this exact build exists; the shared library's path."""
        compiler = shutil.which(os.environ.get("CXX", "g++"))
        if compiler is None:
            raise RuntimeError(f"no C++ compiler found (looked for {os.environ.get('CXX', 'g++')!r}; set CXX)")
        target = self.library_path(compiler, build_dir or default_build_dir())
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = Path(tmp) / target.name
            cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(self.source), "-o", str(partial)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building {self.source.name} failed:\n{' '.join(cmd)}\n{done.stderr[-4000:]}")
            os.replace(partial, target)
        return target

    def build_once(self, build_dir: Path | None = None) -> Path:
        with self._build_lock:
            return self.build_library(build_dir)

    def prebuild(self, build_dir: Path | None = None) -> None:
        """Build now unless built, for a background thread started early; a failure is left for
        :meth:`register` to report."""
        try:
            self.build_once(build_dir)
        except RuntimeError:
            pass

    def register(self, build_dir: Path | None = None) -> None:
        """Build (once per machine) and register the FFI target with XLA (once per process)."""
        with self._lock:
            if self._state.get("registered"):
                return
            if "error" in self._state:
                raise RuntimeError(self._state["error"])
            try:
                lib = ctypes.cdll.LoadLibrary(str(self.build_once(build_dir)))
                jax.ffi.register_ffi_target(self.target, jax.ffi.pycapsule(getattr(lib, self.symbol)),
                                            platform="cpu")
            except (RuntimeError, OSError, AttributeError) as e:
                self._state["error"] = str(e)
                raise RuntimeError(self._state["error"]) from e
            self._state["registered"] = True

    def available(self, build_dir: Path | None = None) -> tuple[bool, str]:
        """(True, "") when built (into ``build_dir``) and registered, else (False, the reason)."""
        if jax.default_backend() != "cpu":
            return False, f"the default JAX backend is {jax.default_backend()}, not cpu"
        try:
            self.register(build_dir)
        except RuntimeError as e:
            return False, str(e)
        return True, ""
