"""Warm-up compiles step variants in a thread pool, attributes persistent-cache hits per variant,
and skips the buckets a configuration can never reach."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.runner.compilation import CompiledSteps, StepVariant, enable_persistent_compilation_cache
from jaxserve.runner.compile_stats import CompileStats
from jaxserve.runner.model_runner import max_step_tokens


def _toy_steps(scale: float) -> CompiledSteps:
    """A jitted function with one program per bucket; ``scale`` makes the programs of two
    instances differ, so each instance has its own cache entries."""

    def step(x):
        return jnp.cumsum(jnp.sin(x) * scale) @ jnp.ones_like(x)

    def trace_args(variant: StepVariant):
        return (jax.ShapeDtypeStruct((variant.bucket,), jnp.float32),), {}

    return CompiledSteps(jax.jit(step), trace_args, CompileStats())


@pytest.fixture
def compile_cache(tmp_path):
    enable_persistent_compilation_cache(str(tmp_path / "xla"))
    yield tmp_path / "xla"
    from jaxserve import envs

    enable_persistent_compilation_cache(str(envs.cache_dir() / "xla"))  # the suite's folder again


def test_threaded_warm_up_compiles_each_variant_once_and_attributes_cache_hits(compile_cache):
    variants = [StepVariant(b) for b in (8, 16, 24, 32, 48)]
    ran = []
    cold = _toy_steps(1.5)
    cold.warm_up(variants, ran.append, show_progress=False, max_workers=3)
    s = cold.stats
    assert ran == variants and cold.warmed_up
    assert (s.num_compiles, s.compile_threads, s.persistent_cache_hits, s.cached_variants) == (5, 3, 0, [])
    assert sorted(s.compile_seconds_per_bucket) == sorted(v.name for v in variants)
    assert s.lower_seconds > 0 and s.warm_up_compile_seconds > 0
    x = np.linspace(0, 1, 24, dtype=np.float32)
    expected = float(np.cumsum(np.sin(x) * 1.5) @ np.ones_like(x))
    assert float(cold.get(StepVariant(24))(x)) == pytest.approx(expected, rel=1e-5)
    assert s.unexpected_compiles == 0

    # A second instance of the same programs finds them on disk; half of them were read already
    # by a partial warm-up, so only the rest are counted, each under its own variant.
    warm = _toy_steps(1.5)
    warm.get(variants[0])
    warm.warm_up(variants, lambda v: None, show_progress=False, max_workers=2)
    assert sorted(warm.stats.cached_variants) == sorted(v.name for v in variants)
    assert warm.stats.persistent_cache_hits == 5 and warm.stats.num_compiles == 5

    other = _toy_steps(2.5)
    other.warm_up(variants[:2], lambda v: None, show_progress=False)
    assert other.stats.persistent_cache_hits == 0


def _gated_steps(gate: threading.Event, failing: int | None = None) -> CompiledSteps:
    """Toy steps whose buckets above 16 trace only once ``gate`` is set (``failing`` never traces)."""

    def trace_args(variant: StepVariant):
        if variant.bucket > 16:
            gate.wait()
        if variant.bucket == failing:
            raise RuntimeError("no such program")
        return (jax.ShapeDtypeStruct((variant.bucket,), jnp.float32),), {}

    return CompiledSteps(jax.jit(lambda x: jnp.cumsum(x)), trace_args, CompileStats())


def test_deferred_variants_compile_in_the_background_after_warm_up(compile_cache):
    gate = threading.Event()
    steps = _gated_steps(gate)
    ran = []
    steps.warm_up([StepVariant(16)], ran.append, show_progress=False,
                  deferred=[StepVariant(24), StepVariant(48)])
    # warm-up returned while the deferred ones wait: served without them, never run on padding
    assert steps.warmed_up and ran == [StepVariant(16)]
    assert steps.pending_buckets == {24, 48} and steps.stats.num_compiles == 1
    steps.start_deferred()
    assert not steps.wait_for_deferred(timeout=0.05)
    gate.set()
    assert steps.wait_for_deferred(timeout=60)
    s = steps.stats
    assert steps.pending_buckets == set()
    assert (s.num_compiles, s.background_compiles, s.unexpected_compiles) == (3, 2, 0)
    assert s.background_compile_seconds > 0
    steps.get(StepVariant(48))  # already compiled: no compile on demand
    assert (s.num_compiles, s.unexpected_compiles) == (3, 0)


def test_asking_for_a_deferred_variant_waits_for_it_or_compiles_it_as_expected(compile_cache):
    gate = threading.Event()
    gate.set()
    steps = _gated_steps(gate)
    steps.warm_up([StepVariant(16)], lambda v: None, show_progress=False,
                  deferred=[StepVariant(24), StepVariant(48)])
    steps.get(StepVariant(24))  # not started (an engine not yet ready): compiled now, as planned
    assert (steps.stats.num_compiles, steps.stats.unexpected_compiles) == (2, 0)
    steps.start_deferred()
    steps.get(StepVariant(48))  # waits for the background thread, which compiles only 48
    assert steps.pending_buckets == set() and steps.stats.background_compiles == 1
    assert (steps.stats.num_compiles, steps.stats.unexpected_compiles) == (3, 0)


def test_a_failing_deferred_bucket_stays_pending_and_the_rest_compile(compile_cache):
    gate = threading.Event()
    gate.set()
    steps = _gated_steps(gate, failing=24)
    steps.warm_up([StepVariant(16)], lambda v: None, show_progress=False,
                  deferred=[StepVariant(24), StepVariant(48)])
    steps.start_deferred()
    assert steps.wait_for_deferred(timeout=60)
    assert steps.pending_buckets == {24} and steps.stats.background_compiles == 1


def test_stopping_the_background_compiles_no_more(compile_cache):
    gate = threading.Event()
    steps = _gated_steps(gate)
    steps.warm_up([StepVariant(16)], lambda v: None, show_progress=False,
                  deferred=[StepVariant(24), StepVariant(48)])
    steps.start_deferred()
    stopper = threading.Thread(target=steps.stop_background)
    stopper.start()
    while not steps._stop.is_set():
        time.sleep(0.01)
    gate.set()  # the compile in progress (24) finishes; 48 is never started
    stopper.join(60)
    assert not stopper.is_alive()
    assert steps.stats.background_compiles == 1 and steps.pending_buckets == {48}


# A process whose deferred compile is still tracing a program with a captured array when it
# exits: the trace's constant is a tracer with a weakref finalizer, which interpreter exit calls.
_EXIT_WHILE_TRACING = textwrap.dedent("""
    import sys, threading
    import jax, jax.numpy as jnp
    from jaxserve.runner.compilation import CompiledSteps, StepVariant
    from jaxserve.runner.compile_stats import CompileStats

    weights = jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32)
    tracing = threading.Event()

    def step(x):
        for i in range(200):  # a long trace, so that exit begins inside it
            x = jnp.sin(x) * weights[: x.shape[0]] + i
        return x

    def trace_args(variant):
        tracing.set()
        return (jax.ShapeDtypeStruct((variant.bucket,), jnp.float32),), {}

    steps = CompiledSteps(jax.jit(step), trace_args, CompileStats())
    steps.warm_up([], lambda v: None, show_progress=False, deferred=[StepVariant(24), StepVariant(48)])
    steps.start_deferred()
    tracing.wait()
    print("pending at exit:", sorted(steps.pending_buckets), file=sys.stderr)
