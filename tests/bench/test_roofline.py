"""The roofline model: exact weight and KV figures, and the issue's 256 x 1k example on an H200."""

import json

from jaxserve.bench import gpu_aot, gpu_targets
from jaxserve.bench.presets import preset_config
from jaxserve.bench.roofline import kv_bytes_per_token, roofline_row, step_shape, weight_bytes
from jaxserve.models.config import ModelConfig
from jaxserve_server.cli import main

MC = ModelConfig.from_dict(preset_config("qwen3-0.6b"))
SPEC = gpu_targets.gpu_spec("h200", gpu_targets.target_config_path("h200").read_text())


def test_weights_match_the_abstract_model():
    assert weight_bytes(MC, 2) == gpu_aot.weight_bytes(gpu_aot.abstract_model("qwen3-0.6b", False))


def test_256_sequences_of_1k_on_an_h200():
    row = roofline_row(MC, SPEC, step_shape(256, 256, 1024), 2)
    assert kv_bytes_per_token(MC, 2) == 2 * 28 * 8 * 128 * 2
    assert row["kv_read_gb"] == 256 * 1024 * kv_bytes_per_token(MC, 2) / 1e9
    assert 31 < row["total_gb"] < 33 and row["bound"] == "memory"
    assert abs(row["step_ms"] - row["total_gb"] / 4.8) < 1e-9
    assert 37_000 < row["ceiling_tok_s"] < 40_000


def test_prefill_buckets_split_into_prompts_of_the_context_length():
    shape = step_shape(2048, 256, 1024)
    assert (shape.seqs, shape.kv_read_tokens, shape.decode) == (2, 2048, False)
    assert shape.attended_pairs == 2 * 1024 * 1025 // 2


def test_cli_prints_a_table_and_json(capsys):
    assert main(["bench", "roofline", "--model", "qwen3-0.6b", "--gpu", "h200", "--context-len", "1024"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert [r["bucket"] for r in result["buckets"]][-1] == 2048
    assert "| 256 | decode | 256 |" in captured.err
