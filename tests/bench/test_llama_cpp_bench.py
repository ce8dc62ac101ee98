"""``jaxserve bench llama-cpp``: jaxserve's side of the comparison measures decode apart from
prefill on llama.cpp's shapes; llama.cpp's own programs run when a build is at hand
(``scripts/build_llama_cpp.sh``, not part of CI: set ``JAXSERVE_LLAMA_CPP_DIR``)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest

from jaxserve import LLM
from jaxserve.bench.llama_cpp import JaxserveDecode, run_llama_cpp_bench
from tests.shapes import DEMO_MODEL

LLAMA_CPP_DIR = os.environ.get("JAXSERVE_LLAMA_CPP_DIR")


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO_MODEL, show_progress=False, max_model_len=128, max_num_batched_tokens=64,
               num_gpu_blocks_override=64)


def test_jaxserve_side_times_prefill_and_decode_apart(llm):
    ours = JaxserveDecode(llm)
    start = time.perf_counter()
    figures = ours.run(batch=3, n_prompt=20, n_gen=5)
    elapsed = time.perf_counter() - start
    assert figures["prompt_tok_s"] > 0 and figures["gen_tok_s"] > 0
    # the decode window comes from the outputs' own token times, so it lies inside the call
    window = 3 * 5 / figures["gen_tok_s"]
    assert 0 < window < elapsed
    # the decode run reuses its own prompts' cached blocks (so it is decode), never an earlier
    # run's (fresh prompts, the cache reset): each run hits the same, some of its own prompts
    hits = [llm.stats()["prefix_cache_hits"]]
    for _ in range(2):
        ours.run(batch=3, n_prompt=20, n_gen=5)
        hits.append(llm.stats()["prefix_cache_hits"])
    assert hits[2] - hits[1] == hits[1] - hits[0] and 0 < hits[1] - hits[0] < 3 * 20
    stats = llm.stats()
    assert stats["num_requests_running"] == 0 and stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1


@pytest.mark.skipif(not LLAMA_CPP_DIR, reason="no llama.cpp build (JAXSERVE_LLAMA_CPP_DIR)")
def test_rounds_against_llama_cpp_on_the_same_file():
    from jaxserve.models.smollm2 import smollm2_gguf_path

    model = str(smollm2_gguf_path())
    args = argparse.Namespace(llama_cpp_dir=LLAMA_CPP_DIR, rounds=1, threads=2, n_prompt=16, n_gen=8,
                              batch_sizes=[4], batch_prompt=16, batch_gen=8)
    result = run_llama_cpp_bench(args, LLM(model, max_model_len=128, show_progress=False), model)
    row = result["rounds"][0]
    assert row["llama_cpp_one_stream"]["gen_tok_s"] > 0 and row["llama_cpp_batch_4_gen_tok_s"] > 0
    assert result["summary"]["batch_4_gen_ratio"]["per_round"][0] > 0
    assert Path(result["model"]).suffix == ".gguf"
