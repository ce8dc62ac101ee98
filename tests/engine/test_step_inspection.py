"""The public handles on one engine step: its decoded inputs, its compiled program, a profile."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, StepInputs, StepProgram
from tests.shapes import BACKEND_COMPARISON_SHAPE


@pytest.fixture(scope="module")
def llm(demo_model):
    return LLM(demo_model, show_progress=False, async_scheduling=False, **BACKEND_COMPARISON_SHAPE)


def test_last_step_inputs_are_named_and_consistent(llm):
    assert llm.get_last_step_inputs() is None or isinstance(llm.get_last_step_inputs(), StepInputs)
    engine = llm.llm_engine
    prompts = {"a": list(range(5, 25)), "b": list(range(40, 43))}  # 20 and 3 tokens: one 23-token step
    for rid, ids in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    inputs = llm.get_last_step_inputs()
    assert inputs.req_ids == ("a", "b") and inputs.num_tokens == 23
    assert inputs.bucket >= 23 and inputs["positions"].shape == (inputs.bucket,)
    # Every array has its words, each on a 256-byte boundary (at most 63 words of gap after one).
    fields = inputs.layout.fields
    assert sum(f.size for f in fields) <= inputs.packed_words <= sum(f.size + 63 for f in fields)
    assert all(f.offset % 64 == 0 for f in fields)
    qsl, n = inputs["query_start_loc"], int(inputs["num_seqs"][0])
    assert n == 2 and list(qsl[: n + 1]) == [0, 20, 23] and (qsl[n + 1 :] == 23).all()
    a, b = inputs.request_view("a"), inputs.request_view("b")
    assert list(a["positions"]) == list(range(20)) and list(b["positions"]) == [0, 1, 2]
    assert list(a["input_ids"]) == prompts["a"] and list(b["input_ids"]) == prompts["b"]
    assert a["kv_len"] == 20 and len(a["blocks"]) == -(-20 // inputs.block_size)
    # Each token's KV slot is its page (from the block table) times the page size plus its offset.
    for view in (a, b):
        pos = view["positions"]
        expected = view["blocks"][pos // inputs.block_size] * inputs.block_size + pos % inputs.block_size
        assert (view["slot_mapping"] == expected).all()
    assert (inputs["slot_mapping"][23:] == -1).all()  # padding tokens write nowhere
    assert inputs.sampling.temperature.dtype == np.float32 and (inputs.sampling.temperature[:2] == 0).all()
    assert inputs["need_logprobs"].tolist() == [False] and inputs.model.num_seqs.tolist() == [2]
    engine.step()  # both decode one token: a two-token step
    decode = llm.get_last_step_inputs()
    assert decode.num_tokens == 2 and list(decode["positions"][:2]) == [20, 3]
    while engine.has_unfinished_requests():
        engine.step()


def test_step_program_text_and_analyses(llm):
    buckets = llm.stats()["token_buckets"]
    small, large = (llm.get_step_program(b) for b in (buckets[0], buckets[-1]))
    assert isinstance(small, StepProgram) and small.bucket == buckets[0] and small.variant.startswith(str(buckets[0]))
    assert "HloModule" in small.hlo and "ENTRY" in small.hlo
    assert "stablehlo" in small.stablehlo or "func.func" in small.stablehlo
    assert "lambda" in small.jaxpr and "dot_general" in small.jaxpr
    assert small.flops > 0 and small.bytes_accessed > 0
    assert large.flops > small.flops  # more tokens, more matmul work
    assert small.memory["argument_size_in_bytes"] > 0 and small.memory["temp_size_in_bytes"] >= 0
    with pytest.raises(ValueError, match="no step variant for bucket 3"):
        llm.get_step_program(3)
    assert llm.stats()["compile_unexpected_compiles"] == 0  # inspecting compiled nothing new


def test_profile_writes_a_perfetto_trace(llm, tmp_path):
    folder = llm.start_profile(str(tmp_path))
    with pytest.raises(RuntimeError, match="already being recorded"):
        llm.start_profile(str(tmp_path))
    llm.generate([[7, 8, 9]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    profile = llm.stop_profile()
    assert profile.log_dir == folder and profile.run_dir.parent == folder / "plugins" / "profile"
    assert profile.xplane is not None and profile.xplane.stat().st_size > 0
    with gzip.open(profile.perfetto_trace, "rt") as f:
        assert json.load(f)
    by_thread = profile.seconds_by_thread()
    assert by_thread and all(s >= 0 for s in by_thread.values()) and max(by_thread.values()) > 0
    with pytest.raises(RuntimeError, match="no profile is being recorded"):
        llm.stop_profile()
    llm.start_profile(str(tmp_path))  # a second trace into the same folder, likely the same second
    llm.generate([[7, 8]], SamplingParams(max_tokens=2), use_tqdm=False)
    again = llm.stop_profile()
    assert again.perfetto_trace is not None
    assert again.perfetto_trace.stat().st_mtime >= profile.perfetto_trace.stat().st_mtime
