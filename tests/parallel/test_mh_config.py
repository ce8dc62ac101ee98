"""The multi-node settings: vLLM's flag names, JAX's own coordinator variable, clear refusals."""

from __future__ import annotations

import argparse

import pytest

from jaxserve.config import EngineConfig
from jaxserve.exceptions import ConfigError

# Two nodes need a mesh that spans both: two devices at least.
TWO = dict(nnodes=2, tensor_parallel_size=2)


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return EngineConfig.from_cli_args(parser.parse_args(list(argv)))


def test_flags_use_vllms_names():
    config = parse("--nnodes", "2", "-tp", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                   "--master-port", "1234", "--node-heartbeat-timeout-s", "5")
    assert (config.nnodes, config.node_rank, config.node_heartbeat_timeout_s) == (2, 1, 5)
    assert config.is_multi_node and config.coordinator_address() == "10.0.0.1:1234"
    assert not EngineConfig().is_multi_node


def test_coordinator_defaults_to_jax_coordinator_address_then_vllms(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert EngineConfig(**TWO).coordinator_address() == "127.0.0.1:29501"
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "node0.cluster:7777")
    assert EngineConfig(**TWO).coordinator_address() == "node0.cluster:7777"
    # each flag overrides its own part only
    assert EngineConfig(**TWO, master_port=9000).coordinator_address() == "node0.cluster:9000"
    assert EngineConfig(**TWO, master_addr="10.1.1.1").coordinator_address() == "10.1.1.1:7777"
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "[fd00::1]:7000")
    assert EngineConfig(**TWO).coordinator_address() == "[fd00::1]:7000"


@pytest.mark.parametrize("fields, field", [
    (dict(nnodes=0), "nnodes"),
    (dict(TWO, node_rank=2), "node_rank"),
    (dict(node_rank=1), "node_rank"),
    (dict(TWO, node_rank=-1), "node_rank"),
    (dict(TWO, master_port=70000), "master_port"),
    (dict(TWO, master_addr="10.0.0.1:1234"), "master_addr"),
    (dict(TWO, master_addr=" "), "master_addr"),
    (dict(TWO, node_heartbeat_timeout_s=0), "node_heartbeat_timeout_s"),
])
def test_bad_settings_are_refused_naming_the_field(fields, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        EngineConfig(**fields)


def test_a_bracketed_ipv6_master_addr_is_accepted():
    assert EngineConfig(**TWO, master_addr="[fd00::1]", master_port=1).coordinator_address() == "[fd00::1]:1"


def test_the_tensor_parallel_size_must_split_evenly_over_the_nodes():
    assert EngineConfig(nnodes=2, tensor_parallel_size=8).tensor_parallel_size == 8
    for size in (1, 3):
        with pytest.raises(ConfigError, match="^tensor_parallel_size: must be a multiple of nnodes"):
            EngineConfig(nnodes=2, tensor_parallel_size=size)


def test_a_rank_above_0_builds_no_engine_of_its_own():
    from jaxserve import LLM

    with pytest.raises(ConfigError, match="^node_rank: 1 runs headless"):
        LLM(nnodes=2, node_rank=1, tensor_parallel_size=2)
