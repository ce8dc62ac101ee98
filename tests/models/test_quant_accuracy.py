"""Accuracy of each quantized format on the trained model (SmolLM2-135M-Instruct), against the
float32 reference, on held-out texts (``jaxserve bench accuracy``; figures in docs/benchmarks.md).

The bounds sit below the measured figures with room for machine noise, and far above what a wrong
scale, a transposed block or an fp8 KV read without its cast gives (top-1 agreement near 0,
perplexity in the thousands).
"""

from __future__ import annotations

import pytest

from jaxserve.bench.accuracy import run_accuracy
from jaxserve.bench.held_texts import HELD_TEXTS
from jaxserve.models.smollm2 import smollm2_gguf_path

pytestmark = pytest.mark.slow

# format -> (min top-1 agreement, max mean |dlogprob|, max perplexity ratio to float32)
BOUNDS = {
    "gguf": (0.999, 0.001, 1.0001),  # the reference's own Q4_1 values, kept in blocks
    "gguf-q8_0": (0.95, 0.08, 1.01),  # those values re-encoded as Q8_0 (gguf_requantize.py)
    "int8": (0.80, 0.30, 1.08),
    "fp8": (0.80, 0.25, 1.08),
    "fp8-kv": (0.90, 0.15, 1.03),
    "int8-kv": (0.95, 0.06, 1.01),  # a scale per position and KV head: closer than fp8's cast
}


@pytest.fixture(scope="module")
def result():
    return run_accuracy(str(smollm2_gguf_path()), list(BOUNDS), texts=HELD_TEXTS[:4], log=lambda _: None)


def test_the_reference_reads_the_text(result):
    ref = result["formats"]["f32"]
    assert ref["top1_agreement"] == 1.0 and ref["max_abs_dlogprob"] == 0.0
    assert ref["positions"] > 200
    assert ref["perplexity"] < 30  # a trained model on plain English; random weights give ~50,000


@pytest.mark.parametrize("name", list(BOUNDS))
def test_format_is_close_to_float32(result, name):
    min_top1, max_mean, max_ppl_ratio = BOUNDS[name]
    row, ref = result["formats"][name], result["formats"]["f32"]
    assert row["top1_agreement"] >= min_top1, row
    assert row["mean_abs_dlogprob"] <= max_mean, row
    assert row["perplexity"] <= ref["perplexity"] * max_ppl_ratio, row


def test_formats_hold_fewer_bytes(result):
    f = result["formats"]
    assert f["gguf"]["weight_bytes"] < f["int8"]["weight_bytes"] / 1.5 < f["f32"]["weight_bytes"] / 3
    assert f["fp8"]["weight_bytes"] == pytest.approx(f["int8"]["weight_bytes"], rel=0.02)
    assert f["fp8-kv"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert f["fp8-kv"]["kv_cache_bytes"] * 4 == f["f32"]["kv_cache_bytes"]
    assert f["int8-kv"]["kv_cache_dtype"] == "int8"
    assert f["int8-kv"]["kv_cache_bytes"] * 4 * 64 == f["f32"]["kv_cache_bytes"] * (64 + 4)  # head_dim 64
