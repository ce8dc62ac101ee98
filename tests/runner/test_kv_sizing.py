"""KV cache sizing with vLLM's meaning of gpu_memory_utilization, against a fake device."""

import dataclasses

import pytest

from jaxserve.config import EngineConfig
from jaxserve.models import ModelConfig
from jaxserve.runner.kv_cache import (
    DeviceMemory,
    blocks_for_budget,
    bytes_per_block,
    determine_num_blocks,
    kv_cache_budget,
)

GIB = 1024**3


def test_budget_is_the_utilization_share_less_weights_temporaries_and_reserve():
    # XLA told to preallocate 0.9 of an 80 GiB device: the pool is 72 GiB.
    memory = DeviceMemory(pool_bytes=72 * GIB, pool_fraction=0.9, held_bytes=2 * GIB)
    budget = kv_cache_budget(memory, 0.9, peak_temp_bytes=3 * GIB, reserve_bytes=1 * GIB)
    assert budget.total == 80 * GIB
    assert budget.usable == 72 * GIB
    assert budget.kv_bytes == (72 - 2 - 3 - 1) * GIB
    assert "66.00 GiB for the KV cache" in budget.describe()


def test_a_default_pool_smaller_than_the_share_caps_the_budget():
    # XLA's default preallocation (0.75 of 80 GiB = 60 GiB) cannot give 0.9 x 80 GiB.
    memory = DeviceMemory(pool_bytes=60 * GIB, pool_fraction=0.75, held_bytes=0)
    budget = kv_cache_budget(memory, 0.9, peak_temp_bytes=0, reserve_bytes=0)
    assert budget.total == 80 * GIB and budget.usable == 60 * GIB


def test_lower_utilization_than_the_pool_is_honoured():
    memory = DeviceMemory(pool_bytes=72 * GIB, pool_fraction=0.9, held_bytes=1 * GIB)
    assert kv_cache_budget(memory, 0.5, 0, 0).kv_bytes == 39 * GIB


def test_cache_must_hold_one_max_model_len_request():
    per_block = 1000
    assert blocks_for_budget(per_block * 65 + 999, per_block, block_size=16, max_model_len=1024) == 65
    with pytest.raises(ValueError, match="max_model_len=1024 needs 65"):
        blocks_for_budget(per_block * 64, per_block, block_size=16, max_model_len=1024)
    with pytest.raises(ValueError, match="kv cache"):
        blocks_for_budget(-5 * GIB, per_block, block_size=16, max_model_len=1024)


def _model_config(layers=28, kv_heads=8, head_dim=128):
    return ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"})


def test_gpu_sizing_through_determine_num_blocks():
    mc = _model_config()
    per_block = bytes_per_block(mc, 16)
    assert per_block == 2 * 28 * 16 * 8 * 128 * 2
    memory = DeviceMemory(pool_bytes=int(0.9 * 141 * GIB), pool_fraction=0.9, held_bytes=int(1.2 * GIB))
    blocks = determine_num_blocks(mc, EngineConfig(), 4096, platform="gpu", memory=memory,
                                  peak_temp_bytes=GIB)
    expected = kv_cache_budget(memory, 0.9, GIB).kv_bytes // per_block
    assert blocks == expected
    # The explicit knobs still win, in vLLM's order.
    assert determine_num_blocks(mc, EngineConfig(num_gpu_blocks_override=7), 4096, platform="gpu") == 7
    assert determine_num_blocks(mc, EngineConfig(kv_cache_memory=per_block * 300), 4096, platform="gpu") == 300
    with pytest.raises(ValueError, match="device's memory"):
        determine_num_blocks(mc, EngineConfig(), 4096, platform="gpu")
    small = DeviceMemory(pool_bytes=3 * GIB, pool_fraction=0.9, held_bytes=2 * GIB)
    with pytest.raises(ValueError, match="max_model_len=4096"):
        determine_num_blocks(mc, EngineConfig(), 4096, platform="gpu", memory=small, peak_temp_bytes=0)


def test_allocator_share_is_left_alone_once_jax_has_started(monkeypatch):
    import jax

    from jaxserve import envs
    from jaxserve.runner.kv_cache import configure_xla_allocator

    jax.devices()  # this process's backends are started
    monkeypatch.delenv(envs.XLA_PYTHON_CLIENT_MEM_FRACTION, raising=False)
    configure_xla_allocator(0.5)
    assert envs.xla_mem_fraction() is None


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_fp8_kv_cache_fits_twice_the_blocks_of_bfloat16(platform):
    """--kv-cache-dtype fp8 halves a bfloat16 model's bytes per block, so the same budget holds
    twice the blocks (and tokens)."""
    mc = _model_config()
    assert bytes_per_block(mc, 16, 1, "fp8") * 2 == bytes_per_block(mc, 16)
    memory = DeviceMemory(pool_bytes=int(0.9 * 141 * GIB), pool_fraction=0.9, held_bytes=int(1.2 * GIB))
    blocks = {dtype: determine_num_blocks(mc, EngineConfig(kv_cache_dtype=dtype, kv_cache_memory=GIB), 4096,
                                          platform=platform, memory=memory)
              for dtype in ("auto", "fp8")}
    assert blocks["fp8"] == 2 * blocks["auto"]
    by_share = {dtype: determine_num_blocks(mc, EngineConfig(kv_cache_dtype=dtype), 4096, platform="gpu",
                                            memory=memory, peak_temp_bytes=GIB) for dtype in ("auto", "fp8")}
    assert by_share["fp8"] - 2 * by_share["auto"] in (0, 1)  # the budget's remainder may hold one more


@pytest.mark.parametrize("head_dim", [64, 128])
def test_int8_kv_cache_blocks_are_counted_with_their_scales(head_dim):
    """--kv-cache-dtype int8 rows hold D int8 values and a float32 scale: the same bytes hold
    2 * D / (D + 4) times bfloat16's blocks (1.88x at D 64, 1.94x at 128) and 4 * D / (D + 4)
    times float32's (3.76x, 3.88x)."""
    bf16 = _model_config(head_dim=head_dim)
    f32 = dataclasses.replace(bf16, dtype="float32")
    per_block = bytes_per_block(bf16, 16, 1, "int8")
    assert per_block == 2 * 28 * 16 * 8 * (head_dim + 4)
    assert bytes_per_block(f32, 16, 1, "int8") == per_block  # the model's dtype does not matter
    budget = 3 * GIB
    blocks = {(name, dtype): determine_num_blocks(mc, EngineConfig(kv_cache_dtype=dtype, kv_cache_memory=budget), 4096)
              for name, mc in (("bf16", bf16), ("f32", f32)) for dtype in ("auto", "int8")}
    assert blocks["bf16", "int8"] == blocks["f32", "int8"] == budget // per_block
    for name, factor in (("bf16", 2), ("f32", 4)):
        want = factor * head_dim / (head_dim + 4)
        assert abs(blocks[name, "int8"] / blocks[name, "auto"] - want) < 0.01, name


def test_unknown_kv_cache_dtype_is_a_config_error():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="awq")
    for backend in ("pallas", "triton", "mosaic"):  # every kernel reads fp8 pools now
        assert EngineConfig(kv_cache_dtype="fp8", attention_backend=backend).kv_cache_dtype == "fp8"
