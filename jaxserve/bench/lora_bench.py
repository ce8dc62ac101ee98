"""``jaxserve bench lora``: offline throughput with LoRA adapters against the base model.

Two engines in one process, built from the same flags: a plain one, and one with
``enable_lora``. Each round times, in turn, the plain engine on the base model, the LoRA engine on
the base model (what ``--enable-lora`` costs requests that use no adapter), the LoRA engine with
every request on one adapter, and with the requests spread over ``--num-loras`` adapters; and a
third engine started as a user serving one adapter would start it (``--max-loras 1``, vLLM's
default) times every request on that adapter (``lora_1_adapter_1_slot``). The
adapters are random, in PEFT's format, over every projection at ``--max-lora-rank``, written under
the cache folder. Ratios are taken within a round (the same machine state; the order of the modes
rotates from round to round) and reported with their spread over the rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.bench.throughput import random_workload

MODES = ("plain_base", "lora_engine_base", "lora_1_adapter", "lora_n_adapters", "lora_1_adapter_1_slot")


def add_lora_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-loras", type=int, default=4, help="adapters the requests spread over (default: 4)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per run (default: 32)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--num-iters", type=int, default=3, help="rounds; each runs every mode once (default: 3)")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the workload and adapters (default: 0)")


def write_random_adapter(folder: Path, cfg: Any, rank: int, seed: int, projections: Any = None) -> Path:
    """A random PEFT adapter over every projection (or ``projections``) of every layer (alpha = 2 r)."""
    from jaxserve.models.lora_adapter import PROJECTIONS, projection_shape
    from jaxserve.models.safetensors_io import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, module in PROJECTIONS.items():
            if projections is not None and proj not in projections:
                continue
            d_in, d_out = projection_shape(cfg, proj)
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) / np.sqrt(d_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((d_out, rank))).astype(np.float32)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(projections or PROJECTIONS),
         "bias": "none"}))
    return folder


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def run_lora_bench(args, model: str, engine_args: dict[str, Any]) -> dict:
    from jaxserve import LLM, LoRARequest, SamplingParams
    from jaxserve.envs import cache_dir

    if args.num_loras < 1:
        raise ValueError("--num-loras must be at least 1")
    plain_args = {**engine_args, "enable_lora": False}
    lora_args = {**engine_args, "enable_lora": True,
                 "max_loras": max(args.num_loras, engine_args.get("max_loras") or 1)}
    start = time.perf_counter()
    plain = LLM(model, show_progress=False, **plain_args)
    plain_startup = time.perf_counter() - start
    start = time.perf_counter()
    lora = LLM(model, show_progress=False, **lora_args)
    lora_startup = time.perf_counter() - start
    start = time.perf_counter()
    one_slot = LLM(model, show_progress=False, **{**lora_args, "max_loras": 1})
    one_slot_startup = time.perf_counter() - start
    rank = lora.config.lora_config.max_lora_rank
    root = cache_dir() / "bench-loras" / f"{Path(model).name}-r{rank}-s{args.bench_seed}"
    cfg = lora.llm_engine.model_config
    workload = random_workload(args.num_prompts, (args.input_len, args.input_len),
                               (args.output_len, args.output_len), (10, min(8000, cfg.vocab_size)), args.bench_seed)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    adapters = [LoRARequest(f"bench{i}", i + 1, str(write_random_adapter(root / f"a{i}", cfg, rank,
                                                                          args.bench_seed + i)))
                for i in range(args.num_loras)]
    plans = {"plain_base": (plain, None), "lora_engine_base": (lora, None),
             "lora_1_adapter": (lora, [adapters[0]] * len(prompts)),
             "lora_n_adapters": (lora, [adapters[i % len(adapters)] for i in range(len(prompts))]),
             "lora_1_adapter_1_slot": (one_slot, [adapters[0]] * len(prompts))}
    for llm, loras in plans.values():  # warm: adapters read, slots written, first runs done
        llm.generate(prompts[:4], params, use_tqdm=False, lora_request=None if loras is None else loras[:4])
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    # tokens per CPU second of this process: on a machine shared with other jobs, the cost of the
    # work itself, less skewed by the time the scheduler gives other processes than wall time
    cpu_rates: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.num_iters):
        # the modes take turns within a round, each round starting one mode later, so that no mode
        # always runs first (after the previous round's last) or last
        for mode in MODES[i % len(MODES):] + MODES[:i % len(MODES)]:
            llm, loras = plans[mode]
            llm.reset_prefix_cache()
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[mode].append(tokens / elapsed)
            cpu_rates[mode].append(tokens / cpu)
    ratios = {f"{m}_vs_plain": _spread([r / p for r, p in zip(rates[m], rates["plain_base"])])
              for m in MODES[1:]}
    cpu_ratios = {f"{m}_vs_plain": _spread([r / p for r, p in zip(cpu_rates[m], cpu_rates["plain_base"])])
                  for m in MODES[1:]}
    return {
        "model": model, "num_loras": args.num_loras, "max_lora_rank": rank, "max_loras": lora_args["max_loras"],
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "num_iters": args.num_iters, "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
        "startup_s": {"plain": plain_startup, "lora": lora_startup, "lora_1_slot": one_slot_startup},
        "output_tokens_per_s": {m: _spread(v) for m, v in rates.items()}, "ratios": ratios,
        "output_tokens_per_cpu_s": {m: _spread(v) for m, v in cpu_rates.items()}, "cpu_ratios": cpu_ratios,
        "unexpected_compiles": {"plain": plain.stats()["compile_unexpected_compiles"],
                                "lora": lora.stats()["compile_unexpected_compiles"],
                                "lora_1_slot": one_slot.stats()["compile_unexpected_compiles"]},
    }
