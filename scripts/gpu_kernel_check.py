#!/usr/bin/env python
"""GPU check of the paged-attention kernels: correctness against the jnp reference, and timings.

    python scripts/gpu_kernel_check.py            # on the GPU machine (< ~3 minutes on an H200)
    python scripts/gpu_kernel_check.py --smoke    # tiny shapes, Pallas interpret mode, CPU

Prints ONE JSON object on stdout:
  ``correctness``: per (backend, batch kind, dtype, options) the max abs error vs the reference and
  whether it is within tolerance; ``timing``: per (workload, backend) the median milliseconds, the
  achieved HBM bandwidth (KV bytes read once + q read + out written) and its fraction of the peak
  (4.8 TB/s on H200), and attention TFLOP/s; ``skipped``: backends that could not run, with the
  reason; ``errors``: anything that raised (the script keeps going).

``mosaic`` (the Pallas Mosaic GPU kernel) runs the bf16 and fp8-pool cases without options (the
option set here adds a soft cap, which it does not do; its windows are tested interpreted); the
smoke sizes' head_dim 16 is below its 64, so the smoke run skips it (its interpreted tests are
tests/pallas_kernels/test_mosaic_attention.py). Correctness gets at most 45% of ``--budget-s``;
the timings run mosaic and what it is compared with first and the jnp reference last, so a
budget cut drops the least wanted figures, and the run ends within the budget plus one case.
The prefill workloads are also timed on
``jax.nn.dot_product_attention(implementation="cudnn")`` over the same prompts laid out dense
(``cudnn_dense``: no pages, the bar a paged kernel is measured against), and ``decode_batch1_long``
is one sequence of a long context, the case mosaic's split-K is for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

PEAK_HBM_BYTES_S = 4.8e12
TIMING_ORDER = ("mosaic", "triton", "triton_torch", "pallas_decode", "pallas_mixed", "xla")


# ------------------------------------------------------------------------------------------------
# batches


def next_pow2(n):
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def build_batch(q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                num_tokens=None, num_reqs=None, num_blocks=None, max_blocks=None, spare_blocks=8):
    """Contract arguments on device for requests (q_len, kv_len), padded to power-of-two buckets."""
    q_lens = np.asarray(q_lens, np.int64)
    kv_lens = np.asarray(kv_lens, np.int64)
    n = len(q_lens)
    t_used = int(q_lens.sum())
    t = num_tokens or max(16, next_pow2(t_used))
    r = num_reqs or max(8, next_pow2(n))
    pages = -(-kv_lens // block_size)
    max_blocks = max_blocks or int(pages.max())
    nb = num_blocks or int(pages.sum()) + 1 + spare_blocks  # block 0 = null block
    assert pages.max() <= max_blocks and pages.sum() < nb
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, nb)).astype(np.int32)
    bt = np.zeros((r, max_blocks), np.int32)
    off = 0
    for i in range(n):
        bt[i, : pages[i]] = perm[off : off + pages[i]]
        off += pages[i]
    qsl = np.zeros(r + 1, np.int32)
    qsl[1 : n + 1] = np.cumsum(q_lens)
    qsl[n + 1 :] = qsl[n]
    kvl = np.zeros(r, np.int32)
    kvl[:n] = kv_lens
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (t, num_q_heads, head_dim), jnp.float32).astype(dtype)
    cache_shape = (nb, block_size, num_kv_heads, head_dim)
    k_cache = jax.random.normal(kk, cache_shape, jnp.float32).astype(dtype)
    v_cache = jax.random.normal(kv, cache_shape, jnp.float32).astype(dtype)
    args = (q, k_cache, v_cache, jnp.asarray(kvl), jnp.asarray(bt), jnp.asarray(qsl),
            jnp.asarray([n], jnp.int32))
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = int(kv_lens.sum()) * num_kv_heads * head_dim * 2 * itemsize
    qo_bytes = 2 * t_used * num_q_heads * head_dim * itemsize
    attended = sum(int(kl - ql + j + 1) for ql, kl in zip(q_lens, kv_lens) for j in range(ql))
    flops = 4 * attended * num_q_heads * head_dim
    meta = dict(num_tokens=t, num_reqs=r, tokens_used=t_used, seqs=n, num_blocks=nb,
                max_blocks=max_blocks, bytes=kv_bytes + qo_bytes, flops=flops)
    return args, meta


def batch_kinds(rng, scale):
    """(name, q_lens, kv_lens) for decode-only, prefill-only and mixed batches."""
    if scale == "smoke":
        return [("decode", [1] * 5, [13, 1, 16, 40, 9]),
                ("prefill", [13, 1, 9], [13, 1, 9]),
                ("mixed", [1, 9, 5, 3, 1], [40, 9, 21, 33, 2])]
    dec_kv = rng.integers(1, 3000, 48).tolist()
    pre = [300, 1, 77, 512, 129]
    mixed_q = [1] * 24 + [200, 64, 1, 333, 17]
    mixed_kv = rng.integers(1, 2048, 24).tolist() + [200, 1000, 5, 1500, 17]
    return [("decode", [1] * len(dec_kv), dec_kv), ("prefill", pre, pre),
            ("mixed", mixed_q, mixed_kv)]


# ------------------------------------------------------------------------------------------------
# backends


def backends(interpret):
    """name -> (callable or None, skip reason, applicable batch kinds)."""
    out = {
        "xla": (pk.ragged_paged_attention_reference, "", None),
        "pallas_mixed": (lambda *a, **k: pk.ragged_paged_attention(
            *a, interpret=interpret, mode="mixed", **k), "", None),
        "pallas_decode": (lambda *a, **k: pk.ragged_paged_attention(
            *a, interpret=interpret, mode="decode", **k), "", {"decode"}),
    }
    if interpret:  # the kernel's source in Triton's interpreter (host callback, jittable)
        ok, reason = pk.triton_interpret_available()
        fn = lambda *a, **k: pk.ragged_paged_attention_triton(*a, interpret=True, **k)  # noqa: E731
    else:
        ok, reason = pk.triton_available()
        fn = pk.ragged_paged_attention_triton
    out["triton"] = (fn if ok else None, reason, None)
    mosaic = lambda *a, **k: pk.ragged_paged_attention_mosaic(*a, interpret=interpret, **k)  # noqa: E731
    mosaic.no_soft_cap = True  # bf16 queries over bf16 or fp8 pools, windows; no soft cap yet
    out["mosaic"] = (None if interpret else mosaic,
                     "the smoke sizes' head_dim 16 is below mosaic's 64" if interpret else "", None)
    if not ok and not interpret:
        # No jax_triton on this GPU machine: still run the same kernel, launched by triton on torch
        # tensors (correctness only: its host copies would swamp any timing).
        ok_torch, why = _torch_cuda()
        host = lambda *a, **k: pk.triton_attention.ragged_paged_attention_triton_torch(  # noqa: E731
            *a, device="cuda", **k)
        host.host_only = True
        out["triton_torch"] = (host if ok_torch else None, why, None)
    return out


def _torch_cuda():
    try:
        import torch
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return False, f"torch/triton not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, ""


_JIT_CACHE = {}


def jit_fn(fn, **static):
    """One jax.jit per (function, static options), so equal shapes reuse the compiled step."""
    if getattr(fn, "host_only", False):  # launches outside jax: called as is
        return lambda *a: fn(*a, **static)
    key = (fn, tuple(sorted(static.items())))
    if key not in _JIT_CACHE:
        _JIT_CACHE[key] = jax.jit(lambda *a: fn(*a, **static))
    return _JIT_CACHE[key]


def time_fn(f, args, iters, warmup=2):
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(np.min(times))


# ------------------------------------------------------------------------------------------------
# checks


def run_correctness(result, scale, interpret, deadline):
    if scale == "smoke":
        heads, d, bs = (4, 2), 16, 8
        bucket = dict(num_tokens=32, num_reqs=8, num_blocks=64, max_blocks=8)
    else:
        heads, d, bs = (16, 8), 128, 16
        bucket = dict(num_tokens=1024, num_reqs=64, num_blocks=16384, max_blocks=256)
    rng = np.random.default_rng(0)
    bks = backends(interpret)
    option_sets = [dict(), dict(sliding_window=100 if scale != "smoke" else 6, soft_cap=30.0)]
    tol = {"float32": 2e-4, "bfloat16": 3e-2, "fp8": 3e-2}  # fp8: the reference reads the same fp8 values
    for kind, q_lens, kv_lens in batch_kinds(rng, scale):
        for dtype in ("bfloat16", "float32", "fp8"):  # fp8: bf16 queries over e4m3 pools
            args, meta = build_batch(q_lens, kv_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                                     head_dim=d, block_size=bs, seed=1, **bucket,
                                     dtype=jnp.dtype("bfloat16" if dtype == "fp8" else dtype))
            if dtype == "fp8":
                args = (args[0], *(x.astype(jnp.float8_e4m3fn) for x in args[1:3]), *args[3:])
            for opts in option_sets:
                if opts and dtype == "float32":
                    continue  # window / soft cap once per kind, in bf16 and over fp8
                static = dict(sm_scale=1.0 / math.sqrt(d), **opts)
                try:
                    ref = np.asarray(jit_fn(pk.ragged_paged_attention_reference, **static)(*args),
                                     np.float32)
                except Exception as e:  # noqa: BLE001
                    result["errors"].append(f"reference {kind} {dtype}: {e!r}")
                    continue
                for name, (fn, reason, kinds) in bks.items():
                    if name == "xla" or (kinds is not None and kind not in kinds):
                        continue
                    entry = dict(backend=name, batch=kind, dtype=dtype, **opts)
                    if fn is None:
                        result["skipped"].setdefault(name, reason)
                        continue
                    if getattr(fn, "no_soft_cap", False) and (dtype == "float32" or opts):
                        continue
                    if time.time() > deadline:
                        result["skipped"].setdefault("correctness_rest", "time budget")
                        return
                    try:
                        out = np.asarray(jit_fn(fn, **static)(*args), np.float32)
                        err = float(np.max(np.abs(out - ref)))
                        finite = bool(np.isfinite(out).all())
                        bound = tol[dtype] * (1 + float(np.abs(ref).max()))
                        entry.update(max_abs_err=err, finite=finite,
                                     ok=bool(finite and err <= bound))
                    except Exception as e:  # noqa: BLE001
                        entry.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
                        result["errors"].append(f"{name} {kind} {dtype}: "
                                                f"{traceback.format_exc()[-1500:]}")
                    result["correctness"].append(entry)


def run_timing(result, scale, interpret, deadline):
    rng = np.random.default_rng(1)
    if scale == "smoke":
        heads, d, bs, iters = (4, 2), 16, 8, 2
        # same bucket as the smoke correctness pass, so the compiled functions are reused
        bucket = dict(num_tokens=32, num_reqs=8, num_blocks=64, max_blocks=8)
        workloads = [("decode_heavy", [1] * 6, rng.integers(1, 60, 6).tolist()),
                     ("prefill_heavy", [16, 16], [16, 16])]
    else:
        heads, d, bs, iters = (16, 8), 128, 16, 20
        bucket = {}
        workloads = [("decode_heavy", [1] * 256, rng.integers(1024, 2049, 256).tolist()),
                     ("prefill_heavy", [1024] * 8, [1024] * 8),
                     ("decode_long_ctx", [1] * 8, [16384] * 8),
                     ("decode_batch1_long", [1], [32768])]
    bks = backends(interpret)
    # mosaic and what it is measured against first, cuDNN on prefill next, the jnp reference last:
    # a budget cut leaves out the least wanted timings
    order = sorted(bks, key=lambda n: TIMING_ORDER.index(n) if n in TIMING_ORDER else len(TIMING_ORDER))
    for wname, q_lens, kv_lens in workloads:
        args, meta = build_batch(q_lens, kv_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                                 head_dim=d, block_size=bs, dtype=jnp.bfloat16, seed=2, **bucket)
        is_decode = all(q == 1 for q in q_lens)
        for name in order:
            fn, reason, kinds = bks[name]
            entry = dict(workload=wname, backend=name, dtype="bfloat16",
                         **{k: meta[k] for k in ("num_tokens", "num_reqs", "tokens_used", "seqs")})
            if fn is None:
                result["skipped"].setdefault(name, reason)
                continue
            if (kinds is not None and not is_decode) or getattr(fn, "host_only", False):
                continue
            if time.time() > deadline:
                result["skipped"].setdefault("timing_rest", "time budget")
                return
            if name == "xla" and not interpret and len(set(q_lens)) == 1 and q_lens == kv_lens and q_lens[0] > 1:
                time_cudnn_dense(result, wname, q_lens, heads, d, meta, iters)  # prefill: before the reference
                if time.time() > deadline:
                    result["skipped"].setdefault("timing_rest", "time budget")
                    return
            f = jit_fn(fn, sm_scale=1.0 / math.sqrt(d))
            timed_entry(result, entry, lambda f=f, a=args: (f, a), meta, iters)
        del args


def time_cudnn_dense(result, wname, q_lens, heads, d, meta, iters):
    """cuDNN's fused attention on the same prompts, dense [B, S, H, D] and causal."""
    entry = dict(workload=wname, backend="cudnn_dense", dtype="bfloat16", seqs=len(q_lens), tokens_used=sum(q_lens))

    def build():
        shape = (len(q_lens), q_lens[0])
        ks = jax.random.split(jax.random.key(3), 3)
        q = jax.random.normal(ks[0], (*shape, heads[0], d), jnp.bfloat16)
        k, v = (jax.random.normal(key, (*shape, heads[1], d), jnp.bfloat16) for key in ks[1:])
        return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")), (q, k, v)

    timed_entry(result, entry, build, meta, iters)


