"""``pytorch_model.bin`` state dicts read without torch (many EAGLE-1 heads ship only that).

``torch.save`` writes a zip: ``<name>/data.pkl`` (a pickle of the state dict) and one raw little-
endian storage per ``<name>/data/<key>``. A pickle can name any callable; this reader's unpickler
resolves only the handful of names a plain state dict uses (``collections.OrderedDict``,
``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter``, the ``torch.*Storage`` types) to
functions that build records, so nothing from the file runs: anything else is refused naming the
global and asking for a safetensors conversion. Invariant: a tensor is read as its storage's
elements at ``offset + sum(i * stride)``, bounds-checked against the storage's size.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.exceptions import ConfigError
from jaxserve.models.safetensors_io import INDEX_FILE, SafetensorsFile, open_checkpoint_files

PYTORCH_BIN = "pytorch_model.bin"

_STORAGE_DTYPES: dict[str, np.dtype] = {
    "FloatStorage": np.dtype(np.float32), "DoubleStorage": np.dtype(np.float64),
    "HalfStorage": np.dtype(np.float16), "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64), "IntStorage": np.dtype(np.int32), "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8), "ByteStorage": np.dtype(np.uint8), "BoolStorage": np.dtype(np.bool_),
}


@dataclasses.dataclass(frozen=True)
class _StorageType:
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class _Storage:
    key: str
    dtype: np.dtype
    numel: int


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A tensor not read yet: where its elements are in its storage."""

    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                    *_ignored: Any) -> _Tensor:
    return _Tensor(storage, int(offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data: _Tensor, *_ignored: Any) -> _Tensor:
    return data


class _StateDictUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path):
        import io

        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise ConfigError(f"{self.path}: the pickle names {module}.{name}, which a plain state dict of tensors "
                          "does not; jaxserve does not run it. Convert the file to model.safetensors")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise ConfigError(f"{self.path}: unexpected storage reference {pid!r}; "
                              "convert the file to model.safetensors")
        return _Storage(str(pid[2]), pid[1].dtype, int(pid[4]))


class TorchBinFile:
    """The tensors of one ``torch.save`` zip file; ``get`` reads one as a numpy array (a copy)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._zip = zipfile.ZipFile(self.path)
        except zipfile.BadZipFile:
            raise ConfigError(f"{self.path}: not a zip file (torch's legacy format before 1.6 is not read); "
                              "convert it to model.safetensors") from None
        pkl = [n for n in self._zip.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise ConfigError(f"{self.path}: no <name>/data.pkl inside; not a torch.save file")
        self._prefix = pkl[0].removesuffix("data.pkl")
        order = self._prefix + "byteorder"
        if order in self._zip.namelist() and self._zip.read(order).strip() != b"little":
            raise ConfigError(f"{self.path}: big-endian storages are not read; convert it to model.safetensors")
        state = _StateDictUnpickler(self._zip.read(pkl[0]), self.path).load()
        if not isinstance(state, dict) or not all(isinstance(v, _Tensor) for v in state.values()):
            raise ConfigError(f"{self.path}: not a flat state dict of tensors; convert it to model.safetensors")
        self._tensors: dict[str, _Tensor] = {str(k): v for k, v in state.items()}
        self._storages: dict[str, np.ndarray] = {}

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name].shape

    def get(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        flat = self._storage(t.storage)
        if any(s == 0 for s in t.shape):
            return np.zeros(t.shape, flat.dtype)
        last = t.offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride))
        if t.offset < 0 or min(t.stride, default=0) < 0 or last >= flat.size:
            raise ConfigError(f"{self.path}: tensor {name} reaches past its storage ({flat.size} elements)")
        view = np.lib.stride_tricks.as_strided(flat[t.offset:], t.shape, tuple(s * flat.itemsize for s in t.stride),
                                               writeable=False)
        return np.array(view)

    def _storage(self, s: _Storage) -> np.ndarray:
        if s.key not in self._storages:
            raw = self._zip.read(f"{self._prefix}data/{s.key}")
            if len(raw) < s.numel * s.dtype.itemsize:
                raise ConfigError(f"{self.path}: storage {s.key} holds {len(raw)} bytes, fewer than its "
                                  f"{s.numel} {s.dtype} elements")
            self._storages[s.key] = np.frombuffer(raw, s.dtype, s.numel)
        return self._storages[s.key]


def open_state_dict_files(folder: str | Path) -> dict[str, SafetensorsFile | TorchBinFile]:
    """Every tensor name -> the file holding it: the folder's safetensors, or when it has none its
    ``pytorch_model.bin`` (one file; sharded ``.bin`` checkpoints are not read)."""
    folder = Path(folder)
    if (folder / PYTORCH_BIN).is_file() and not (folder / INDEX_FILE).is_file() and \
            not any(folder.glob("*.safetensors")):
        f = TorchBinFile(folder / PYTORCH_BIN)
        return {name: f for name in f.keys()}
    return dict(open_checkpoint_files(folder))
