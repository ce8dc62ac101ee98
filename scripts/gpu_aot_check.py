#!/usr/bin/env python
"""Compile every step variant jaxserve would compile on an H200, on this machine, without a GPU.

    make gpu-aot-check                       # builds .venv-gpu-aot (jax[cuda12]) on first use
    .venv-gpu-aot/bin/python scripts/gpu_aot_check.py --models qwen3-0.6b --jobs 2

For each model shape (bf16, block_size 16, default buckets) and each attention backend that
targets GPUs, every variant is lowered and compiled for compile-only H200 devices made from the
target config (``jax.experimental.topologies``). One JSON line per variant on stdout: compile
seconds, temporary / argument / alias bytes, ``conditional`` and ``while`` ops (and the
data-dependent ones), copies of weight- or pool-shaped buffers, custom calls and the Pallas
kernels behind them; then a table per model and a summary line. Exits 1 when a step has a host
round trip, a weight or pool copy, or a KV pool that is not updated in place.

``--tensor-parallel-sizes 2 8`` compiles the steps split over that many of eight H200s on one
host and adds their collectives (per layer: Megatron's plan has two all-reduces, or
reduce-scatter + all-gather pairs); an all-gather of a weight-shaped array fails the check.

``--speculative-config`` compiles a speculating engine's steps (each verifies K drafts a row) and
its proposer's programs: ``draft_model`` with ``"model"`` a preset (e.g. ``qwen3-tiny-draft``; its
catch-up per token bucket, named ``draft-catch-up-<tokens>``, and its K-1-step decode loop per row
bucket, ``draft-decode-r<rows>``), ``eagle`` / ``eagle3`` with a head of the target's shape (its
program per token bucket, ``eagle3-<tokens>``), ``mtp`` on a MiMo target (``--models mimo-7b``:
its MTP layer, ``mtp-<tokens>``); random shapes, nothing loaded. Under tensor parallelism the
proposer is placed as the engine places it (split like the target where its heads divide) and a
weight all-gathered in its programs fails the check too. A proposer's
program fails the check as a step does (a host round trip, a copy of the draft's weights, the
head's or the target's tables, or of its pool, its pool not updated in place); ``--proposer-only``
skips the target's steps. The KV sizing line counts the proposer's pool and weights, as the
engine's sizing does.

``--enable-lora --max-loras 4 --max-lora-rank 8 16`` compiles a LoRA engine's steps (one engine per
rank, its variants named ``-r<rank>``): each variant
twice, the plain program and the one reading the slot tables (``-lora``; ``--lora-only`` keeps
those; ``--lora-lm-head`` / ``--lora-embedding`` add the LM head's / the embedding's tables). A
copy of a slot table (or of one layer's slice of it) in a step, or a table all-gathered under
tensor parallelism, fails the check.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the local backend; the GPU is compile-only
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxserve import envs  # noqa: E402

envs.allow_cuda_plugin_without_gpu()

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.bench import gpu_aot, gpu_targets  # noqa: E402
from jaxserve.bench.gpu_aot_draft import abstract_draft, draft_programs, proposer_memory  # noqa: E402
from jaxserve.bench.hlo_collectives import count_collectives  # noqa: E402
from jaxserve.bench.hlo_stats import analyze_hlo, dequantized_copies  # noqa: E402
from jaxserve.bench.presets import PRESETS  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402

SHARED_TARGET = REPO.parent / "shared" / "gpu" / "h200_target_config.txtpb"
# --quantization's GGUF block formats -> the model-side method (projections kept in that format)
GGUF_METHODS = {"gguf": "gguf:Q4_1", "gguf:Q8_0": "gguf:Q8_0", "gguf:Q4_0": "gguf:Q4_0", "gguf:Q4_1": "gguf:Q4_1"}
HLO_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int32": "s32", "bool": "pred",
              "float8_e4m3fn": "f8e4m3fn", "int8": "s8",
              "uint8": "u8"}


def default_target_config() -> Path:
    return SHARED_TARGET if SHARED_TARGET.is_file() else gpu_targets.target_config_path("h200")


def hlo_shape(x, per_device: bool = False) -> tuple[str, tuple[int, ...]]:
    """``x``'s HLO dtype and shape, or the shape of its block on one device."""
    shape = x.sharding.shard_shape(x.shape) if per_device else x.shape
    return HLO_DTYPES.get(str(x.dtype), str(x.dtype)), tuple(shape)


