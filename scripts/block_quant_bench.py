"""The GGUF block matmul against a float32 matmul, cache-cold: ``L`` different weights of one
shape (more bytes than the last-level cache holds) multiplied in one compiled program, so each
product reads its weight from memory as a decode step does; ``kernel_int8`` is the kernel with
int8 activations (VNNI dots). JSON out (docs/benchmarks.md).

    python scripts/block_quant_bench.py [--rows 1 8 32] [--shape 1536 576] [--format Q4_1] [--layers 100]
        [--paths kernel kernel_int8]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.block_quant_matmul import BLOCK_FORMATS, block_quant_matmul_cpu, block_quant_matmul_reference

PATHS = ("kernel", "kernel_int8", "dequantize_then_dot", "float32")


def best_seconds(fn, args, repeats: int = 5) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="activation rows (tokens)")
    p.add_argument("--shape", type=int, nargs=2, default=[1536, 576], metavar=("N", "K"))
    p.add_argument("--format", default="Q4_1", choices=sorted(BLOCK_FORMATS))
    p.add_argument("--layers", type=int, default=100, help="distinct weights per program")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS, help="which products to time")
    args = p.parse_args()
    n, k = args.shape
    bits, offset, has_min = BLOCK_FORMATS[args.format]
    rng = np.random.default_rng(0)
    qs = [jnp.asarray(rng.integers(0, 256, (n, k * bits // 8), dtype=np.uint8)) for _ in range(args.layers)]
    # the scales as a file keeps them: float16, minimums only where the format has them
    d = [jnp.asarray(rng.random((n, k // 32), dtype=np.float32), jnp.float16) for _ in range(args.layers)]
    m = [jnp.asarray(rng.random((n, k // 32), dtype=np.float32), jnp.float16) if has_min else None
         for _ in range(args.layers)]
    # the float32 weights only when timed: four times the blocks' memory
    floats = ([jnp.asarray(rng.standard_normal((k, n), dtype=np.float32)) for _ in range(args.layers)]
              if "float32" in args.paths else [])

    def chain(matmul):
        return jax.jit(lambda x, qs, d, m: sum(matmul(x, *w, bits=bits, offset=offset).sum() for w in zip(qs, d, m)))

    kernel, dequantized = chain(block_quant_matmul_cpu), chain(block_quant_matmul_reference)
    kernel_int8 = chain(functools.partial(block_quant_matmul_cpu, int8_activations=True))
    f32 = jax.jit(lambda x, ws: sum((x @ w).sum() for w in ws))
    result = {"format": args.format, "shape": [n, k], "layers": args.layers,
              "bytes_per_weight_matrix": {"blocks": qs[0].nbytes + d[0].nbytes + (m[0].nbytes if has_min else 0),
                                         "float32": n * k * 4},
              "microseconds_per_matrix": {}}
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
        result["microseconds_per_matrix"][str(rows)] = {
            name: round(best_seconds(fn, a) / args.layers * 1e6, 1)
            for name, fn, a in (("kernel", kernel, (x, qs, d, m)), ("kernel_int8", kernel_int8, (x, qs, d, m)),
                                ("dequantize_then_dot", dequantized, (x, qs, d, m)), ("float32", f32, (x, floats)))
            if name in args.paths}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
