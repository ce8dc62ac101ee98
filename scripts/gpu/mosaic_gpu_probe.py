#!/usr/bin/env python
"""Can a Pallas Mosaic GPU kernel be verified before a GPU is lent? A minimal Hopper kernel (TMA
copies of two bf16 tiles into shared memory, one wgmma, the f32 accumulator stored back) is
(1) compiled for a compile-only H200 and (2) run in Mosaic GPU's interpret mode on the CPU,
against ``a @ b``. Prints one JSON object; ``docs/gpu.md`` has the answer.

    .venv-gpu-aot/bin/python scripts/gpu/mosaic_gpu_probe.py     # (1) needs the CUDA plugin
    .venv/bin/python scripts/gpu/mosaic_gpu_probe.py              # (2) alone
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

M = N = K = 64  # one warpgroup tile; 64 bf16 = 128 bytes, the widest swizzle
SWIZZLE = 128
TRANSFORMS = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))


def kernel(a_gmem, b_gmem, out_gmem):
    def body(a_smem, b_smem, out_smem, barrier):
        plgpu.copy_gmem_to_smem(a_gmem, a_smem, barrier)  # TMA
        plgpu.copy_gmem_to_smem(b_gmem, b_smem, barrier)
        plgpu.barrier_wait(barrier)

        def product(acc):
            plgpu.wgmma(acc, a_smem, b_smem)
            plgpu.wgmma_wait(0)
            out_smem[...] = acc[...]

        pl.run_scoped(product, plgpu.ACC((M, N), jnp.float32))  # registers: a scope of their own
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem)  # TMA
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(body, plgpu.SMEM((M, K), jnp.bfloat16, transforms=TRANSFORMS),
                  plgpu.SMEM((K, N), jnp.bfloat16, transforms=TRANSFORMS), plgpu.SMEM((M, N), jnp.float32),
                  plgpu.Barrier(num_arrivals=2))


def matmul(interpret=False):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
                          in_specs=[pl.BlockSpec(memory_space=plgpu.GMEM)] * 2,
                          out_specs=pl.BlockSpec(memory_space=plgpu.GMEM),
                          compiler_params=plgpu.CompilerParams(), interpret=interpret)


def attempt(result: dict, key: str, fn) -> None:
    start = time.perf_counter()
    try:
        result[key] = {"ok": True, **fn()}
    except Exception as e:  # noqa: BLE001 - the probe reports what failed and where
        result[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600],
                       "where": traceback.format_exc().splitlines()[-3][:300]}
    result[key]["seconds"] = round(time.perf_counter() - start, 2)


def compile_deviceless() -> dict:
    from jaxserve.bench import gpu_aot, gpu_targets

    sharding = gpu_aot.compile_only_sharding(gpu_targets.target_config_path("h200").read_text())
    arg = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=sharding)
    lowered = jax.jit(matmul()).trace(arg, arg).lower()
    text = lowered.as_text()
    compiled = lowered.compile()
    hlo = compiled.as_text()
    return {"lowered_custom_call": "mosaic_gpu" in text, "compiled_custom_calls":
            sorted({c.split('"')[1] for c in hlo.split("custom_call_target=")[1:]})}


def run_interpreted() -> dict:
    a = jax.random.normal(jax.random.key(0), (M, K), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (K, N), jnp.float32).astype(jnp.bfloat16)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    out = jax.jit(matmul(interpret=InterpretGPUParams()))(a, b)
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    return {"max_abs_err": float(np.max(np.abs(np.asarray(out) - ref)))}


def main() -> int:
    result = {"jax": jax.__version__}
    attempt(result, "deviceless_compile_h200", compile_deviceless)
    attempt(result, "interpret_on_cpu", run_interpreted)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
