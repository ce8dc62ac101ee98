"""``jaxserve bench roofline``: the fastest a step of each token bucket can run on a GPU.

A step moves at least its weights, the KV cache its attention reads and writes, and its
activations (including the sampler's [R, V] logits passes) through HBM, and does at least its
matmul and attention FLOPs; its time is at least the larger of bytes / bandwidth and FLOPs /
peak, so tokens/s is at most tokens / that time. The yardstick a lent GPU is judged against.

Per bucket of the engine's table: a decode bucket (``T <= max_num_seqs``) is ``T`` sequences of
``context_len`` tokens advancing one token each; a larger bucket is ``T`` prompt tokens in
prompts of ``context_len`` (the last one shorter). Attention reads each sequence's KV once per
step (an ideal kernel). Weights and KV are exact from the model's shapes; activations are counted
per token from the layer widths. ``--compile`` (needs the CUDA plugin) also compiles each bucket
for the GPU and reports XLA's FLOPs for everything but the attention kernel (the cost analysis of
the lowered step, reliable for FLOPs; the compiled executable has none when compiled without a
GPU) and the step's temporary memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

from jaxserve.bench.gpu_targets import BF16_PEAK_FLOPS, GpuSpec, gpu_spec, target_config_path
from jaxserve.bench.presets import PRESETS, preset_config
from jaxserve.config import CacheConfig, EngineConfig

if TYPE_CHECKING:  # the command line builds its parser without importing jax
    from jaxserve.models.config import ModelConfig

SAMPLER_LOGITS_PASSES = 4  # the f32 [R, V] logits: written by the head, read by softmax, argmax, logprobs


@dataclasses.dataclass(frozen=True)
class StepShape:
    tokens: int  # scheduled tokens (the bucket)
    seqs: int  # sequences in the step
    kv_read_tokens: int  # context tokens attention reads, over all sequences
    attended_pairs: int  # (query, key) pairs attention computes
    decode: bool


def step_shape(bucket: int, max_num_seqs: int, context_len: int) -> StepShape:
    if bucket <= max_num_seqs:
        return StepShape(bucket, bucket, bucket * context_len, bucket * context_len, True)
    full, rest = divmod(bucket, context_len)
    lengths = [context_len] * full + ([rest] if rest else [])
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return StepShape(bucket, len(lengths), bucket, pairs, False)


def weight_bytes(mc: ModelConfig, itemsize: int) -> int:
    h, i = mc.hidden_size, mc.intermediate_size
    per_layer = h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h + h * 2 * i + i * h + 2 * h
    if mc.qk_norm:
        per_layer += 2 * mc.head_dim
    heads = 1 if mc.tie_word_embeddings else 2
    return (mc.num_hidden_layers * per_layer + heads * mc.vocab_size * h + h) * itemsize


def kv_bytes_per_token(mc: ModelConfig, itemsize: int) -> int:
    return 2 * mc.num_hidden_layers * mc.kv_size * itemsize


def matmul_flops_per_token(mc: ModelConfig) -> int:
    h, i = mc.hidden_size, mc.intermediate_size
    per_layer = h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h + h * 2 * i + i * h
    return 2 * mc.num_hidden_layers * per_layer


def activation_bytes(mc: ModelConfig, shape: StepShape, itemsize: int) -> int:
    """Per token and layer: the residual stream and norms (~6 hidden-wide passes), q|k|v and the
    attention output, and the MLP's gate|up and product; plus the sampler's logits passes."""
    per_token_layer = (6 * mc.hidden_size + 2 * (mc.q_size + 2 * mc.kv_size) + 2 * mc.q_size
                       + 3 * 2 * mc.intermediate_size) * itemsize
    return (shape.tokens * mc.num_hidden_layers * per_token_layer
            + SAMPLER_LOGITS_PASSES * shape.seqs * mc.vocab_size * 4)


def roofline_row(mc: ModelConfig, spec: GpuSpec, shape: StepShape, itemsize: int) -> dict:
    weights = weight_bytes(mc, itemsize)
    kv_read = shape.kv_read_tokens * kv_bytes_per_token(mc, itemsize)
    kv_write = shape.tokens * kv_bytes_per_token(mc, itemsize)
    acts = activation_bytes(mc, shape, itemsize)
    total = weights + kv_read + kv_write + acts
    flops = (shape.tokens * matmul_flops_per_token(mc) + 2 * shape.seqs * mc.hidden_size * mc.vocab_size
             + 4 * shape.attended_pairs * mc.num_attention_heads * mc.head_dim * mc.num_hidden_layers)
    memory_s, compute_s = total / spec.hbm_bytes_per_s, flops / spec.bf16_flops
    step_s = max(memory_s, compute_s)
    tokens = shape.seqs if shape.decode else shape.tokens
    return {"bucket": shape.tokens, "kind": "decode" if shape.decode else "prefill", "seqs": shape.seqs,
            "weights_gb": weights / 1e9, "kv_read_gb": kv_read / 1e9, "kv_write_gb": kv_write / 1e9,
            "activations_gb": acts / 1e9, "total_gb": total / 1e9, "tflop": flops / 1e12,
            "bound": "memory" if memory_s >= compute_s else "compute", "step_ms": step_s * 1e3,
            "ceiling_tok_s": tokens / step_s}


def request_lengths(shape: StepShape, context_len: int) -> list[tuple[int, int]]:
    """(q_len, kv_len) per sequence of a roofline step shape."""
    if shape.decode:
        return [(1, context_len)] * shape.seqs
    full, rest = divmod(shape.tokens, context_len)
    return [(context_len, context_len)] * full + ([(rest, rest)] if rest else [])


def mosaic_columns(mc: ModelConfig, spec: GpuSpec, shape: StepShape, *, context_len: int, max_num_seqs: int,
                   block_size: int, max_model_len: int, itemsize: int = 2) -> dict:
    """The roofline row's mosaic columns: the modelled attention time of the whole step (every
    layer) next to the ideal (KV read once at full bandwidth, exact FLOPs at peak)."""
    from jaxserve.bench.mosaic_time_model import estimate_layer

    est = estimate_layer(mc, spec, request_lengths(shape, context_len), num_tokens=shape.tokens,
                         num_seqs=min(max_num_seqs, shape.tokens), block_size=block_size,
                         max_model_len=max_model_len, itemsize=itemsize)
    layers = mc.num_hidden_layers
    kv_bytes = shape.kv_read_tokens * 2 * mc.num_key_value_heads * mc.head_dim * itemsize
    ideal_flops = 4 * shape.attended_pairs * mc.num_attention_heads * mc.head_dim
    ideal = max(kv_bytes / spec.hbm_bytes_per_s, ideal_flops / spec.bf16_flops)
    return {"mosaic_attn_ms": layers * est.seconds * 1e3, "ideal_attn_ms": layers * ideal * 1e3,
            "mosaic_bound": est.bound, "mosaic_ctas": est.ctas, "mosaic_waves": est.waves,
            "mosaic_steps_per_cta": est.max_steps, "mosaic_stage_kib": est.stage_bytes / 1024,
            "mosaic_smem_kib": est.smem_bytes / 1024, "mosaic_wgmma_per_step": est.wgmma_per_step,
            "mosaic_hbm_gb_per_layer": est.hbm_bytes / 1e9, "mosaic_tflop_per_layer": est.flops / 1e12}


def xla_step_figures(preset: str, config: EngineConfig, target_config: str, buckets: list[int]) -> dict[int, dict]:
    """Per bucket: XLA's FLOPs of the lowered step (attention kernel excluded) and the compiled
    step's temporary bytes, compiled for the GPU without one."""
    from jaxserve.bench import gpu_aot

    sharding = gpu_aot.compile_only_sharding(target_config)
    model = gpu_aot.abstract_model(preset, False)
    runner = gpu_aot.abstract_runner(model, config.replace(num_gpu_blocks_override=4096), sharding,
                                     max_model_len=4096)
    out = {}
    for variant in runner.variants():
        decode = variant.bucket <= config.max_num_seqs
        if variant.bucket in buckets and variant.all_greedy and variant.decode_only == decode:
            lowered = runner.steps.lowered(variant)
            cost = lowered.cost_analysis() or {}
            temp = lowered.compile().memory_analysis().temp_size_in_bytes
            out[variant.bucket] = {"xla_tflop_without_attention": cost.get("flops", 0.0) / 1e12,
                                   "temp_mb": temp / 1e6}
    return out


