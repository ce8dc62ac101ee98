"""One-hot slot mapping against ``jax.lax.ragged_dot`` for the mixed-batch LoRA delta (JSON out).

    python scripts/lora_matmul_bench.py [--repeats 5]

Per shape (tokens, max_loras) on SmolLM2-135M's gate_proj (576 -> 1536, rank 16), the two
forms run alternately, ``repeats`` turns of 50 calls each; prints the median seconds per call
of each and the ratio ragged/one-hot per turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from jaxserve.layers.lora import lora_delta_one_hot, lora_delta_ragged


def _time(fn, args, calls: int) -> float:
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    d_in, d_out, rank = 576, 1536, 16
    forms = {"one_hot": jax.jit(lora_delta_one_hot), "ragged_dot": jax.jit(lora_delta_ragged)}
    results = []
    for tokens in (1, 16, 256):
        for slots in (1, 4, 8):
            x = rng.standard_normal((tokens, d_in), np.float32)
            a = rng.standard_normal((slots, d_in, rank), np.float32)
            b = rng.standard_normal((slots, rank, d_out), np.float32)
            ids = rng.integers(-1, slots, tokens).astype(np.int32)
            times: dict[str, list[float]] = {name: [] for name in forms}
            for _ in range(args.repeats):
                for name, fn in forms.items():
                    times[name].append(_time(fn, (x, ids, a, b), args.calls))
            ratios = [r / o for r, o in zip(times["ragged_dot"], times["one_hot"])]
            results.append({"tokens": tokens, "max_loras": slots,
                            **{f"{n}_s": statistics.median(t) for n, t in times.items()},
                            "ragged_over_one_hot": [round(r, 2) for r in ratios]})
    print(json.dumps({"device": jax.devices()[0].platform, "results": results}, indent=1))


if __name__ == "__main__":
    main()
