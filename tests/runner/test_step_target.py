"""The runner's target decides the step's control flow: the GPU step, built here on the CPU,
holds no conditional and no data-dependent loop; the CPU step keeps its conds."""

import jax
import pytest

from jaxserve import envs
from jaxserve.bench.hlo_stats import analyze_hlo
from jaxserve.config import EngineConfig
from jaxserve.models import load_model
from jaxserve.runner.compilation import StepVariant
from jaxserve.runner.kv_cache import kv_cache_shape
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.target import StepTarget
from tests.compiles import backend_compiles

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=40)


def _runner(demo_model, platform: str) -> ModelRunner:
    import pallas_kernels

    ok, reason = pallas_kernels.cpu_attention_available(envs.kernel_build_dir())
    if not ok:  # the xla backend walks the context in a data-dependent loop of its own
        pytest.skip(f"the cpu attention kernel is unavailable: {reason}")
    model = load_model(demo_model, scan_layers=False)
    return ModelRunner(EngineConfig(attention_backend="cpu", **CONFIG), model, 256, target=StepTarget(platform))


def _stats(runner: ModelRunner, variant: StepVariant):
    pools = {("f32", kv_cache_shape(runner.mc, runner.num_blocks, runner.block_size))}
    return analyze_hlo(runner.steps.lowered(variant).compile().as_text(), set(), pools)


def test_gpu_step_has_a_greedy_and_a_random_program_and_no_host_round_trip(demo_model):
    runner = _runner(demo_model, "gpu")
    assert runner.cond_free
    names = {v.name for v in runner.variants()}
    assert {"16-greedy", "16-random", "32-greedy", "32-random"} <= names
    for variant in (StepVariant(16, all_greedy=True), StepVariant(32, all_greedy=False)):
        stats = _stats(runner, variant)
        assert stats.host_round_trips == 0, stats
        assert stats.pool_aliased


def test_cpu_step_keeps_its_conds(demo_model):
    runner = _runner(demo_model, "cpu")
    assert not runner.cond_free and all(v.all_greedy is None for v in runner.variants())
    assert _stats(runner, StepVariant(16)).conditionals > 0


def test_step_temporaries_do_not_grow_with_the_pool(demo_model):
    runner = _runner(demo_model, "cpu")
    assert runner.peak_temp_bytes(17) == runner.peak_temp_bytes(400) > 0


def test_local_target_follows_the_default_backend():
    assert StepTarget.local().platform == ("gpu" if jax.default_backend() == "gpu" else jax.default_backend())
    assert not StepTarget.local().is_abstract


def test_peak_temp_bytes_compiles_one_program_the_largest_variants_peak(demo_model):
    runner = _runner(demo_model, "gpu")
    largest = [v for v in runner.variants() if v.bucket == runner.buckets.token_buckets[-1]]
    assert len(largest) > 1  # a greedy and a random program: only one needs compiling
    with backend_compiles() as compiles:
        peak = runner.peak_temp_bytes(runner.num_blocks)
    assert len(compiles) == 1
    every = [runner.steps.lowered(v).compile().memory_analysis().temp_size_in_bytes for v in largest]
    assert peak == max(every) > 0


def test_a_gpu_lora_table_holds_a_rank_the_gpu_tiler_handles(demo_model):
    """XLA:GPU finds no tiles for ``x @ A`` of a rank-8 q|k|v table (3 slots or more): a GPU
    runner's tables hold a multiple of 16 (an adapter's smaller rank as zeros), while the flag
    itself, which bounds the adapters, is unchanged; the CPU keeps the flag's rank."""
    assert [StepTarget("gpu").lora_table_rank(r) for r in (1, 8, 16, 24, 64)] == [16, 16, 16, 32, 64]
    assert [StepTarget("cpu").lora_table_rank(r) for r in (1, 8, 24)] == [1, 8, 24]
    lora = dict(enable_lora=True, max_loras=3, max_lora_rank=8)
    model = load_model(demo_model, scan_layers=False)
    for platform, rank in (("gpu", 16), ("cpu", 8)):
        config = EngineConfig(attention_backend="xla", **CONFIG, **lora)
        runner = ModelRunner(config, model, 256, target=StepTarget(platform))
        _, b = runner.lora.tables
        assert {t.shape[1:3] for t in b.values()} == {(3, rank)}
        assert config.lora_config.max_lora_rank == 8