def timed_entry(result, entry, build, meta, iters):
    """Time ``build()``'s (function, args) and record the entry with its bandwidth, or its error."""
    try:
        f, args = build()
        med, best = time_fn(f, args, iters)
        entry.update(ms_median=med * 1e3, ms_min=best * 1e3, hbm_gb_s=meta["bytes"] / med / 1e9,
                     hbm_fraction_of_peak=meta["bytes"] / med / PEAK_HBM_BYTES_S,
                     tflop_s=meta["flops"] / med / 1e12, bytes=meta["bytes"])
    except Exception as e:  # noqa: BLE001
        entry.update(error=f"{type(e).__name__}: {e}"[:2000])
        result["errors"].append(f"timing {entry['backend']} {entry['workload']}: {traceback.format_exc()[-1500:]}")
    result["timing"].append(entry)


def mosaic_summary(result) -> dict:
    """The mosaic kernel against the others: per workload each backend's median ms, mosaic's
    speedup over each (their ms over its), and on decode its fraction of the HBM peak."""
    by: dict = {}
    for e in result["timing"]:
        if "ms_median" in e:
            by.setdefault(e["workload"], {})[e["backend"]] = e
    out = {"correct": [e.get("ok") for e in result["correctness"] if e["backend"] == "mosaic"],
           "skipped": result["skipped"].get("mosaic"), "workloads": {}}
    for name, runs in by.items():
        row = {b: round(e["ms_median"], 4) for b, e in runs.items()}
        if "mosaic" in runs:
            ms = runs["mosaic"]["ms_median"]
            row["mosaic_speedup_over"] = {b: round(e["ms_median"] / ms, 3) for b, e in runs.items() if b != "mosaic"}
            if name.startswith("decode"):
                row["mosaic_hbm_fraction_of_peak"] = round(runs["mosaic"]["hbm_fraction_of_peak"], 3)
        out["workloads"][name] = row
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run in Pallas interpret mode")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="stop starting new cases after (correctness gets at most 45%% of it, timing the rest)")
    ns = ap.parse_args(argv)
    start = time.time()
    deadline = start + ns.budget_s
    correctness_deadline = start + 0.45 * ns.budget_s if not ns.skip_timing else deadline
    dev = jax.devices()[0]
    interpret = ns.smoke or dev.platform != "gpu"
    result = dict(jax=jax.__version__, python=platform.python_version(), device=str(dev),
                  platform=dev.platform, smoke=ns.smoke, interpret=interpret,
                  peak_hbm_tb_s=PEAK_HBM_BYTES_S / 1e12, correctness=[], timing=[], skipped={},
                  errors=[])
    if interpret and not ns.smoke:
        result["skipped"]["gpu"] = "no GPU: running the smoke sizes in interpret mode"
    scale = "smoke" if interpret else "full"
    try:
        run_correctness(result, scale, interpret, correctness_deadline)
    except Exception:  # noqa: BLE001
        result["errors"].append(traceback.format_exc()[-3000:])
    if not ns.skip_timing:
        try:
            run_timing(result, scale, interpret, deadline)
        except Exception:  # noqa: BLE001
            result["errors"].append(traceback.format_exc()[-3000:])
    result["all_correct"] = all(e.get("ok") for e in result["correctness"])
    result["mosaic"] = mosaic_summary(result)
    result["elapsed_s"] = time.time() - start
    print(json.dumps(result))
    return 0 if result["all_correct"] and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
