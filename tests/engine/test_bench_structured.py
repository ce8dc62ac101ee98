"""``jaxserve bench throughput --structured json``: the same workload unconstrained and constrained
to a JSON schema on one engine, taking turns, and the ratio of their throughputs."""

from __future__ import annotations

from jaxserve.bench import throughput
from jaxserve.bench.throughput import random_workload
from jaxserve_server.cli import build_parser


def test_structured_json_runs_the_workload_both_ways(demo_model):
    args = build_parser().parse_args(
        ["bench", "throughput", str(demo_model), "--num-prompts", "2", "--input-len-range", "4", "8",
         "--output-len-range", "6", "10", "--token-id-range", "3", "400", "--max-model-len", "64",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--structured", "json", "--num-iters", "2"])
    result = throughput.run_throughput_cli(args)
    plain, constrained = result["jaxserve"], result["jaxserve_structured"]
    assert plain["structured"] is None and constrained["structured"] == "json"
    # the schema cannot complete within the output lengths: both runs produce the same tokens
    expected = random_workload(2, (4, 8), (6, 10), (3, 400), 0).num_output_tokens
    assert plain["output_tokens"] == constrained["output_tokens"] == expected
    assert constrained["finished_length"] == 2 and constrained["unexpected_compiles"] == 0
    assert result["structured_throughput_ratio"] == constrained["output_tokens_per_s"] / plain["output_tokens_per_s"]
    assert len(result["structured_iteration_ratios"]) == 2
