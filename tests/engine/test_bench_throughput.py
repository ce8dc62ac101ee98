"""``jaxserve bench throughput`` end to end on the demo model: both backends, the step profile and
the per-operation trace (a subprocess, since XLA must be asked for op events before it starts)."""

from __future__ import annotations

import json
import subprocess
import sys

from jaxserve.bench.op_profile import op_kind
from jaxserve.bench.throughput import random_workload


def test_bench_throughput_both_backends_with_profiles():
    cmd = [sys.executable, "-m", "jaxserve_server.cli", "bench", "throughput", "--backend", "both",
           "--num-prompts", "6", "--input-len-range", "4", "40", "--output-len-range", "3", "9",
           "--token-id-range", "3", "900",
           "--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
           "--async-scheduling", "--profile", "--profile-ops", "5", "--torch-threads", "1", "--num-iters", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    workload = random_workload(6, (4, 40), (3, 9), (3, 900), 0)
    ours, hf = result["jaxserve"], result["hf"]
    assert ours["output_tokens"] == hf["output_tokens"] == workload.num_output_tokens  # exact lengths
    assert ours["prompt_tokens"] == workload.num_prompt_tokens
    assert result["output_throughput_ratio"] == ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    assert result["num_iters"] == 2 and len(result["iteration_ratios"]) == 2
    for backend in (ours, hf):  # the reported iteration is one of the two
        assert backend["output_tokens_per_s"] in backend["iterations_output_tokens_per_s"]
    assert ours["unexpected_compiles"] == 0 and ours["num_preemptions"] == 0
    assert ours["detokenize"] is True and ours["attention_backend"] == "cpu"
    assert 0 < ours["device_wait_s"] < ours["elapsed_s"] and ours["host_ms_per_step"] > 0
    profile = ours["profile"]
    assert sum(b["steps"] for b in profile["by_token_bucket"].values()) == profile["steps"]
    ops = ours["op_profile"]
    assert "unavailable" not in ops, ops
    assert ops["num_steps"] == profile["steps"] == 2 * ours["num_steps"] and len(ops["top"]) == 5
    assert all(row["ms"] > 0 and 0 < row["share"] <= 1 and row["program_runs"] >= 1 for row in ops["top"])
    assert abs(sum(k["share"] for k in ops["by_kind"].values()) - 1) < 1e-6
    assert any(op_kind(row["op"]) in ops["by_kind"] for row in ops["top"])


def test_disable_detokenize_returns_token_ids_only(demo_model, monkeypatch):
    """vLLM's ``--disable-detokenize``: the requests carry ``detokenize=False`` (no text)."""
    from jaxserve.bench import throughput
    from jaxserve.engine.llm import LLM
    from jaxserve_server.cli import build_parser

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


def test_iterations_take_turns_and_the_median_one_is_reported():
    from jaxserve.bench.throughput import _median, run_iterations

    calls = []

    class Fake:
        def __init__(self, name, times):
            self.name, self.times = name, iter(times)

        def run_once(self):
            calls.append(self.name)
            return {"elapsed_s": next(self.times)}

    runs = run_iterations({"a": Fake("a", [3.0, 1.0, 2.0]), "b": Fake("b", [5.0, 4.0, 6.0])}, 3)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert [it["elapsed_s"] for it in runs["a"]] == [3.0, 1.0, 2.0]
    assert _median(runs["a"])["elapsed_s"] == 2.0 and _median(runs["b"])["elapsed_s"] == 5.0
    assert _median([{"elapsed_s": 1.0}, {"elapsed_s": 3.0}])["elapsed_s"] == 3.0  # the slower middle


def test_each_iteration_starts_from_an_empty_prefix_cache(demo_model):
    """The same prompts run again must not hit the KV the previous iteration left in the cache."""
    from jaxserve.bench.throughput import JaxserveBench

    workload = random_workload(3, (20, 40), (2, 3), (3, 400), 0)
    bench = JaxserveBench(str(demo_model), workload, dict(max_model_len=64, max_num_seqs=4,
                                                          max_num_batched_tokens=64, block_size=8), True)
    first, second = bench.run_once(), bench.run_once()
    assert first["output_tokens"] == second["output_tokens"] == workload.num_output_tokens
    assert bench.llm.stats()["prefix_cache_queries"] > 0
    assert bench.llm.stats()["prefix_cache_hits"] == 0
    bench.llm.generate([{"prompt_token_ids": workload.prompts[0]}], bench.params[:1], use_tqdm=False)
    assert bench.llm.stats()["prefix_cache_hits"] > 0  # without a reset, a repeat does hit


def test_real_model_workload_one_stream_and_batch_against_hf(demo_model):
    """``--workload real-model``: one stream and the batch, each with both backends taking turns,
    the one-stream ceiling from the engine's weight bytes and the bench's measured bandwidth."""
    from jaxserve.bench import throughput
    from jaxserve_server.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "throughput", str(demo_model), "--workload", "real-model", "--backend", "both",
         "--one-stream-len", "5", "--num-prompts", "3", "--input-len-range", "4", "8",
         "--output-len-range", "3", "4", "--token-id-range", "3", "400", "--max-model-len", "64",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--num-iters", "2", "--torch-threads", "1"])
    result = throughput.run_throughput_cli(args)
    one, batched = result["one_stream"], result["batched"]
    assert one["jaxserve"]["output_tokens"] == one["hf"]["output_tokens"] == 5
    assert batched["jaxserve"]["output_tokens"] == batched["hf"]["output_tokens"] == result["output_tokens"]
    for phase in (one, batched):
        assert len(phase["iteration_ratios"]) == 2
        assert phase["output_throughput_ratio"] == (phase["jaxserve"]["output_tokens_per_s"]
                                                    / phase["hf"]["output_tokens_per_s"])
    assert result["weight_bytes"] > 0 and result["read_bandwidth_gb_s"] > 0
    assert result["one_stream_ceiling_tokens_per_s"] == result["read_bandwidth_gb_s"] * 1e9 / result["weight_bytes"]
    assert result["one_stream_share_of_ceiling"] == (one["jaxserve"]["output_tokens_per_s"]
                                                     / result["one_stream_ceiling_tokens_per_s"])


def test_bench_model_names_resolve_and_others_pass_through():
    from jaxserve.bench.real_model import hf_from_pretrained_args, resolve_bench_model

    assert resolve_bench_model("some/folder") == "some/folder"
    assert hf_from_pretrained_args("/x/m.gguf") == ("/x", {"gguf_file": "m.gguf"})
    assert hf_from_pretrained_args("/x/folder") == ("/x/folder", {})
