"""Compiling jaxserve's step for a GPU on a machine without one.

With the CUDA plugin installed, ``jax.experimental.topologies`` turns a ``GpuTargetConfig`` (a
text proto of :mod:`.gpu_targets`) into compile-only devices; arrays carrying their sharding lower and
compile through the real XLA:GPU pipeline (fusion, autotuning defaults, Triton for Pallas, ptxas)
with no GPU present. A runner built on such a target (:func:`abstract_runner`) never allocates:
its weights, KV pool and inputs are shapes only.

Tensor parallel: the topology ``1x1xN`` is N GPUs on one host (slices x hosts x devices per
host); a runner with ``tensor_parallel_size`` N compiles for a mesh over the first N of them,
its weights and KV pool carrying the plan's shardings (:mod:`jaxserve.runner.mesh`).
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
from jaxserve.runner.kv_cache import DeviceMemory, ProposerKV, blocks_for_budget, bytes_per_block, kv_cache_budget
from jaxserve.runner.mesh import REPLICATED, make_mesh, param_spec
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.target import StepTarget


def compile_only_devices(target_config: str, num_devices: int = 1) -> list:
    """``num_devices`` compile-only GPUs on one host, described by ``target_config`` (text proto).

    Needs the CUDA plugin (``jax[cuda12]``); raises RuntimeError naming what is missing.
    """
    envs.allow_cuda_plugin_without_gpu()
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                            topology=f"1x1x{num_devices}")
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise RuntimeError(f"cannot make compile-only CUDA devices here (is jax[cuda12] installed?): {e}") from e
    return list(topo.devices)


def compile_only_sharding(target_config: str, tensor_parallel_size: int = 1,
                          num_devices: int | None = None) -> jax.sharding.NamedSharding:
    """A replicated sharding over the tensor-parallel mesh of the first ``tensor_parallel_size``
    of ``num_devices`` (default: as many) compile-only GPUs on one host."""
    devices = compile_only_devices(target_config, num_devices or tensor_parallel_size)
    mesh = make_mesh(devices[:tensor_parallel_size], tensor_parallel_size)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def abstract_model(preset: str, scan_layers: bool | None, tensor_parallel_size: int = 1,
                   quantization: str | None = None, num_layers: int | None = None) -> LlamaForCausalLM:
    """The model of a benchmark preset, shapes only (no weights are made), laid out for
    ``tensor_parallel_size`` shards; ``quantization`` ("int8", "fp8") keeps the projections so;
    ``num_layers`` replaces its depth (the attention kernel's variants do not depend on it)."""
    cfg = ModelConfig.from_dict(preset_config(preset, **({} if num_layers is None else
                                                         {"num_hidden_layers": num_layers})))
    return nnx.eval_shape(lambda: LlamaForCausalLM(cfg, scan_layers=scan_layers, quantization=quantization,
                                                   tensor_parallel_size=tensor_parallel_size, rngs=nnx.Rngs(0)))


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the weights on one device: a split parameter's block, a replicated one whole."""
    n = model.tensor_parallel_size
    total = 0
    for path, x in nnx.to_flat_state(nnx.state(model)):
        size = x.size * x.dtype.itemsize
        total += size if param_spec(path, len(x.shape)) == REPLICATED else size // n
    return total


def kv_blocks_on(spec: GpuSpec, model: LlamaForCausalLM, config: EngineConfig, max_model_len: int,
                 peak_temp_bytes: int, proposer: ProposerKV | None = None,
                 proposer_weight_bytes: int = 0) -> tuple[int, Any]:
    """KV blocks the engine would size on this GPU (vLLM's gpu_memory_utilization), and the
    budget; a speculating engine's ``proposer`` pool and weights share it."""
    memory = DeviceMemory(pool_bytes=int(config.gpu_memory_utilization * spec.memory_bytes),
                          pool_fraction=config.gpu_memory_utilization,
                          held_bytes=weight_bytes(model) + proposer_weight_bytes)
    budget = kv_cache_budget(memory, config.gpu_memory_utilization, peak_temp_bytes)
    per_block = bytes_per_block(model.config, config.block_size, config.tensor_parallel_size,
                                config.kv_cache_dtype)
    extra = proposer or ProposerKV(0)
    return blocks_for_budget(budget.kv_bytes - extra.fixed, per_block + extra.per_block, config.block_size,
                             max_model_len), budget


def abstract_runner(model: LlamaForCausalLM, config: EngineConfig, sharding: Any,
                    max_model_len: int | None = None, draft: Any = None) -> ModelRunner:
    """A runner whose step lowers and compiles for ``sharding``'s device; it cannot run.
    ``draft``: a speculating config's draft or EAGLE head, shapes only (:mod:`.gpu_aot_draft`)."""
    max_model_len = max_model_len or model.config.max_position_embeddings
    return ModelRunner(config, model, max_model_len, target=StepTarget.abstract(sharding), draft=draft)


_HLO_FLOATS = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def lora_table_shapes(runner: ModelRunner, per_device: bool = True,
                      flat_slices: bool = True) -> set[tuple[str, tuple[int, ...]]]:
    """The LoRA slot tables of a LoRA runner as HLO (dtype, dims), each device's block (or, with
    ``per_device`` False, the whole table), and one layer's slice of each (with ``flat_slices``
    also with its last two axes merged): a copy of any of them in a step is a table copied where
    the matmuls should read it in place."""
    shapes = set()
    for table in jax.tree.leaves(runner.lora.tables if runner.lora is not None else ()):
        dims = tuple(table.sharding.shard_shape(table.shape) if per_device else table.shape)
        dtype = _HLO_FLOATS.get(str(table.dtype), str(table.dtype))
        shapes |= {(dtype, dims), (dtype, dims[1:])}
        if flat_slices:  # the view XLA writes a layer's slice out in before a dot: (in, slots*width)
            shapes.add((dtype, (*dims[1:-2], dims[-2] * dims[-1])))
    return shapes


def lower_pooling_step(model: LlamaForCausalLM, sharding: Any, bucket: int, *, backend: str = "pallas",
                       task: str = "embed", pooling_type: str = "LAST", max_num_seqs: int = 256,
                       max_model_len: int = 8192, block_size: int = 16, num_blocks: int = 4096):
    """The pooling engine's step for one token bucket (:mod:`jaxserve.runner.pooling_step`), lowered
    for ``sharding``'s device with every argument a shape: the abstract weights, a KV pool of
    ``num_blocks`` (donated) and the packed inputs the pooling runner builds. Returns the lowered
    program and the pool's shapes."""
    import pallas_kernels
    from jaxserve.models.pooling_config import PoolerConfig
    from jaxserve.runner.kv_cache import allocate_kv_cache
    from jaxserve.runner.pooling_step import make_decoder_step

    attn_fn = pallas_kernels.get_attention_fn(backend, interpret=False)
    step, weights = make_decoder_step(model, task, PoolerConfig(pooling_type=pooling_type), attn_fn)
    placed = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)  # noqa: E731
    weights = jax.tree.map(placed, weights)
    kv = jax.tree.map(placed, jax.eval_shape(lambda: allocate_kv_cache(model.config, num_blocks, block_size)))
    rows, width = min(bucket, max_num_seqs), -(-max_model_len // block_size)
    i32, spec = "int32", {"input_ids": (bucket,), "positions": (bucket,), "slot_mapping": (bucket,),
                          "block_tables": (rows, width), "kv_lens": (rows,), "query_start_loc": (rows + 1,),
                          "num_seqs": (1,), "starts": (rows,), "lens": (rows,), "counts": (rows,)}
    x = {name: jax.ShapeDtypeStruct(shape, i32, sharding=sharding) for name, shape in spec.items()}
    x["carry"] = jax.ShapeDtypeStruct((rows, model.config.hidden_size), "float32", sharding=sharding)
    x["first"] = jax.ShapeDtypeStruct((rows,), "bool", sharding=sharding)
    return step.lower(weights, kv, x), kv
