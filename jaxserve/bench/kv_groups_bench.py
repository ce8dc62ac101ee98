"""What a long request holds in the KV cache with sliding-window layers, against the same model
with full attention everywhere: the real scheduler and KV managers, no model (the runner's
output is faked). Default shape: Gemma 3 1B's (26 layers, five local per global, window 512,
one KV head of 256, bfloat16).

    jaxserve bench kv-groups                     # prints JSON
    jaxserve bench kv-groups --model FOLDER      # a checkpoint's config.json, as the runner groups it
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from jaxserve.core import (
    FullAttentionSpec,
    HybridKVCacheManager,
    KVCacheSpec,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SlidingWindowSpec,
    get_kv_cache_groups,
)
from jaxserve.core.kv_cache_spec import KVCacheConfig


def interleaved_specs(num_layers: int, global_every: int, window: int | None, block_size: int,
                      num_kv_heads: int, head_size: int, dtype: str) -> list[KVCacheSpec]:
    """Every ``global_every``-th layer full attention, the others a window (all full if None)."""
    specs: list[KVCacheSpec] = []
    for layer in range(num_layers):
        if window is None or (layer + 1) % global_every == 0:
            specs.append(FullAttentionSpec(block_size, num_kv_heads, head_size, dtype))
        else:
            specs.append(SlidingWindowSpec(block_size, num_kv_heads, head_size, dtype, window))
    return specs


def _run_one(specs: Sequence[KVCacheSpec], prompt_len: int, max_tokens: int,
             max_num_batched_tokens: int) -> dict:
    max_model_len = prompt_len + max_tokens + 1
    groups = get_kv_cache_groups(specs)
    probe = HybridKVCacheManager(KVCacheConfig(2, groups), max_model_len, max_num_batched_tokens)
    cfg = KVCacheConfig(probe.max_num_blocks_per_req + 1, groups)
    kv = HybridKVCacheManager(cfg, max_model_len, max_num_batched_tokens)
    sched = Scheduler(SchedulerConfig(max_model_len=max_model_len,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      async_scheduling=False), kv)
    sched.add_request(Request("long", [7] * prompt_len,
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=0))
    peak_blocks = 0
    per_group_at_peak: list[int] = []
    last_held: list[int] = []
    steps = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        held = [sum(1 for b in mgr.req_to_blocks.get("long", ()) if not b.is_null)
                for mgr in kv.coordinator.single_type_managers]
        last_held = held
        if sum(held) > peak_blocks:
            peak_blocks, per_group_at_peak = sum(held), held
        ids = list(so.num_scheduled_tokens)
        sched.update_from_output(so, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)},
                                                       [[5] for _ in ids]))
        steps += 1
    return {
        "num_groups": len(groups),
        "group_size": cfg.group_size,
        "bytes_per_block": cfg.bytes_per_block,
        "peak_blocks": peak_blocks,
        "peak_blocks_per_group": per_group_at_peak,
        "peak_bytes": peak_blocks * cfg.bytes_per_block,
        # At the last decode step: a window's chunk is gone, only W - 1 tokens' blocks stay.
        "last_step_blocks": sum(last_held),
        "last_step_blocks_per_group": last_held,
        "last_step_bytes": sum(last_held) * cfg.bytes_per_block,
        "bound_blocks_per_request": probe.max_num_blocks_per_req,
        "steps": steps,
    }


def run_kv_groups_bench(num_layers: int = 26, global_every: int = 6, window: int = 512,
                        block_size: int = 16, num_kv_heads: int = 1, head_size: int = 256,
                        dtype: str = "bfloat16", prompt_len: int = 8192, max_tokens: int = 256,
                        max_num_batched_tokens: int = 2048) -> dict:
    shape = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    hybrid = _run_one(interleaved_specs(num_layers, global_every, window, **shape),  # type: ignore[arg-type]
                      prompt_len, max_tokens, max_num_batched_tokens)
    dense = _run_one(interleaved_specs(num_layers, global_every, None, **shape),  # type: ignore[arg-type]
                     prompt_len, max_tokens, max_num_batched_tokens)
    return {
        "bench": "kv-groups",
        "num_layers": num_layers, "global_every": global_every, "window": window, **shape,
        "prompt_len": prompt_len, "max_tokens": max_tokens,
        "max_num_batched_tokens": max_num_batched_tokens,
        "sliding": hybrid,
        "full_attention": dense,
        # Memory one such request holds at its peak, full attention over sliding.
        "bytes_ratio": round(dense["peak_bytes"] / hybrid["peak_bytes"], 3),
        "last_step_bytes_ratio": round(dense["last_step_bytes"] / hybrid["last_step_bytes"], 3),
    }


def run_kv_groups_model_bench(folder: str, block_size: int = 16, prompt_len: int = 8192, max_tokens: int = 256,
                              max_num_batched_tokens: int = 2048, kv_dtype: str = "auto") -> dict:
    """The same figure for a checkpoint folder's ``config.json``, its layers' specs and groups as
    the runner builds them (``runner.kv_cache.layer_kv_specs``), against the same model with
    full attention everywhere; ``kv_cache_bytes_per_block`` is what the runner allocates per block."""
    from jaxserve.models.config import ModelConfig
    from jaxserve.runner.kv_cache import (
        blocks_per_request,
        bytes_per_block,
        kv_cache_groups,
        layer_kv_specs,
        num_kv_slots,
    )

    mc = ModelConfig.from_pretrained(folder)
    full_mc = dataclasses.replace(mc, sliding_window=None, layer_types=None)
    max_model_len = prompt_len + max_tokens + 1
    out: dict = {"bench": "kv-groups", "model": folder, "architecture": mc.architecture,
                 "num_layers": mc.num_hidden_layers, "windows": sorted({w or 0 for w in mc.layer_windows}),
                 "block_size": block_size, "prompt_len": prompt_len, "max_tokens": max_tokens,
                 "max_num_batched_tokens": max_num_batched_tokens}
    for name, cfg in (("sliding", mc), ("full_attention", full_mc)):
        out[name] = _run_one(layer_kv_specs(cfg, block_size, max_model_len, kv_dtype), prompt_len, max_tokens,
                             max_num_batched_tokens)
        slots = num_kv_slots(kv_cache_groups(cfg, block_size, max_model_len, kv_dtype))
        out[name]["kv_cache_bytes_per_block"] = bytes_per_block(cfg, block_size, 1, kv_dtype, slots)
        out[name]["runner_blocks_per_request"] = blocks_per_request(cfg, block_size, max_model_len,
                                                                    max_num_batched_tokens)
    full, sliding = out["full_attention"], out["sliding"]
    out["bytes_ratio"] = round(full["peak_bytes"] / sliding["peak_bytes"], 3)
    out["last_step_bytes_ratio"] = round(full["last_step_bytes"] / sliding["last_step_bytes"], 3)
    return out


def add_kv_groups_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a checkpoint folder: its config.json's layers, grouped as the runner groups them "
                             "(the shape flags below are then unused)")
    parser.add_argument("--num-layers", type=int, default=26, help="decoder layers (default: 26, Gemma 3 1B)")
    parser.add_argument("--global-every", type=int, default=6,
                        help="every N-th layer is full attention, the others a window (default: 6)")
    parser.add_argument("--window", type=int, default=512, help="the local layers' window in tokens (default: 512)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--num-kv-heads", type=int, default=1, help="key/value heads per layer (default: 1)")
    parser.add_argument("--head-size", type=int, default=256, help="head dimension (default: 256)")
    parser.add_argument("--kv-dtype", default="bfloat16", help="KV cache dtype (default: bfloat16)")
    parser.add_argument("--prompt-len", type=int, default=8192, help="the long request's prompt tokens (default: 8192)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens it decodes (default: 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the step's token budget, i.e. the prefill chunk (default: 2048)")


def run_kv_groups_cli(args: argparse.Namespace) -> dict:
    if args.model is not None:
        return run_kv_groups_model_bench(args.model, block_size=args.block_size, prompt_len=args.prompt_len,
                                         max_tokens=args.max_tokens, max_num_batched_tokens=args.max_num_batched_tokens)
    return run_kv_groups_bench(
        num_layers=args.num_layers, global_every=args.global_every, window=args.window,
        block_size=args.block_size, num_kv_heads=args.num_kv_heads, head_size=args.head_size,
        dtype=args.kv_dtype, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens)
