"""Another block format of the same ``.gguf`` model: every quantized tensor decoded and encoded
again as Q8_0, Q4_0, Q4_1 or F16 (plain float16) with the ``gguf`` package, metadata and float tensors copied as they
are (llama.cpp's own Q/K row order included, so any GGUF reader loads the result).

The demo model ships only as Q4_1; this gives its Q8_0, Q4_0 and F16 files, for the accuracy table and
the llama.cpp comparison on the same file. Written once into jaxserve's cache, keyed by the source
file's digest.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np

from jaxserve import envs

logger = logging.getLogger("jaxserve")

# Target block formats and the general.file_type llama.cpp writes for a file mostly in each.
FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "F16": 1}
_HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


def requantize_gguf(src: str | Path, dst: str | Path, qtype: str) -> Path:
    """Write ``src`` to ``dst`` with its quantized tensors in ``qtype`` (float tensors unchanged)."""
    import gguf

    if qtype not in FILE_TYPES:
        raise ValueError(f"qtype: must be one of {', '.join(FILE_TYPES)}, got {qtype!r}")
    target = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = Path(f"{dst}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key in _HEADER_FIELDS or key == "general.architecture":
            continue
        value = FILE_TYPES[qtype] if key == "general.file_type" else field.contents()
        types = [gguf.GGUFValueType(t) for t in field.types]
        sub_type = types[1] if types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, types[0], sub_type=sub_type)
    if "general.file_type" not in reader.fields:
        writer.add_file_type(FILE_TYPES[qtype])
    for t in reader.tensors:
        kind = gguf.GGMLQuantizationType(t.tensor_type)
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, target):
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=kind)
            continue
        values = gguf.quants.dequantize(np.asarray(t.data), kind)  # [rows, cols] float32
        writer.add_tensor(t.name, gguf.quants.quantize(values, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(tmp.replace(dst))


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_requantized(src: str | Path, qtype: str) -> Path:
    """``src`` in ``qtype`` from jaxserve's cache, written on first use."""
    src = Path(src)
    out_dir = Path(envs.cache_dir()) / "requantized" / _digest(src)[:16]
    out = out_dir / f"{src.stem.rsplit('.', 1)[0]}.{qtype}.gguf"
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        logger.info("writing %s: %s requantized to %s (once)", out, src.name, qtype)
        requantize_gguf(src, out, qtype)
    return out