def table(rows: list[dict]) -> str:
    lines = ["| bucket | kind | seqs | weights GB | KV read GB | activations GB | total GB | TFLOP | bound "
             "| step ms | ceiling tok/s | attention ms: ideal / mosaic model (bound) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        attn = (f"{r['ideal_attn_ms']:.3f} / {r['mosaic_attn_ms']:.3f} ({r['mosaic_bound']})"
                if "mosaic_attn_ms" in r else "-")
        lines.append(f"| {r['bucket']} | {r['kind']} | {r['seqs']} | {r['weights_gb']:.2f} | {r['kv_read_gb']:.2f} "
                     f"| {r['activations_gb']:.2f} | {r['total_gb']:.2f} | {r['tflop']:.2f} | {r['bound']} "
                     f"| {r['step_ms']:.2f} | {r['ceiling_tok_s']:,.0f} | {attn} |")
    return "\n".join(lines)


def add_roofline_args(p: argparse.ArgumentParser) -> None:
    dense = sorted(k for k, v in PRESETS.items() if "Moe" not in str(v.get("architecture")))
    p.add_argument("--model", default="qwen3-0.6b", choices=dense,
                   help="a model shape (random-model preset; default: qwen3-0.6b)")
    p.add_argument("--gpu", default="h200", choices=sorted(BF16_PEAK_FLOPS),
                   help="the GPU whose target description gives memory and bandwidth (default: h200)")
    p.add_argument("--context-len", type=int, default=1024,
                   help="tokens of context per sequence (default: 1024)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="the engine's max_num_seqs: buckets up to it are decode steps (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the engine's token budget, the largest bucket (default: 2048)")
    p.add_argument("--compile", action="store_true",
                   help="also compile each bucket for the GPU (needs the CUDA plugin) for XLA's figures")


def run_roofline_cli(args: argparse.Namespace) -> dict:
    from jaxserve.models.config import ModelConfig
    from jaxserve.runner.buckets import BucketTable

    target_text = target_config_path(args.gpu).read_text()
    spec = gpu_spec(args.gpu, target_text)
    mc = ModelConfig.from_dict(preset_config(args.model))
    itemsize = 2 if mc.dtype in ("bfloat16", "float16") else 4
    buckets = BucketTable.build(args.max_num_batched_tokens, args.max_num_seqs).token_buckets
    rows = []
    for b in buckets:
        shape = step_shape(b, args.max_num_seqs, args.context_len)
        rows.append({**roofline_row(mc, spec, shape, itemsize), **mosaic_columns(
            mc, spec, shape, context_len=args.context_len, max_num_seqs=args.max_num_seqs,
            block_size=CacheConfig.block_size, max_model_len=mc.max_position_embeddings, itemsize=itemsize)})
    if args.compile:
        config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              attention_backend="pallas", interpret_kernels=False)
        figures = xla_step_figures(args.model, config, target_text, list(buckets))
        for row in rows:
            row.update(figures.get(row["bucket"], {}))
    print(table(rows), file=sys.stderr)
    return {"model": args.model, "gpu": spec.description, "hbm_tb_s": spec.hbm_bytes_per_s / 1e12,
            "bf16_tflop_s": spec.bf16_flops / 1e12, "context_len": args.context_len,
            "kv_bytes_per_token": kv_bytes_per_token(mc, itemsize), "buckets": rows}
