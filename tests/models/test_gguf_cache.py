"""The GGUF start-up cache: a hit skips the build, a changed file is a miss, and a damaged entry is
rebuilt with a warning (never a failed start). The cache only keys by the file's bytes, so small
stand-in files serve here; the real SmolLM2 file goes through it in the exactness tests."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from jaxserve.models.gguf_cache import GGUFCache


class Builder:
    """Counts its calls, so a test sees whether the cache rebuilt."""

    def __init__(self, make):
        self.make, self.calls = make, 0

    def __call__(self):
        self.calls += 1
        return self.make()


def _tensors():
    rng = np.random.default_rng(0)
    return {"model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "model.norm.weight": np.arange(8, dtype=np.float32)}


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF stand-in " * 100)
    return path


def test_a_hit_reads_back_what_the_build_made_without_building(gguf, tmp_path):
    root = tmp_path / "cache"
    build, config = Builder(_tensors), Builder(lambda: {"hidden_size": 8, "rope_theta": 1e4})
    first = GGUFCache(gguf, root).tensors("float32", build)
    assert GGUFCache(gguf, root).config(config) == {"hidden_size": 8, "rope_theta": 1e4}
    again = GGUFCache(gguf, root).tensors("float32", build)
    assert GGUFCache(gguf, root).config(config) == {"hidden_size": 8, "rope_theta": 1e4}
    assert build.calls == 1 and config.calls == 1
    assert isinstance(again["model.norm.weight"], np.memmap)  # read lazily, not decoded again
    for name, value in _tensors().items():
        np.testing.assert_array_equal(first[name], value)
        np.testing.assert_array_equal(again[name], value)
    assert GGUFCache(gguf, root).tensor_shapes("float32") == {"model.embed_tokens.weight": (16, 8),
                                                              "model.norm.weight": (8,)}
    assert GGUFCache(gguf, root).tensor_shapes("bfloat16") is None  # another dtype is another item
    assert not [p for p in root.rglob(".tmp-*")]  # no temporary folder left behind


def test_a_changed_file_is_a_miss(gguf, tmp_path):
    root = tmp_path / "cache"
    build = Builder(_tensors)
    GGUFCache(gguf, root).tensors("float32", build)
    gguf.write_bytes(gguf.read_bytes() + b"x")
    assert GGUFCache(gguf, root).tensor_shapes("float32") is None
    GGUFCache(gguf, root).tensors("float32", build)
    assert build.calls == 2
    assert len(list(root.iterdir())) == 2  # one entry per content


@pytest.mark.parametrize("damage", ["truncated tensor", "missing tensor", "bad manifest", "bad config"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(gguf, tmp_path, damage, caplog):
    root = tmp_path / "cache"
    build, config = Builder(_tensors), Builder(lambda: {"hidden_size": 8})
    cache = GGUFCache(gguf, root)
    cache.tensors("float32", build)
    cache.config(config)
    tensors = cache.entry / "tensors-float32"
    if damage == "truncated tensor":
        data = tensors / "0.bin"
        data.write_bytes(data.read_bytes()[:-4])
    elif damage == "missing tensor":
        (tensors / "1.bin").unlink()
    elif damage == "bad manifest":
        (tensors / "manifest.json").write_text("{not json")
    else:
        (cache.entry / "config.json").write_text(json.dumps([1, 2]))
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        got = GGUFCache(gguf, root).tensors("float32", build)
        cfg = GGUFCache(gguf, root).config(config)
    assert cfg == {"hidden_size": 8}
    for name, value in _tensors().items():
        np.testing.assert_array_equal(got[name], value)
    rebuilt = "config" if damage == "bad config" else "tensors"
    assert (build.calls, config.calls) == ((1, 2) if rebuilt == "config" else (2, 1))
    assert "unreadable" in caplog.text and "rebuilding" in caplog.text
    # the rebuilt entry is whole again: the next start is a hit
    GGUFCache(gguf, root).tensors("float32", build)
    GGUFCache(gguf, root).config(config)
    assert build.calls + config.calls == 3


def test_the_tokenizer_is_kept_and_read_back_equal(gguf, tmp_path, demo_model):
    from transformers import AutoTokenizer

    root = tmp_path / "cache"
    build = Builder(lambda: AutoTokenizer.from_pretrained(demo_model))
    built = GGUFCache(gguf, root).tokenizer(build)
    kept = GGUFCache(gguf, root).tokenizer(build)
    assert build.calls == 1
    text = "The capital of France is Paris."
    assert kept.encode(text) == built.encode(text)
    assert kept.decode(kept.encode(text)) == built.decode(built.encode(text))
    (GGUFCache(gguf, root).entry / "tokenizer" / "tokenizer_config.json").unlink()  # damaged: rebuilt
    GGUFCache(gguf, root).tokenizer(build)
    assert build.calls == 2


def test_a_cache_that_cannot_be_written_still_serves(gguf, tmp_path, caplog):
    root = tmp_path / "cache"
    root.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        got = GGUFCache(gguf, root).tensors("float32", _tensors)
    np.testing.assert_array_equal(got["model.norm.weight"], np.arange(8, dtype=np.float32))
    assert "could not keep" in caplog.text
