"""Tensor-parallel engines on eight fake CPU devices, run in a process of their own.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.parallel.tp_runs OUT.json [--full]

The suite's own process started jax with one CPU device, so ``test_tp_engine.py`` runs this
module in a fresh one (:func:`run_in_subprocess`). Each case builds an ``LLM`` with
``tensor_parallel_size`` N on a tiny architecture (eight attention heads, so every N in 1, 2, 4, 8
divides them) and runs one workload: a first batch that needs chunked prefill and preemption (a
small KV pool), then a prompt extending an earlier one (a prefix-cache hit); async scheduling is
on (the default). The JSON holds per case the greedy tokens, their top logprobs, the scheduler's
preemption and prefix-hit counts, the bytes each device holds of the weights and the
collectives of one compiled step.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.parallel.device_runs import run_module

DEVICES = 8
XLA_FLAGS = f"--xla_force_host_platform_device_count={DEVICES}"
HEADS = 8  # every tensor-parallel size up to DEVICES divides them

# (architecture, tensor_parallel_size, attention backend): TP=1 is each architecture's reference.
# Qwen3 (q/k norms, tied embeddings, head_dim apart from hidden) runs every size; Mistral's single
# key/value head is replicated on 8 shards, through the C++ cpu kernel; Qwen2 brings the q|k|v
# biases (otherwise it is Llama); Qwen3-MoE runs with enable_expert_parallel. --full runs every
# size on every dense architecture.
CASES = [
    ("Qwen3ForCausalLM", 1, "xla"), ("Qwen3ForCausalLM", 2, "xla"), ("Qwen3ForCausalLM", 4, "xla"),
    ("Qwen3ForCausalLM", 8, "xla"),
    ("MistralForCausalLM", 1, "xla"), ("MistralForCausalLM", 8, "cpu"),
    ("Qwen2ForCausalLM", 1, "xla"), ("Qwen2ForCausalLM", 4, "xla"),
    # a mixture-of-experts model: attention split by heads, its 8 experts split whole (2 a device)
    ("Qwen3MoeForCausalLM", 1, "xla"), ("Qwen3MoeForCausalLM", 4, "xla"),
    # gpt-oss: attention sinks split with their heads (the cpu kernel), biased experts split whole
    ("GptOssForCausalLM", 1, "cpu"), ("GptOssForCausalLM", 2, "cpu"),
]
FULL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=24)
LOGPROBS = 4
# gpt-oss's two KV groups: a block id is a page in each, and a request holds blocks in both (its
# 45 + 8 tokens: 14 full-attention blocks and 5 in the window's), so it needs a larger pool to fit
ENGINE_OVERRIDES = {"GptOssForCausalLM": dict(num_gpu_blocks_override=40)}


def prompts() -> tuple[list[list[int]], list[int]]:
    """The first batch (45 + 11 + 28 + 33 tokens with outputs: more than the 23 free blocks of 4
    hold at once, so some request is preempted) and a prompt extending the first one."""
    first = [list(range(3, 40)), [5, 6, 7], list(range(100, 120)), list(range(200, 225))]
    return first, first[0] + [41, 42, 43, 44, 45]


def build_checkpoint(root: Path, arch: str) -> str:
    from jaxserve.models.demo import build_checkpoint
    from tests.tiny_models import TINY_CONFIGS, TINY_HYBRID_CONFIGS, TINY_MOE_CONFIGS

    config = {**TINY_CONFIGS, **TINY_MOE_CONFIGS, **TINY_HYBRID_CONFIGS}[arch]
    return str(build_checkpoint(root / arch, arch, {**config, "num_attention_heads": HEADS}, seed=1))


def run_case(path: str, tp: int, backend: str) -> dict:
    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.hlo_collectives import count_collectives
    from jaxserve.models.tp_layout import TPLayout
    from jaxserve.runner.mesh import bytes_per_device

    llm = LLM(path, tensor_parallel_size=tp, attention_backend=backend, show_progress=False,
              enable_expert_parallel=any(m in Path(path).name for m in ("Moe", "GptOss")),
              **{**ENGINE, **ENGINE_OVERRIDES.get(Path(path).name, {})})
    core = llm.llm_engine.core
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=LOGPROBS)
    first, extended = prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in first], params, use_tqdm=False)
    preemptions = core.scheduler.make_stats().num_preemptions
    outputs += llm.generate([{"prompt_token_ids": extended}], params, use_tqdm=False)
    runner = core.runner
    step = runner.steps.get(runner.variants()[0])
    split = [x for x in runner.model_state if any(axis is not None for axis in x.sharding.spec)]
    return {
        "arch": Path(path).name, "tp": tp, "backend": runner.attention_backend,
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "logprobs": [[{str(k): v.logprob for k, v in row.items()} for row in o.outputs[0].logprobs]
                     for o in outputs],
        "preemptions": preemptions,
        "prefix_hits": core.scheduler.make_stats().prefix_cache_hits,
        "weight_bytes_per_device": sorted(bytes_per_device(runner.model_state).values()),
        "split_weight_bytes_per_device": sorted(bytes_per_device(split).values()),
        "split_weight_bytes_total": sum(x.size * x.dtype.itemsize for x in split),
        "device_ids": [d.id for d in runner.devices],
        "num_layers": runner.mc.num_hidden_layers,
        "kv_replicas": TPLayout.of(runner.mc, tp).kv_replicas,
        "weight_shapes": [list(x.shape) for x in runner.model_state],
        **count_collectives(step.as_text()).as_dict(),
    }


def main(out: str, full: bool) -> None:
    cases = CASES
    if full:
        cases = [(arch, tp, "xla") for arch in FULL_ARCHITECTURES for tp in (1, 2, 4, 8)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = {arch: build_checkpoint(Path(tmp), arch) for arch in dict.fromkeys(a for a, _, _ in cases)}
        results = [run_case(paths[arch], tp, backend) for arch, tp, backend in cases]
    Path(out).write_text(json.dumps(results))


def run_in_subprocess(out: Path, timeout: float, full: bool = False) -> list[dict]:
    """This module in a fresh process with :data:`DEVICES` CPU devices; its results."""
    return run_module("tests.parallel.tp_runs", out, DEVICES, timeout, *(["--full"] if full else []))


if __name__ == "__main__":
    main(sys.argv[1], "--full" in sys.argv[2:])
