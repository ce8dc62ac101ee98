"""EngineConfig as the command line sees it: generated flags, their defaults and help, and the
flags that give a configuration back."""

from __future__ import annotations

import argparse
import copy as copy_module
import dataclasses
import pickle

import pytest

from jaxserve.config import EngineConfig, SubConfig, sub_config
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
    helps = {a.dest: a.help for a in parser._actions if a.dest in {f.name for f in EngineConfig.flags()}}
    assert len(helps) == len(EngineConfig.flags()) - 1  # every field but model
    assert helps["block_size"].endswith("(default: 16)")
    assert "default: main" in helps["revision"] and "(default: None)" not in helps["revision"]
    assert all("default" in h.lower() for h in helps.values()), helps


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="max_model_len: must be >= 2, got 0"):
        EngineConfig(max_model_len=0)
    assert issubclass(ConfigError, ValueError)  # callers catching ValueError keep working


def test_flat_fields_read_and_write_their_sub_configuration():
    config = EngineConfig(max_num_seqs=8, block_size=32, max_n=4)
    parts = (config.scheduler_config.max_num_seqs, config.cache_config.block_size, config.limits_config.max_n)
    assert parts == (8, 32, 4)
    config.max_num_seqs = 3
    assert config.scheduler_config.max_num_seqs == 3 and config.max_num_seqs == 3
    with pytest.raises(AttributeError, match="no attribute 'no_such_field'"):
        _ = config.no_such_field
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_field'"):
        EngineConfig(no_such_field=1)


def test_sub_configurations_are_given_whole_or_overridden_flat_and_never_shared():
    from jaxserve.config import SchedulerConfig

    given = SchedulerConfig(max_num_seqs=16)
    config = EngineConfig(scheduler_config=given, max_num_batched_tokens=512)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (16, 512)
    assert config.scheduler_config is not given and given.max_num_batched_tokens == 2048
    copy = dataclasses.replace(config, seed=7)
    assert (copy.seed, config.seed, copy.max_num_seqs) == (7, 0, 16)
    copy.max_num_seqs = 1
    assert config.max_num_seqs == 16
    assert pickle.loads(pickle.dumps(config)) == config
    shallow = copy_module.copy(config)
    shallow.max_num_seqs = 2
    assert shallow == dataclasses.replace(config, max_num_seqs=2) and config.max_num_seqs == 16
    assert EngineConfig(**config.as_kwargs()) == config
    with pytest.raises(TypeError, match="scheduler_config must be a SchedulerConfig"):
        EngineConfig(scheduler_config={"max_num_seqs": 1})


def test_each_sub_configuration_validates_itself():
    from jaxserve.config import CacheConfig, LoadConfig, ParallelConfig, SchedulerConfig

    with pytest.raises(ConfigError, match="max_model_len: must be >= 2, got 1"):
        LoadConfig(max_model_len=1)
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=3)
    with pytest.raises(ConfigError, match="node_rank"):
        ParallelConfig(nnodes=2, node_rank=2)
    assert SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=16).max_num_seqs == 16  # capped by the budget
    core = SchedulerConfig(scheduling_policy="priority", max_num_seqs=4).for_scheduler(128)
    assert (core.policy, core.max_num_seqs, core.max_model_len, core.async_scheduling) == ("priority", 4, 128, True)
    # Across sub-configurations: EngineConfig.validate (LoRA now splits as its base weights do).
    assert EngineConfig(enable_lora=True, tensor_parallel_size=2).tensor_parallel_size == 2
    EngineConfig(kv_cache_dtype="fp8", attention_backend="pallas")  # every backend reads fp8 pages now


@dataclasses.dataclass
class _WidgetConfig(SubConfig):
    widget_count: int = 1
    """How many widgets; default: one."""

    def validate(self) -> None:
        if self.widget_count < 0:
            raise self.bad("widget_count", "must be >= 0")


@dataclasses.dataclass(init=False)
class _EngineConfigWithWidgets(EngineConfig):
    widget_config: _WidgetConfig = sub_config(_WidgetConfig)


def test_a_feature_sub_configuration_is_one_class_and_one_line():
    config = _EngineConfigWithWidgets(widget_count=3, max_num_seqs=2)
    assert (config.widget_config.widget_count, config.widget_count, config.max_num_seqs) == (3, 3, 2)
    parser = argparse.ArgumentParser()
    _EngineConfigWithWidgets.add_cli_args(parser)
    parsed = _EngineConfigWithWidgets.from_cli_args(parser.parse_args(["--widget-count", "5"]))
    assert parsed.widget_count == 5 and parsed.cli_flags() == ["--widget-count", "5"]
    with pytest.raises(ConfigError, match="widget_count: must be >= 0, got -1"):
        _EngineConfigWithWidgets(widget_count=-1)


def test_a_field_name_defined_twice_is_refused():
    @dataclasses.dataclass
    class Clash(SubConfig):
        max_num_seqs: int = 1
        """Clashes with the scheduler's."""

    @dataclasses.dataclass(init=False)
    class Clashing(EngineConfig):
        clash_config: Clash = sub_config(Clash)

    with pytest.raises(TypeError, match="'max_num_seqs' is defined twice"):
        Clashing()


def test_lora_fields_are_checked():
    cfg = EngineConfig(model="m", enable_lora=True, max_loras=3)
    assert cfg.max_cpu_loras == 3
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineConfig(model="m", enable_lora=True, max_loras=3, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineConfig(model="m", enable_lora=True, max_lora_rank=0)
