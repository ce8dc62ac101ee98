"""``gguf_requantize``: a ``.gguf`` model re-encoded in another block format keeps its metadata and
float tensors, and its logits stay within that format's rounding of the source's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from jaxserve.models.gguf_requantize import cached_requantized, requantize_gguf
from jaxserve.models.loader import load_gguf_model
from tests.models.paged_sequence import PagedSequence
from tests.models.tiny_gguf import SHAPE, write_tiny_gguf


def _types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("target", ["Q8_0", "Q4_0", "F16"])
def test_requantized_file_keeps_metadata_and_float_tensors(tmp_path, target):
    src = write_tiny_gguf(tmp_path / "m.gguf", "Q4_1", overrides={"token_embd.weight": "Q8_0"})
    out = requantize_gguf(src, tmp_path / f"m.{target}.gguf", target)
    before, after = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    src_types, out_types = _types(src), _types(out)
    assert src_types.keys() == out_types.keys()
    for name, kind in src_types.items():
        assert out_types[name] == ("F32" if kind == "F32" else target), name
    keys = set(before.fields) - {"general.file_type"}
    assert keys <= set(after.fields)
    assert after.fields["llama.block_count"].contents() == before.fields["llama.block_count"].contents()
    assert after.fields["general.file_type"].contents() == {"Q8_0": 7, "Q4_0": 2, "F16": 1}[target]
    norm = next(t for t in after.tensors if t.name == "output_norm.weight")
    src_norm = next(t for t in before.tensors if t.name == "output_norm.weight")
    np.testing.assert_array_equal(norm.data, src_norm.data)


@pytest.mark.parametrize("target, max_rel", [("F16", 2e-3), ("Q8_0", 0.03), ("Q4_0", 0.3)])
def test_requantized_logits_follow_the_source(tmp_path, target, max_rel):
    """F16 of Q4_1 values rounds only to float16; Q8_0 is close; Q4_0 (no per-block minimum) is
    coarser but the same model.
    A wrong scale or a transposed block gives a relative error of order 1."""
    src = write_tiny_gguf(tmp_path / "m.gguf", "Q4_1")
    out = requantize_gguf(src, tmp_path / f"m.{target}.gguf", target)
    tokens = np.random.default_rng(1).integers(0, SHAPE["vocab"], 24).tolist()
    ref = PagedSequence(load_gguf_model(src)).feed(tokens)
    # F16 has no blocks to keep: it is served dequantized (in float16, the file's dtype)
    got = PagedSequence(load_gguf_model(out, quantization=None if target == "F16" else "gguf")).feed(tokens)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < max_rel


def test_the_cache_writes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = write_tiny_gguf(tmp_path / "m.gguf", "Q4_1")
    first = cached_requantized(src, "Q8_0")
    stamp = first.stat().st_mtime_ns
    assert cached_requantized(src, "Q8_0") == first and first.stat().st_mtime_ns == stamp
    assert first.name == "m.Q8_0.gguf"
    with pytest.raises(ValueError, match="qtype"):
        cached_requantized(src, "Q5_K")
