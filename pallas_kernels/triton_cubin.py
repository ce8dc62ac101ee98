"""The Triton kernel compiled for CUDA without a GPU: the resources of its cubin.

:func:`compile_for_cuda` compiles each launch the runner can make the way jax-triton launches it:
every array argument 16-byte aligned (``tt.divisibility=16``, which lets Triton vectorise loads
and use asynchronous copies), then reads registers, spills and shared memory from ``ptxas -v`` on
the PTX, with the same ptxas Triton used. The PTX version follows the jaxlib's CUDA
(:mod:`.triton_ptx`).

    python -m pallas_kernels.triton_cubin     # JSON list, one entry per configuration
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

from .triton_attention import triton_launch_plan
from .triton_ptx import pin_ptx_to_cuda12

_PTR = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}
SM90_MAX_SHARED_BYTES = 232448  # per block on an H100/H200 (227 KiB)
NUM_ARRAY_ARGS = 8  # te, qsl, kvl, bt, q, k, v, o


def compile_configs() -> list[dict]:
    """Launches the runner can make with the triton backend: the default tiles of a decode bucket
    and of a prefill bucket, and the explicit tiles the Pallas lowering tests also cover, for each
    dtype; ``triton_launch_plan`` keywords."""
    base = dict(num_q_heads=16, num_kv_heads=8, num_blocks=4096, max_blocks=128, sm_scale=0.125)
    out = []
    for dtype in ("bfloat16", "float16", "float32"):
        for head_dim, block_size in ((128, 16), (128, 32), (64, 16)):
            shape = dict(base, head_dim=head_dim, block_size=block_size, dtype=dtype)
            out.append(dict(shape, num_tokens=256, num_seqs=256))  # decode bucket
            out.append(dict(shape, num_tokens=2048, num_seqs=256))  # prefill / mixed bucket
        out.append(dict(base, head_dim=128, block_size=16, dtype=dtype, num_tokens=2048, num_seqs=8,
                        block_q=16, block_kv=32, num_warps=4, num_stages=2, sliding_window=4096,
                        soft_cap=30.0))
    return out


def ptxas_usage(ptx: str, ptxas: str, arch: str) -> dict:
    """Registers, spill bytes and shared memory of the one kernel in ``ptx``, from ``ptxas -v``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True, check=True)
    log = proc.stderr + proc.stdout

    def number(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "ptxas_smem_bytes": number(r"(\d+) bytes smem")}


def compile_for_cuda(config: dict, capability: int = 90, aligned: bool = True) -> dict:
    """Compile the kernel for one :func:`compile_configs` entry down to a cubin for
    ``sm_<capability>`` with Triton's own compiler: no GPU needed. ``aligned``: jax-triton's
    16-byte alignment hints on every array argument. Needs triton in compiled mode, so not in a
    process that asked for the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from . import _triton_kernels

    pin_ptx_to_cuda12()
    plan = triton_launch_plan(**config)
    ptr = _PTR[config["dtype"]]
    signature = {"te_ptr": "*i32", "qsl_ptr": "*i32", "kvl_ptr": "*i32", "bt_ptr": "*i32",
                 "q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "o_ptr": ptr}
    signature.update({name: "constexpr" for name in plan.constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(NUM_ARRAY_ARGS)} if aligned else None
    source = ASTSource(fn=_triton_kernels.ragged_paged_attention_kernel, signature=signature,
                       constexprs=dict(plan.constexprs), attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                            options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
    ptx = kernel.asm["ptx"]
    version = re.search(r"^\.version\s+(\S+)", ptx, re.MULTILINE)
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    return {"ptx_version": version.group(1) if version else None, "ptx_bytes": len(ptx),
            "cubin_bytes": len(kernel.asm["cubin"]), "shared_bytes": int(kernel.metadata.shared),
            "async_copies": ptx.count("cp.async"), "grid": list(plan.grid), "aligned": aligned,
            **ptxas_usage(ptx, get_ptxas(capability).path, arch)}


def main() -> None:
    import json
    import sys

    results = []
    for cfg in compile_configs():
        try:
            results.append({"config": cfg, **compile_for_cuda(cfg)})
        except Exception as e:  # noqa: BLE001 - report every config
            results.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:2000]})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
