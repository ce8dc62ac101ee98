"""Read ``*.safetensors`` files into numpy without executing anything from the checkpoint.

The format is an 8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}``, then raw little-endian bytes. Reading it directly
(memory-mapped) gives bfloat16 through ``ml_dtypes`` and keeps torch out of the serving path.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.exceptions import ConfigError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # pre-quantized fp8 weights (compressed-tensors)
}


class SafetensorsFile:
    """A memory-mapped safetensors file; ``get(name)`` returns a read-only numpy view."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (header_len,) = struct.unpack("<Q", self._mmap[:8])
        header = json.loads(self._mmap[8 : 8 + header_len])
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self.header: dict[str, dict] = header

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        buf = memoryview(self._mmap)[self._data_start + start : self._data_start + end]
        return np.frombuffer(buf, dtype=dtype).reshape(info["shape"])


def open_checkpoint_files(folder: str | Path) -> dict[str, SafetensorsFile]:
    """Map every tensor name to the file holding it (single file or sharded with an index)."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = {name: SafetensorsFile(folder / name) for name in sorted(set(weight_map.values()))}
        return {tensor: files[file] for tensor, file in weight_map.items()}
    mapping: dict[str, SafetensorsFile] = {}
    for path in safetensors_shards(folder):
        f = SafetensorsFile(path)
        for name in f.keys():
            mapping[name] = f
    return mapping


INDEX_FILE = "model.safetensors.index.json"


def check_weights(folder: str | Path) -> None:
    """Raise a ConfigError unless ``folder`` holds safetensors weights (an index or shards)."""
    if not (Path(folder) / INDEX_FILE).is_file():
        safetensors_shards(folder)


def safetensors_shards(folder: str | Path) -> list[Path]:
    """The folder's ``*.safetensors`` files; a ConfigError naming the pickle files when there are
    none (they are never unpickled) or saying there are no weights at all."""
    folder = Path(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return shards
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickled:
        raise ConfigError(
            f"checkpoint {folder} holds only pickle files ({', '.join(pickled)}); jaxserve never "
            "unpickles checkpoints (that can execute code). Convert it to safetensors first, e.g. "
            "load it with transformers and call save_pretrained(..., safe_serialization=True).")
    raise ConfigError(f"no *.safetensors weights in checkpoint folder {folder}")


_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def save_file(tensors: dict[str, np.ndarray], path: str | Path) -> None:
    """Write tensors as one safetensors file, in the order given (the bytes depend on nothing else)."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}  # transformers reads "pt" files
    offset = 0
    for name, arr in tensors.items():
        nbytes = arr.nbytes
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def save_checkpoint_weights(tensors: dict[str, np.ndarray], folder: str | Path,
                            max_shard_bytes: int | None = None) -> None:
    """Write a checkpoint's weights as Hugging Face does: ``model.safetensors``, or shards of at most
    ``max_shard_bytes`` (a larger tensor gets a shard of its own) named
    ``model-0000i-of-0000n.safetensors`` plus the index that maps each tensor to its shard."""
    folder = Path(folder)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        save_file(tensors, folder / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
