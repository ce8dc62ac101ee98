"""The small-row dense kernel against XLA's dot on SmolLM2-135M's shapes: one compiled program of
the 30 layers' four projections (q|k|v 576x960, o 576x576, gate|up 576x3072, down 1536x576, each
layer its own weight, so every product reads its weight from memory as a decode step does), and
the tied LM head (49152x576, stored [vocab, hidden]) on its own. Medians of ``--repeats``. JSON out
(docs/benchmarks.md).

    python scripts/dense_matmul_bench.py [--rows 1 2 4 8 16 32] [--dtype float32] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.dense_matmul import dense_kernel_available, dense_matmul_cpu, dense_matmul_reference

LAYER_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # [in, out]
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def median_seconds(fn, args, repeats: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def layers_program(matmul):
    """x through every layer's four products (the output of each feeds a sum, so none is dropped)."""
    def run(x, weights):
        total = jnp.zeros((), jnp.float32)
        for i, w in enumerate(weights):
            inp = x if w.shape[0] == x.shape[1] else jnp.tile(x, (1, w.shape[0] // x.shape[1] + 1))[:, : w.shape[0]]
            total = total + matmul(inp, w).astype(jnp.float32).sum() * (i + 1)
        return total
    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ok, why = dense_kernel_available()
    if not ok:
        raise SystemExit(f"the kernel is not available: {why}")
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, dtype)
               for _ in range(LAYERS) for shape in LAYER_SHAPES]
    head = jnp.asarray(rng.standard_normal((VOCAB, HIDDEN), np.float32) * 0.02, dtype)
    xla_layers = layers_program(lambda x, w: dense_matmul_reference(x, w))
    kernel_layers = layers_program(lambda x, w: dense_matmul_cpu(x, w))
    xla_head = jax.jit(lambda x, w: dense_matmul_reference(x, w, transposed=True))
    kernel_head = jax.jit(lambda x, w: dense_matmul_cpu(x, w, transposed=True))
    results = []
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN), np.float32), dtype)
        row = {"rows": rows, "dtype": args.dtype}
        for name, fn, w in (("layers_xla_ms", xla_layers, weights), ("layers_kernel_ms", kernel_layers, weights),
                            ("head_xla_ms", xla_head, head), ("head_kernel_ms", kernel_head, head)):
            row[name] = round(median_seconds(fn, (x, w), args.repeats) * 1e3, 2)
        results.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"device": str(jax.devices()[0]), "results": results}))


if __name__ == "__main__":
    main()