def mosaic_tiles(runner, variant) -> dict:
    """The mosaic kernel's tile schedule in this variant and the shared memory of one CTA (Mosaic
    refuses at compile time a kernel over the SM's 227 KiB)."""
    import pallas_kernels as pk
    from pallas_kernels import mosaic_attention

    mc, bs = runner.mc, runner.config.block_size
    kv_itemsize = runner.state.kv_cache[0].dtype.itemsize
    cfg = pk.default_mosaic_config(variant.bucket, min(variant.bucket, runner.config.max_num_seqs),
                                   mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, bs,
                                   runner.max_blocks_per_seq * bs, kv_itemsize)
    return {"block_kv": cfg.block_kv, "stages": cfg.num_stages, "splits": cfg.num_splits,
            "smem_bytes": mosaic_attention.smem_bytes(mc.head_dim, cfg, kv_itemsize=kv_itemsize)}


def inspect(lower, weight_shapes, pool_shapes, dequantized_shapes) -> tuple[dict, str]:
    """Lower (``lower()``) and compile one program; its figures and problems (host round trips,
    weight, dequantized-weight or pool copies, the pool not aliased) and its HLO text."""
    start = time.perf_counter()
    lowered = lower()
    lowered_s = time.perf_counter() - start
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start - lowered_s
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    stats = analyze_hlo(text, weight_shapes, pool_shapes)
    problems = []
    if stats.host_round_trips:
        problems.append(f"{stats.conditionals} conditionals, {stats.data_dependent_whiles} data-dependent whiles, "
                        f"{stats.host_callbacks} host callbacks")
    if stats.weight_copies:
        problems.append(f"{len(stats.weight_copies)} weight copies")
    dequantized = dequantized_copies(text, dequantized_shapes)
    if dequantized:
        problems.append(f"{len(dequantized)} dequantized weight copies {dequantized[:4]}")
    if stats.pool_copies:
        problems.append(f"{len(stats.pool_copies)} KV pool copies")
    if not stats.pool_aliased:
        problems.append("KV pool not aliased")
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    return {"lower_s": round(lowered_s, 2), "compile_s": round(compile_s, 2),
            "temp_bytes": int(mem.temp_size_in_bytes), "argument_bytes": int(mem.argument_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes), "bytes_accessed": int(cost.get("bytes accessed", 0)),
            "dequantized_copies": dequantized, **stats.as_dict(), "problems": problems}, text


def check_variant(runner, variant, weight_shapes, pool_shapes, full_weight_shapes, dequantized_shapes,
                  table_shapes=frozenset(), full_table_shapes=frozenset()) -> dict:
    row, text = inspect(lambda: runner.steps.lowered(variant), weight_shapes, pool_shapes, dequantized_shapes)
    problems = row.pop("problems")
    collectives = count_collectives(text)
    gathered_weights = collectives.weight_all_gathers(shape for _, shape in full_weight_shapes)
    if gathered_weights:
        problems.append(f"{len(gathered_weights)} weight all-gathers {gathered_weights[:4]}")
    table_copies = analyze_hlo(text, set(table_shapes), set()).weight_copies if variant.lora else []
    if table_copies:
        problems.append(f"{len(table_copies)} LoRA slot table copies {table_copies[:4]}")
    gathered_tables = collectives.weight_all_gathers(shape for _, shape in full_table_shapes) if variant.lora else []
    if gathered_tables:
        problems.append(f"{len(gathered_tables)} LoRA table all-gathers {gathered_tables[:4]}")
    return {"variant": variant.name, "bucket": variant.bucket, "decode_only": variant.decode_only,
            "all_greedy": variant.all_greedy, "lora": variant.lora, "lora_table_copies": table_copies, **row,
            "collectives": collectives.counts, "collectives_per_layer": per_layer(collectives.counts, runner.mc),
            **({"mosaic": mosaic_tiles(runner, variant)} if runner.attention_backend == "mosaic" else {}),
            "problems": problems}


