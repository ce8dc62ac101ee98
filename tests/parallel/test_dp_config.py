"""``--data-parallel-size``: its flags, its validation and the device groups it asks for."""

from __future__ import annotations

import argparse

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.dp.placement import replica_device_groups
from jaxserve.exceptions import ConfigError


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return EngineConfig.from_cli_args(parser.parse_args(list(argv)))


def test_long_and_short_flags_set_the_size():
    assert parse().data_parallel_size == 1
    assert parse("--data-parallel-size", "4").data_parallel_size == 4
    assert parse("-dp", "2").data_parallel_size == 2
    assert parse(*EngineConfig(data_parallel_size=3).cli_flags()).data_parallel_size == 3


def test_a_size_below_one_is_refused():
    with pytest.raises(ConfigError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=0)


def test_each_replica_gets_its_own_consecutive_devices():
    devices = ["d0", "d1", "d2", "d3"]
    assert replica_device_groups(EngineConfig(data_parallel_size=3), devices) == [["d0"], ["d1"], ["d2"]]
    assert replica_device_groups(EngineConfig(), devices) == [["d0"]]


def test_a_replica_spans_tensor_parallel_size_devices():
    devices = [f"d{i}" for i in range(8)]
    groups = replica_device_groups(EngineConfig(data_parallel_size=2, tensor_parallel_size=4), devices)
    assert groups == [devices[:4], devices[4:]]
    with pytest.raises(ValueError, match="data_parallel_size=3 x tensor_parallel_size=4 needs 12 devices.*only 8"):
        replica_device_groups(EngineConfig(data_parallel_size=3, tensor_parallel_size=4), devices)


def test_too_few_devices_is_a_value_error_naming_both_sizes():
    with pytest.raises(ValueError, match=r"data_parallel_size=3 x tensor_parallel_size=1 needs 3 devices.*only 2"):
        replica_device_groups(EngineConfig(data_parallel_size=3), ["d0", "d1"])


def test_a_single_engine_front_end_refuses_several_replicas():
    from jaxserve import AsyncLLM

    with pytest.raises(ConfigError, match="DPAsyncLLM"):
        AsyncLLM.from_config(EngineConfig(data_parallel_size=2, model="/nonexistent/never-read"))
