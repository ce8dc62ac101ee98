"""Tensor parallelism in the suite's own process (one CPU device): the flag, the checks made
before any weight is read, and a runner given a device keeping every array on it."""

from __future__ import annotations

import argparse

import jax
import pytest

from jaxserve.config import EngineConfig
from jaxserve.exceptions import ConfigError
from jaxserve.models import ModelConfig, load_model
from jaxserve.models.tp_layout import TPLayout, check_tensor_parallel_size
from jaxserve.runner.mesh import TP_AXIS, make_mesh, param_spec, select_devices
from jaxserve.runner.model_runner import ModelRunner


def test_tp_flag_long_and_short_spelling():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert parser.parse_args(["-tp", "4"]).tensor_parallel_size == 4
    assert parser.parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    assert EngineConfig(tensor_parallel_size=2).cli_flags() == ["--tensor-parallel-size", "2"]
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_a_size_that_splits_no_head_evenly_names_heads_and_size(qwen3_checkpoint):
    cfg = ModelConfig.from_pretrained(qwen3_checkpoint)
    with pytest.raises(ValueError, match=rf"tensor_parallel_size 3 does not divide the model's "
                                         rf"{cfg.num_attention_heads} attention heads"):
        check_tensor_parallel_size(cfg, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        load_model(qwen3_checkpoint, tensor_parallel_size=3)


def test_more_shards_than_devices_is_refused_naming_both():
    present = len(jax.devices())
    with pytest.raises(ValueError, match=f"tensor_parallel_size {present + 1} exceeds the {present} "):
        select_devices(present + 1)


def test_kv_heads_fewer_than_shards_are_replicated(qwen3_checkpoint):
    cfg = ModelConfig.from_pretrained(qwen3_checkpoint)
    size = cfg.num_attention_heads
    layout = TPLayout.of(cfg, size)
    assert layout.kv_heads_per_shard == 1
    assert layout.stored_kv_heads == size
    # each shard's key/value head is the one its query heads attend to (grouped-query order)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for shard in range(size):
        assert layout.kv_heads_of_shard(shard) == [shard * layout.q_heads_per_shard // group]


def test_plan_splits_columns_rows_and_vocab_and_replicates_norms():
    assert param_spec(("layers", 0, "self_attn", "qkv_proj", "kernel"), 2) == jax.P(None, TP_AXIS)
    assert param_spec(("layers", "stacked", "mlp", "down_proj", "kernel"), 3) == jax.P(None, TP_AXIS, None)
    assert param_spec(("embed_tokens", "embedding"), 2) == jax.P(TP_AXIS, None)
    assert param_spec(("lm_head", "kernel"), 2) == jax.P(None, TP_AXIS)
    assert param_spec(("layers", 1, "input_layernorm", "scale"), 1) == jax.P()
    assert param_spec(("layers", 1, "self_attn", "o_proj", "bias"), 1) == jax.P()


def test_runner_given_a_device_keeps_every_array_on_it(qwen3_checkpoint):
    device = jax.devices()[-1]
    config = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, attention_backend="xla")
    runner = ModelRunner(config, load_model(qwen3_checkpoint), 64, devices=[device])
    assert runner.mesh == make_mesh([device], 1)
    arrays = jax.tree.leaves((runner.model_state, runner.state))
    assert arrays and all(x.devices() == {device} for x in arrays)
