"""``jaxserve bench throughput`` end to end on the demo model: both backends, the step profile and
the per-operation trace (a subprocess, since XLA must be asked for op events before it starts)."""

from __future__ import annotations

import json
import subprocess
import sys

from jaxserve.bench.op_profile import op_kind
from jaxserve.bench.throughput import random_workload


def test_bench_throughput_both_backends_with_profiles():
    cmd = [sys.executable, "-m", "jaxserve.cli", "bench", "throughput", "--backend", "both", "--num-prompts", "6",
           "--input-len-range", "4", "40", "--output-len-range", "3", "9", "--token-id-range", "3", "900",
           "--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
           "--async-scheduling", "--profile", "--profile-ops", "5", "--torch-threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    workload = random_workload(6, (4, 40), (3, 9), (3, 900), 0)
    ours, hf = result["jaxserve"], result["hf"]
    assert ours["output_tokens"] == hf["output_tokens"] == workload.num_output_tokens  # exact lengths
    assert ours["prompt_tokens"] == workload.num_prompt_tokens
    assert result["output_throughput_ratio"] == ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    assert ours["unexpected_compiles"] == 0 and ours["num_preemptions"] == 0
    assert ours["detokenize"] is True and ours["attention_backend"] == "cpu"
    assert 0 < ours["device_wait_s"] < ours["elapsed_s"] and ours["host_ms_per_step"] > 0
    profile = ours["profile"]
    assert sum(b["steps"] for b in profile["by_token_bucket"].values()) == profile["steps"] == ours["num_steps"]
    ops = ours["op_profile"]
    assert "unavailable" not in ops, ops
    assert ops["num_steps"] == ours["num_steps"] and len(ops["top"]) == 5
    assert all(row["ms"] > 0 and 0 < row["share"] <= 1 and row["program_runs"] >= 1 for row in ops["top"])
    assert abs(sum(k["share"] for k in ops["by_kind"].values()) - 1) < 1e-6
    assert any(op_kind(row["op"]) in ops["by_kind"] for row in ops["top"])


def test_disable_detokenize_returns_token_ids_only(demo_model, monkeypatch):
    """vLLM's ``--disable-detokenize``: the requests carry ``detokenize=False`` (no text)."""
    from jaxserve.bench import throughput
    from jaxserve.cli import build_parser
    from jaxserve.engine.llm import LLM

    texts = []
    generate = LLM.generate

    def recording_generate(self, *args, **kwargs):
        outputs = generate(self, *args, **kwargs)
        texts.extend(o.outputs[0].text for o in outputs)
        return outputs

    monkeypatch.setattr(LLM, "generate", recording_generate)
    args = build_parser().parse_args(
        ["bench", "throughput", str(demo_model), "--num-prompts", "2", "--input-len-range", "4", "8",
         "--output-len-range", "3", "4", "--token-id-range", "3", "400", "--max-model-len", "64",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--disable-detokenize"])
    result = throughput.run_throughput_cli(args)["jaxserve"]
    assert result["detokenize"] is False and result["output_tokens"] > 0
    assert texts == ["", ""]


def test_op_kind_strips_the_instance_number():
    assert op_kind("ynn_fusion.17") == "ynn_fusion"
    assert op_kind("while") == "while"
    assert op_kind("copy.1.2") == "copy.1"
