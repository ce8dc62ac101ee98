"""Compiling jaxserve's step for a GPU on a machine without one.

With the CUDA plugin installed, ``jax.experimental.topologies`` turns a ``GpuTargetConfig`` (a
text proto of :mod:`.gpu_targets`) into compile-only devices; arrays carrying their sharding lower and
compile through the real XLA:GPU pipeline (fusion, autotuning defaults, Triton for Pallas, ptxas)
with no GPU present. A runner built on such a target (:func:`abstract_runner`) never allocates:
its weights, KV pool and inputs are shapes only.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxserve import envs
from jaxserve.bench.gpu_targets import GpuSpec
from jaxserve.bench.presets import preset_config
from jaxserve.config import EngineConfig
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.runner.kv_cache import DeviceMemory, blocks_for_budget, bytes_per_block, kv_cache_budget
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.target import StepTarget


def compile_only_sharding(target_config: str) -> jax.sharding.NamedSharding:
    """A replicated sharding over one compile-only GPU described by ``target_config`` (text proto).

    Needs the CUDA plugin (``jax[cuda12]``); raises RuntimeError naming what is missing.
    """
    envs.allow_cuda_plugin_without_gpu()
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config, topology="1x1x1")
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise RuntimeError(f"cannot make compile-only CUDA devices here (is jax[cuda12] installed?): {e}") from e
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def abstract_model(preset: str, scan_layers: bool | None) -> LlamaForCausalLM:
    """The model of a benchmark preset, shapes only (no weights are made)."""
    cfg = ModelConfig.from_dict(preset_config(preset))
    return nnx.eval_shape(lambda: LlamaForCausalLM(cfg, scan_layers=scan_layers, rngs=nnx.Rngs(0)))


def weight_bytes(model: LlamaForCausalLM) -> int:
    _, state = nnx.split(model)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def kv_blocks_on(spec: GpuSpec, model: LlamaForCausalLM, config: EngineConfig, max_model_len: int,
                 peak_temp_bytes: int) -> tuple[int, Any]:
    """KV blocks the engine would size on this GPU (vLLM's gpu_memory_utilization), and the budget."""
    memory = DeviceMemory(pool_bytes=int(config.gpu_memory_utilization * spec.memory_bytes),
                          pool_fraction=config.gpu_memory_utilization, held_bytes=weight_bytes(model))
    budget = kv_cache_budget(memory, config.gpu_memory_utilization, peak_temp_bytes)
    per_block = bytes_per_block(model.config, config.block_size)
    return blocks_for_budget(budget.kv_bytes, per_block, config.block_size, max_model_len), budget


def abstract_runner(model: LlamaForCausalLM, config: EngineConfig, sharding: Any,
                    max_model_len: int | None = None) -> ModelRunner:
    """A runner whose step lowers and compiles for ``sharding``'s device; it cannot run."""
    max_model_len = max_model_len or model.config.max_position_embeddings
    return ModelRunner(config, model, max_model_len, target=StepTarget.abstract(sharding))
