"""``jaxserve bench throughput --speculative-config`` on the demo model: the copy workload, the engine
with speculation alternated against the same engine without, the ratio and the acceptance."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxserve.bench.throughput import copy_workload
from jaxserve.engine.llm_engine import load_tokenizer


def test_copy_workload_asks_for_the_held_texts(demo_model):
    from jaxserve.bench.held_texts import HELD_TEXTS

    tok = load_tokenizer(demo_model)
    w = copy_workload(tok, 3, 20)
    assert len(w.prompts) == 3 and w.output_lens == [20] * 3
    assert HELD_TEXTS[1][:40] in tok.decode(w.prompts[1])


@pytest.mark.slow  # two engines compiled in a subprocess: minutes on a loaded 2-core machine
def test_bench_throughput_speculative_against_none():
    cmd = [sys.executable, "-m", "jaxserve_server.cli", "bench", "throughput", "--workload", "copy",
           "--num-prompts", "2", "--random-output-len", "24", "--max-model-len", "512", "--max-num-seqs", "2",
           "--max-num-batched-tokens", "512", "--num-iters", "2",
           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}']
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    spec, plain = result["jaxserve"], result["jaxserve_no_spec"]
    assert spec["output_tokens"] == plain["output_tokens"] == 48  # ignore_eos: exact lengths
    assert result["spec_throughput_ratio"] == spec["output_tokens_per_s"] / plain["output_tokens_per_s"]
    assert len(result["spec_iteration_ratios"]) == 2
    stats = result["spec_decode"]
    assert stats["num_drafts"] > 0 and 0 <= stats["acceptance_rate"] <= 1
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
    assert spec["unexpected_compiles"] == 0
