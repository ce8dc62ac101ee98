"""The one-hot LoRA delta against the gathered one (each token's own slot, B part by part) on a
decode bucket, per fused projection of SmolLM2-135M (JSON out).

    python scripts/lora_gather_bench.py [--repeats 3] [--calls 200] [--tokens 16] [--dtype float32]

Tables as the runner stores them (``a`` ``(in, slots, parts*rank)``, ``b`` compact ``(slots, rank, out)``), 4 slots
of rank 16; the two forms run alternately, ``repeats`` turns of ``calls`` calls each; prints the
microseconds per call of every turn.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers.lora import lora_delta_gathered, lora_delta_parts

# (in, part widths) of SmolLM2-135M's fused projections
SHAPES = {"qkv": (576, (576, 192, 192)), "gate_up": (576, (1536, 1536)), "down": (1536, (576,))}


def _us(fn, args, calls: int) -> float:
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    slots, rank, dt = 4, 16, jnp.dtype(args.dtype)
    one_hot, gathered = jax.jit(lora_delta_parts, static_argnums=4), jax.jit(lora_delta_gathered, static_argnums=4)
    results = {}
    for name, (d_in, widths) in SHAPES.items():
        a = jnp.asarray(rng.standard_normal((d_in, slots, len(widths) * rank)), dt)
        b = jnp.asarray(rng.standard_normal((slots, rank, sum(widths))), dt)
        x = jnp.asarray(rng.standard_normal((args.tokens, d_in)), dt)
        ids = jnp.asarray(rng.integers(0, slots, args.tokens), jnp.int32)
        turns: dict[str, list[int]] = {"one_hot": [], "gathered": []}
        for _ in range(args.repeats):
            turns["one_hot"].append(round(_us(one_hot, (x, ids, a, b, widths), args.calls)))
            turns["gathered"].append(round(_us(gathered, (x, ids, a, b, widths), args.calls)))
        results[name] = turns
    print(json.dumps({"device": jax.devices()[0].platform, "tokens": args.tokens, "dtype": args.dtype,
                      "us_per_call": results}, indent=1))


if __name__ == "__main__":
    main()
