"""EngineConfig as the command line sees it: generated flags, their defaults and help, and the
flags that give a configuration back."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from jaxserve.config import EngineConfig
from jaxserve.exceptions import ConfigError


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return EngineConfig.from_cli_args(parser.parse_args(list(argv)))


def test_async_scheduling_is_the_default_and_can_be_turned_off():
    assert EngineConfig().async_scheduling and parse().async_scheduling
    assert not parse("--no-async-scheduling").async_scheduling


def test_hub_flags_use_vllms_names():
    config = parse("--revision", "v1.0", "--download-dir", "/models/hub")
    assert (config.revision, config.download_dir) == ("v1.0", "/models/hub")


def test_cli_flags_give_the_configuration_back():
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=1024, async_scheduling=False, scan_layers=True,
                          enable_prefix_caching=False, revision="main", gpu_memory_utilization=0.5)
    flags = config.cli_flags()
    assert "--no-async-scheduling" in flags and "--scan-layers" in flags and "--no-enable-prefix-caching" in flags
    assert parse(*flags) == config
    assert EngineConfig().cli_flags() == []


def test_help_states_each_default_once():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    helps = {a.dest: a.help for a in parser._actions if a.dest in {f.name for f in dataclasses.fields(EngineConfig)}}
    assert helps["block_size"].endswith("(default: 16)")
    assert "default: main" in helps["revision"] and "(default: None)" not in helps["revision"]
    assert all("default" in h.lower() for h in helps.values()), helps


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="max_model_len: must be >= 2, got 0"):
        EngineConfig(max_model_len=0)
    assert issubclass(ConfigError, ValueError)  # callers catching ValueError keep working


def test_lora_fields_are_checked():
    cfg = EngineConfig(model="m", enable_lora=True, max_loras=3)
    assert cfg.max_cpu_loras == 3
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineConfig(model="m", enable_lora=True, max_loras=3, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineConfig(model="m", enable_lora=True, max_lora_rank=0)
    with pytest.raises(ConfigError, match="enable_lora.*tensor_parallel_size=2"):
        EngineConfig(model="m", enable_lora=True, tensor_parallel_size=2)