def block_dequantized_shapes(model, state) -> set:
    """GGUF blocks kept (``gguf:Q8_0``, ...): the float shapes of each device's block weight
    dequantized whole: ``[out, in]``, ``[in, out]`` and the ``[out, in / 32, 32]`` of its blocks,
    read from its scales ``d [out, in / 32]``; ``state``: ``model``'s flat weights as placed."""
    _, flat = nnx.flatten(model, with_paths=True)
    shapes = set()
    for (path, _), x in zip(flat, state, strict=True):
        if path[-1] != "d":
            continue
        out, blocks = x.sharding.shard_shape(x.shape)[-2:]
        for dims in ((out, blocks * 32), (blocks * 32, out), (out, blocks, 32)):
            shapes |= {(f, dims) for f in ("bf16", "f16", "f32")}
    return shapes


def check_pooling(preset: str, backend: str, args, sharding) -> list[dict]:
    """The pooling engine's decoder step (embed, last-token pooling) per token bucket of its table:
    host round trips, weight or pool copies, the pool aliased."""
    from jaxserve.runner.pooling_model_runner import token_buckets

    model = gpu_aot.abstract_model(preset, False, 1, num_layers=args.num_layers)
    weight_shapes = {hlo_shape(x) for x in jax.tree.leaves(nnx.state(model))}
    rows = []
    for bucket in token_buckets(args.pooling_budget):
        if args.buckets and bucket not in args.buckets:
            continue
        start = time.perf_counter()
        lowered, kv = gpu_aot.lower_pooling_step(model, sharding, bucket, backend=backend)
        compiled = lowered.compile()
        text = compiled.as_text()
        stats = analyze_hlo(text, weight_shapes, {hlo_shape(x) for x in jax.tree.leaves(kv)})
        checks = {"host round trips": stats.host_round_trips, "weight copies": stats.weight_copies,
                  "KV pool copies": stats.pool_copies, "KV pool not aliased": not stats.pool_aliased}
        row = {"model": preset, "backend": backend, "tp": 1, "variant": f"pooling-{bucket}", "bucket": bucket,
               "compile_s": round(time.perf_counter() - start, 2),
               "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes), **stats.as_dict(),
               "collectives": count_collectives(text).counts, "collectives_per_layer": {},
               "problems": [name for name, bad in checks.items() if bad]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def per_layer(counts: dict[str, int], mc) -> dict[str, float]:
    """Collectives of one decoder layer: the step's, less the embedding's all-reduce and the
    logits' all-gather, over the layers (exact for an unrolled step)."""
    if not any(counts.values()):
        return {}
    rest = dict(counts)
    rest["all-reduce"] = max(0, rest["all-reduce"] - 1)
    rest["all-gather"] = max(0, rest["all-gather"] - 1)
    return {k: round(v / mc.num_hidden_layers, 2) for k, v in rest.items() if v}


def dequantized_weight_shapes(model, state) -> set:
    """A quantized weight's dims in a float dtype: a dequantized copy (the convert not fused into the dot)."""
    shapes = {hlo_shape(x, per_device=True) for x in jax.tree.leaves(state)}
    return ({(f, dims) for dtype, dims in shapes if dtype in ("s8", "f8e4m3fn") for f in ("bf16", "f16", "f32")}
            | block_dequantized_shapes(model, state))


def check_drafts(runner, draft, args, head: dict) -> list[dict]:
    """The proposer's programs (draft model or EAGLE head) of a speculating runner, one row each
    (starting with ``head``: model, backend, tp)."""
    rows = []
    quantized = dequantized_weight_shapes(draft, runner.drafter.weights) if runner.drafter is not None else set()
    for program in draft_programs(runner, args.buckets):
        weights = {hlo_shape(x, per_device=True) for x in jax.tree.leaves(program.weights)}
        full_weights = {hlo_shape(x)[1] for x in jax.tree.leaves(program.weights)}
        pools = {hlo_shape(x, per_device=True) for x in jax.tree.leaves(program.pools)}
        collectives = {}
        try:
            row, text = inspect(program.lower, weights, pools, quantized)
            # split over devices: partial sums and gathered logits, never a weight gathered whole
            found = count_collectives(text)
            collectives = found.counts
            gathered = found.weight_all_gathers(full_weights)
            if gathered:
                row["problems"].append(f"{len(gathered)} weight all-gathers {gathered[:4]}")
        except Exception as e:  # noqa: BLE001 - a program that does not compile is a failure to report
            row = {"problems": [f"{type(e).__name__}: {e}"[:2000]]}
        row = {**head, "variant": program.name, "collectives": collectives, "collectives_per_layer": {}, **row}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def check_model(preset: str, backend: str, args, sharding, spec, lora_rank: int = 16) -> list[dict]:
    scan = {"auto": None, "true": True, "false": False}[args.scan_layers]
    tp = sharding.mesh.size
    model = gpu_aot.abstract_model(preset, False if scan is None else scan, tp,  # a GPU engine unrolls
                                   quantization=args.quantization, num_layers=args.num_layers)
    max_model_len = args.max_model_len or model.config.max_position_embeddings
    lora = (dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=lora_rank,
                 lora_lm_head=args.lora_lm_head, lora_embedding=args.lora_embedding)
            if args.enable_lora else {})
    base = EngineConfig(attention_backend=backend, interpret_kernels=False, num_gpu_blocks_override=2,
                        tensor_parallel_size=tp, kv_cache_dtype=args.kv_cache_dtype,
                        speculative_config=args.speculative_config, **lora)
    speculative = base.spec_decode_config.spec
    draft = None if speculative is None else abstract_draft(speculative, model.config, preset=preset, config=base)
    # the draft's (or head's) pool and weights share the KV budget, as the engine sizes it
    proposer = proposer_memory(speculative, draft, base, max_model_len) if speculative else (None, 0)
    blocks, _ = gpu_aot.kv_blocks_on(spec, model, base, max_model_len, 0, *proposer)
    blocks = args.num_gpu_blocks or blocks
    config = EngineConfig(attention_backend=backend, interpret_kernels=False, num_gpu_blocks_override=blocks,
                          tensor_parallel_size=tp, kv_cache_dtype=args.kv_cache_dtype,
                          speculative_config=args.speculative_config, **lora)
    runner = gpu_aot.abstract_runner(model, config, sharding, max_model_len, draft=draft)
    # A split program's HLO holds each device's blocks: copies and aliasing are of block shapes,
    # while a weight gathered whole would have the full one.
    weight_shapes = {hlo_shape(x, per_device=True) for x in jax.tree.leaves(runner.model_state)}
    full_weight_shapes = {hlo_shape(x) for x in jax.tree.leaves(runner.model_state)}
    pool_shapes = {hlo_shape(x, per_device=True) for x in jax.tree.leaves(runner.state.kv_cache)}
    # an fp8 pool dequantized whole (a bf16 copy of its shape) counts as a pool copy too
    pool_shapes |= {("bf16", shape) for dtype, shape in pool_shapes if dtype == "f8e4m3fn"}
    dequantized_shapes = dequantized_weight_shapes(model, runner.model_state)
    variants = [v for v in runner.variants() if not args.proposer_only
                and (not args.buckets or v.bucket in args.buckets)
                and (args.decode_only is None or v.decode_only == args.decode_only)
                and (v.all_greedy or not args.greedy_only) and (v.lora or not args.lora_only)]
    table_shapes, full_table_shapes = gpu_aot.lora_table_shapes(runner), gpu_aot.lora_table_shapes(runner, False)
    rows = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(check_variant, runner, v, weight_shapes, pool_shapes, full_weight_shapes,
                               dequantized_shapes, table_shapes, full_table_shapes): v
                   for v in variants}
        for future in concurrent.futures.as_completed(futures):
            try:
                row = future.result()
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a failure to report
                row = {"variant": futures[future].name, "problems": [f"{type(e).__name__}: {e}"[:2000]]}
            row = {"model": preset, "backend": backend, "tp": tp, **row}
            if args.enable_lora:
                row["variant"] += f"-r{lora_rank}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    peak = max((r.get("temp_bytes", 0) for r in rows), default=0)
    final_blocks, budget = gpu_aot.kv_blocks_on(spec, model, config, max_model_len, peak, *proposer)
    pool, proposer_weights = proposer
    print(json.dumps({"model": preset, "backend": backend, "tp": tp, "weight_bytes_per_device":
                      gpu_aot.weight_bytes(model), "kv_sizing": budget.describe(),
                      **({"proposer_weight_bytes": proposer_weights, "proposer_pool_bytes":
                          pool.fixed + pool.per_block * final_blocks} if pool else {}),
                      "num_gpu_blocks": final_blocks, "kv_tokens": final_blocks * config.block_size,
                      "compiled_with_blocks": blocks, "max_model_len": max_model_len}), flush=True)
    rows.sort(key=lambda r: (r.get("bucket", 0), r.get("decode_only", False), str(r.get("all_greedy"))))
    return rows + check_drafts(runner, draft, args, {"model": preset, "backend": backend, "tp": tp})


