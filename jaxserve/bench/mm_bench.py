"""``jaxserve bench mm``: a vision-language model's images/s and time to first token.

One engine from the flags (a LLaVA folder). Each round runs, in turn, ``--num-prompts`` requests
with a distinct random image each (every image encoded, no prefix hit), the same requests all
with one image (encoded once, then encoder cache and prefix hits), and the same prompts without
an image (the text-only program; its prompt is shorter by the image's tokens). Per mode: images
(requests) per second, output tokens per second, the median time to first token, and the
encoder's share of the wall time. Spreads are over the rounds.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import numpy as np

MODES = ("distinct_images", "one_image", "text_only")


def add_mm_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=16, help="requests per run (default: 16)")
    p.add_argument("--output-len", type=int, default=16, help="output tokens per request (default: 16)")
    p.add_argument("--image-size", type=int, default=64, help="side of the random square images (default: 64)")
    p.add_argument("--num-iters", type=int, default=3, help="rounds; each runs every mode once (default: 3)")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the images (default: 0)")


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _images(n: int, size: int, seed: int) -> list[Any]:
    import PIL.Image

    rng = np.random.default_rng(seed)
    return [PIL.Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def run_mm_bench(args, model: str, engine_args: dict[str, Any]) -> dict:
    from jaxserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, show_progress=False, **engine_args)
    startup = time.perf_counter() - start
    encoder = llm.llm_engine.core.runner.encoder
    if encoder is None:
        raise ValueError(f"{model} is not a vision-language model (a LLaVA or Qwen2.5-VL folder)")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    mark = llm.llm_engine.image_placeholder + "\n"  # the model's own (LLaVA: <image>)
    text = mark + "Describe this picture in a few words."
    n = args.num_prompts
    llm.generate([{"prompt": text, "multi_modal_data": {"image": im}}
                  for im in _images(2, args.image_size, args.bench_seed + 999)], params, use_tqdm=False)  # warm
    results: dict[str, dict[str, list[float]]] = {m: {"requests_per_s": [], "output_tokens_per_s": [],
                                                      "ttft_median_s": [], "encoder_share": []} for m in MODES}
    for round_ in range(args.num_iters):
        distinct = _images(n, args.image_size, args.bench_seed + round_)
        one = distinct[:1] * n
        prompts = {"distinct_images": [{"prompt": text, "multi_modal_data": {"image": im}} for im in distinct],
                   "one_image": [{"prompt": text, "multi_modal_data": {"image": im}} for im in one],
                   "text_only": [text.replace(mark, "")] * n}
        for mode in MODES:  # the modes take turns within a round
            llm.reset_prefix_cache()
            gc.collect()
            encoder_before = encoder.encoder_seconds
            t0 = time.perf_counter()
            outs = llm.generate(prompts[mode], params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            r = results[mode]
            r["requests_per_s"].append(n / elapsed)
            r["output_tokens_per_s"].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
            r["ttft_median_s"].append(statistics.median(o.metrics.time_to_first_token for o in outs))
            r["encoder_share"].append((encoder.encoder_seconds - encoder_before) / elapsed)
    return {
        "model": model, "num_prompts": n, "output_len": args.output_len, "image_size": args.image_size,
        "num_iters": args.num_iters, "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
        "startup_s": startup, "images_encoded": encoder.num_images_encoded,
        "modes": {m: {k: _spread(v) for k, v in r.items()} for m, r in results.items()},
        "unexpected_compiles": llm.stats()["compile_unexpected_compiles"],
    }