""")


def test_exiting_while_a_deferred_bucket_traces_logs_no_failure():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_TRACING], capture_output=True, text=True,
                          env=env, timeout=300)
    assert "pending at exit: [24, 48]" in done.stderr  # exit began while 24 was tracing
    assert "failed" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0


@pytest.mark.parametrize("shape,blocks,top", [
    (dict(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=2048), 10_000, 2048),
    (dict(max_num_batched_tokens=2048, max_num_seqs=2, max_model_len=256), 10_000, 512),  # 2 requests of 256
    (dict(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=2048), 41, 640),  # 40 usable blocks
    (dict(max_num_batched_tokens=2048, max_num_seqs=2, max_model_len=256), None, 512),  # pool not sized yet
])
def test_buckets_stop_at_the_most_tokens_a_step_can_hold(shape, blocks, top):
    config = EngineConfig(**shape, block_size=16)
    assert max_step_tokens(config, shape["max_model_len"], blocks) == top


def test_runner_trims_its_buckets_to_the_pool_once_sized(demo_model):
    from jaxserve.models import load_model
    from jaxserve.runner.model_runner import ModelRunner

    # 5 blocks, block 0 reserved: 64 tokens at most, though requests and budget allow 256.
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, num_gpu_blocks_override=5)
    runner = ModelRunner(config, load_model(demo_model), 64)
    assert runner.buckets.token_buckets[-1] == 64


def test_engine_compiles_no_bucket_above_what_its_requests_can_fill(demo_model):
    from jaxserve import LLM, SamplingParams

    # Two requests of at most 64 tokens: a step never holds more than 128 of the 256 budgeted.
    llm = LLM(demo_model, show_progress=False, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=256,
              num_gpu_blocks_override=40)
    assert llm.stats()["token_buckets"] == [16, 32, 64, 128]
    prompts = [{"prompt_token_ids": list(range(10, 70))}, {"prompt_token_ids": list(range(20, 80))}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert llm.stats()["compile_unexpected_compiles"] == 0


def test_engine_is_ready_before_its_midpoints_and_uses_them_once_compiled(demo_model):
    from jaxserve import LLM, SamplingParams

    # 32 requests at most: 24 is a decode midpoint, compiled after the engine is ready.
    llm = LLM(demo_model, show_progress=False, record_steps=True, max_model_len=64, max_num_seqs=32,
              max_num_batched_tokens=64, num_gpu_blocks_override=160)
    runner = llm.llm_engine.core.runner
    assert runner.buckets.midpoints == (24,) and llm.stats()["token_buckets"] == [16, 24, 32, 64]
    assert runner.steps.wait_for_deferred(timeout=300)
    stats = llm.stats()
    assert stats["compile_num_compiles"] == 4 and stats["compile_background_compiles"] == 1
    prompts = [{"prompt_token_ids": [5 + i, 9, 11]} for i in range(20)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    decode_buckets = {r.token_bucket for r in llm.get_step_records() if r.schedule.num_scheduled_tokens == 20}
    assert decode_buckets == {24}
    assert llm.stats()["compile_unexpected_compiles"] == 0 and llm.stats()["compile_num_compiles"] == 4


@pytest.mark.parametrize("max_num_seqs,max_tokens,decode_buckets", [
    (4, 32, [16]),  # 4 decodes pad to 16, above max_num_seqs
    (24, 64, [16, 24, 32]),  # 24 decodes use 32 while the midpoint 24 compiles
])
def test_pallas_decode_variants_cover_every_bucket_a_decode_step_can_use(demo_model, max_num_seqs, max_tokens,
                                                                          decode_buckets):
    from jaxserve.models import load_model
    from jaxserve.runner.model_runner import ModelRunner

    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, num_gpu_blocks_override=40,
                          attention_backend="pallas", interpret_kernels=True)
    runner = ModelRunner(config, load_model(demo_model), 64)
    assert sorted(v.bucket for v in runner.variants() if v.decode_only) == decode_buckets


def test_small_decode_buckets_run_few_requests_unpadded_with_the_same_greedy_tokens(demo_model):
    from jaxserve import LLM, SamplingParams

    shape = dict(show_progress=False, record_steps=True, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                 num_gpu_blocks_override=40)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [7 + i, 30, 41, 52 + i]} for i in range(3)]
    small = LLM(demo_model, min_decode_bucket=1, **shape)
    runner = small.llm_engine.core.runner
    assert small.stats()["token_buckets"] == [1, 2, 4, 16, 32, 64] and runner.buckets.deferred == (1, 2, 4)
    assert runner.steps.wait_for_deferred(timeout=300) and not runner.steps.pending_buckets
    compiles = small.stats()["compile_num_compiles"]
    outs = [small.generate(prompts[:n], params, use_tqdm=False) for n in (1, 2, 3)]
    decode = [r for r in small.get_step_records() if r.schedule.num_prefill_tokens == 0 and r.num_tokens]
    assert {(r.num_tokens, r.token_bucket) for r in decode} == {(1, 1), (2, 2), (3, 4)}
    assert small.stats()["compile_num_compiles"] == compiles and small.stats()["compile_unexpected_compiles"] == 0

    padded = LLM(demo_model, min_decode_bucket=16, **shape)
    assert padded.stats()["token_buckets"] == [16, 32, 64]
    for n, out in zip((1, 2, 3), outs):
        ref = padded.generate(prompts[:n], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def test_min_decode_bucket_default_and_validation():
    from jaxserve.config import CompilationConfig
    from jaxserve.exceptions import ConfigError

    default = CompilationConfig()
    assert default.resolved_min_decode_bucket("cpu", 538 << 20) == 1  # SmolLM2-135M in float32
    assert default.resolved_min_decode_bucket("cpu", 1 << 20) == 16  # a tiny test model
    assert default.resolved_min_decode_bucket("gpu", 538 << 20) == 16
    assert CompilationConfig(min_decode_bucket=4).resolved_min_decode_bucket("gpu", 0) == 4
    for bad in (3, 32, 0, True, "1"):
        with pytest.raises(ConfigError, match="min_decode_bucket"):
            EngineConfig(min_decode_bucket=bad)
