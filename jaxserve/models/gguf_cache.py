"""A start-up cache for ``.gguf`` files: what parsing and dequantizing a file builds (its config,
its tensors in the serving dtype, transformers' tokenizer) kept under jaxserve's cache directory,
keyed by the file's sha256, so that a second start reads them back instead of rebuilding them.

Each entry is written into a temporary folder and renamed into place, so a reader sees a whole
entry or none. An entry that cannot be read back (missing or truncated files, a bad manifest) is
logged, removed and rebuilt: the cache never turns a start that would work into one that fails.
Contents are not checksummed (that would cost as much as the file's own hash for every tensor):
a truncated file is caught by its size, a flipped bit is not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve import envs

logger = logging.getLogger("jaxserve")

# bumped when an entry's layout changes: older entries are then misses. 2: kept GGUF blocks hold
# the file's float16 scales, and no minimums for Q8_0/Q4_0 (1 held float32 ones and zeros)
_FORMAT = 2
_digests: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, per process


def default_root() -> Path:
    return envs.cache_dir() / "gguf"


def file_sha256(path: str | Path) -> str:
    """The file's sha256, hashed once per process for a given path, size and modification time."""
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        _digests[key] = digest.hexdigest()
    return _digests[key]


class GGUFCache:
    """The cache entry of one ``.gguf`` file under ``root`` (default: ``<cache dir>/gguf``)."""

    def __init__(self, path: str | Path, root: str | Path | None = None):
        self.path = Path(path)
        self.root = Path(root) if root is not None else default_root()
        self.entry = self.root / f"v{_FORMAT}-{file_sha256(self.path)}"

    # -- config ---------------------------------------------------------------------------------

    def config(self, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The file's HF config dict: read back, else ``build()`` and kept."""
        return self._json_object("config.json", build, indent=1, sort_keys=True)

    def _json_object(self, name: str, build: Callable[[], dict[str, Any]], **dump_args: Any) -> dict[str, Any]:
        """A JSON object kept as ``name`` in the entry: read back, else ``build()`` and kept."""
        target = self.entry / name

        def read() -> dict[str, Any]:
            value = json.loads(target.read_text())
            if not isinstance(value, dict):
                raise ValueError(f"{name} is not an object")
            return value

        def write(folder: Path, value: dict[str, Any]) -> None:
            (folder / name).write_text(json.dumps(value, **dump_args))

        return self._cached(target, read, build, write)

    # -- tensors --------------------------------------------------------------------------------

    def tensors(self, dtype: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """HF name -> array in ``dtype`` (read-only, memory-mapped on a hit), else ``build()`` and kept."""
        from jaxserve.models.gguf_loader import np_dtype

        return self._array_dir(self.entry / f"tensors-{dtype}", build, np_dtype(dtype))

    def arrays(self, key: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Name -> array, each in its own dtype (``--quantization gguf``'s kept blocks beside its
        dequantized tensors), memory-mapped on a hit; else ``build()`` and kept under ``key``."""
        return self._array_dir(self.entry / key, build)

    def _array_dir(self, target: Path, build: Callable[[], dict[str, np.ndarray]],
                   dtype: np.dtype | None = None) -> dict[str, np.ndarray]:
        """Arrays kept one raw file each under ``target`` with a manifest (file, shape, dtype name);
        ``dtype``: every array is stored in it, and a manifest naming another is unreadable."""
        from jaxserve.models.gguf_loader import np_dtype

        def read() -> dict[str, np.ndarray]:
            manifest = json.loads((target / "manifest.json").read_text())
            out: dict[str, np.ndarray] = {}
            for name, (file, shape, stored) in manifest.items():
                dt = np_dtype(stored)
                if dtype is not None and dt != dtype:
                    raise ValueError(f"{name}: stored as {stored}, the entry is {dtype.name}")
                data = target / file
                expected = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                if data.stat().st_size != expected:
                    raise ValueError(f"{file}: {data.stat().st_size} bytes, {name} needs {expected}")
                out[name] = np.memmap(data, dtype=dt, mode="r", shape=tuple(shape)) if expected else np.zeros(shape, dt)
            return out

        def write(folder: Path, value: dict[str, np.ndarray]) -> None:
            sub = folder / target.name
            sub.mkdir()
            manifest = {}
            for i, (name, array) in enumerate(value.items()):
                array = np.asarray(array)
                array = np.ascontiguousarray(array if dtype is None else array.astype(dtype, copy=False))
                array.tofile(sub / f"{i}.bin")
                manifest[name] = [f"{i}.bin", list(array.shape), array.dtype.name]
            (sub / "manifest.json").write_text(json.dumps(manifest))

        return self._cached(target, read, build, write)

    def metadata(self, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """A JSON object about the file's tensors (types, shapes), read without opening the file."""
        return self._json_object("tensors.json", build)

    def tensor_shapes(self, dtype: str) -> dict[str, tuple[int, ...]] | None:
        """The shapes of a kept ``dtype`` entry, or None when there is none (nothing is read)."""
        try:
            manifest = json.loads((self.entry / f"tensors-{dtype}" / "manifest.json").read_text())
            return {name: tuple(shape) for name, (_, shape, _) in manifest.items()}
        except (OSError, ValueError, TypeError):
            return None

    # -- tokenizer ------------------------------------------------------------------------------

    def tokenizer(self, build: Callable[[], Any]) -> Any:
        """transformers' tokenizer of the file, saved with ``save_pretrained`` and read back with
        ``AutoTokenizer`` (the GGUF parse it replaces costs seconds)."""
        target = self.entry / "tokenizer"

        def read() -> Any:
            from transformers import AutoTokenizer

            if not (target / "tokenizer_config.json").is_file():
                raise ValueError("no tokenizer_config.json")
            return AutoTokenizer.from_pretrained(str(target), trust_remote_code=False)

        def write(folder: Path, value: Any) -> None:
            value.save_pretrained(str(folder / target.name))

        return self._cached(target, read, build, write)

    # -- the one way an item is read, built and kept -------------------------------------------

    def _cached(self, target: Path, read: Callable[[], Any], build: Callable[[], Any],
                write: Callable[[Path, Any], None]) -> Any:
        if target.exists():
            try:
                return read()
            except Exception as exc:  # noqa: BLE001 - any unreadable entry is a miss, never a failed start
                logger.warning("GGUF cache: %s is unreadable (%s): rebuilding it", target, exc)
                _remove(target)
        value = build()
        try:
            self.entry.mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.entry))
            try:
                write(folder, value)
                os.replace(folder / target.name, target)  # atomic; a concurrent writer's twin is fine
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        except OSError as exc:  # a read-only or full cache: serve anyway
            if target.exists():  # another process kept the same item first
                return value
            logger.warning("GGUF cache: could not keep %s (%s)", target, exc)
        return value


def _remove(target: Path) -> None:
    if target.is_dir():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)