def table(rows: list[dict]) -> str:
    lines = ["| model | backend | tp | variant | compile s | temp MiB | cond/while (data-dep.) | weight/pool copies "
             "| pool aliased | collectives per layer | custom calls |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['model']} | {r['backend']} | {r['tp']} | {r['variant']} "
        if "compile_s" not in r:
            lines.append(f"{head}| failed: {r['problems'][0][:80]} |")
            continue
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(r["custom_calls"].items()))
        if "mosaic" in r:
            t = r["mosaic"]
            calls += f" (smem {t['smem_bytes'] / 1024:.0f} KiB: {t['stages']} x {t['block_kv']}, {t['splits']} splits)"
        per = ", ".join(f"{k} {v:g}" for k, v in r["collectives_per_layer"].items()) or "-"
        lines.append(
            f"{head}| {r['compile_s']:.1f} | {r['temp_bytes'] / 2**20:.0f} "
            f"| {r['conditionals']}/{r['whiles']} ({r['data_dependent_whiles']}) "
            f"| {len(r['weight_copies'])}/{len(r['pool_copies'])} | {'yes' if r['pool_aliased'] else 'NO'} | {per} "
            f"| {calls} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-config", type=Path, default=default_target_config(),
                    help="GpuTargetConfig text proto (default: the shared H200 one, else the packaged copy)")
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"], choices=sorted(PRESETS))
    ap.add_argument("--backends", nargs="+", default=["pallas", "triton"],
                    choices=["pallas", "triton", "mosaic", "xla"])
    ap.add_argument("--buckets", type=int, nargs="*", default=None, help="only these token buckets")
    ap.add_argument("--scan-layers", choices=["auto", "true", "false"], default="auto",
                    help="auto: the GPU engine's default (unrolled)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's (40960)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="fp8: e4m3 pools, read by the kernels as stored")
    ap.add_argument("--quantization", choices=["fp8", "int8", *GGUF_METHODS], default=None,
                    help="weights kept in fp8 / int8 (one scale per output column), converted inside the dot, or "
                         "in a GGUF file's 32-wide blocks (gguf: Q4_1, as SmolLM2's file; gguf:Q8_0, gguf:Q4_0), "
                         "dequantized inside the dot; a dequantized weight-shaped buffer fails the check")
    ap.add_argument("--decode-only", choices=["true", "false"], default=None,
                    help="only the decode-only variants (true) or only the mixed ones (false)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="replace the models' depth: the kernels' variants do not depend on it, and one "
                         "layer lowers one attention kernel per step instead of one per layer")
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="compile against a KV pool of this many blocks (default: sized for 0.9 of the H200)")
    ap.add_argument("--greedy-only", action="store_true",
                    help="skip the random-sampler variants (a bucket's attention kernel is the same in both)")
    ap.add_argument("--pooling-budget", type=int, default=None,
                    help="compile the pooling engine's step (embed, last-token pooling) for each token bucket up "
                         "to this budget instead of the generating step")
    ap.add_argument("--enable-lora", action="store_true",
                    help="a LoRA engine: every variant also with the slot tables (vLLM's flag)")
    ap.add_argument("--max-loras", type=int, default=4, help="LoRA slots of the tables (with --enable-lora)")
    ap.add_argument("--max-lora-rank", type=int, nargs="+", default=[16],
                    help="the tables' rank (with --enable-lora); several: each rank's engine in turn")
    ap.add_argument("--lora-only", action="store_true", help="only the variants that read the slot tables")
    ap.add_argument("--lora-lm-head", action="store_true", help="the LM head's slot tables too (with --enable-lora)")
    ap.add_argument("--lora-embedding", action="store_true",
                    help="the token embedding's slot tables too (with --enable-lora)")
    ap.add_argument("--speculative-config", default=None,
                    help="vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}': "
                         "the steps verify K drafts a row; draft_model (\"model\": a preset, e.g. "
                         "qwen3-tiny-draft), eagle and eagle3 (a head of the target's shape) and mtp (a "
                         "MiMo target's layer, --models mimo-7b) add the proposer's programs")
    ap.add_argument("--proposer-only", action="store_true",
                    help="with --speculative-config: only the proposer's programs, not the target's steps")
    ap.add_argument("--jobs", type=int, default=1, help="variants compiled at once")
    ap.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[1],
                    help="compile split over this many of 8 H200s on one host (default: 1)")
    args = ap.parse_args(argv)
    args.quantization = GGUF_METHODS.get(args.quantization, args.quantization)
    args.decode_only = None if args.decode_only is None else args.decode_only == "true"
    target = args.target_config.read_text()
    spec = gpu_targets.gpu_spec("h200", args.target_config.read_text())
    print(json.dumps({"jax": jax.__version__, "target": spec.description, "target_config": str(args.target_config)}),
          flush=True)
    start = time.perf_counter()
    rows = []
    for tp in args.tensor_parallel_sizes:
        sharding = gpu_aot.compile_only_sharding(target, tp, num_devices=max(8, tp) if tp > 1 else 1)
        for preset in args.models:
            for backend in args.backends:
                if args.pooling_budget:
                    rows += check_pooling(preset, backend, args, sharding)
                else:
                    for rank in args.max_lora_rank if args.enable_lora else [16]:
                        rows += check_model(preset, backend, args, sharding, spec, rank)
    print(table(rows))
    failures = [f"{r['model']}/{r['backend']}/tp{r['tp']}/{r['variant']}: {'; '.join(r['problems'])}"
                for r in rows if r["problems"]]
    print(json.dumps({"variants": len(rows), "failures": failures, "elapsed_s": round(time.perf_counter() - start, 1)}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
