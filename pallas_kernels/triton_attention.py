"""Ragged paged attention as a hand-written Triton kernel, called through ``jax_triton``.

Same contract and tiling as the Pallas ``mixed`` kernel (``ragged_paged_attention.py``); the kernel
source is ``_triton_kernels.py``. Nothing here imports ``triton``/``jax_triton`` at module import:
:func:`triton_available` probes them, and :func:`ragged_paged_attention_triton` raises a
``RuntimeError`` with the reason when they (or a GPU) are missing. The launch geometry is computed
by the pure-Python :func:`triton_launch_plan`, tested on CPU.

``interpret=True`` runs the very same kernel source in Triton's own interpreter
(``TRITON_INTERPRET=1``) on the host, through ``jax.pure_callback``, so it works under ``jax.jit``
on a CPU: it needs ``triton`` and ``torch`` but neither ``jax_triton`` nor a GPU. It is slow (the
grid runs in Python) and meant for tests. Triton chooses interpreted or compiled versions of its
own library at its first import, so a process uses one mode: interpret mode imports triton itself
and fails with the reason if something imported it before. Triton's interpreter computes
``tl.dot`` on bfloat16 wrongly, so bfloat16 inputs are interpreted in float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ._common import check_options, check_shapes, is_pow2, next_pow2, valid_token_mask
from .ragged_paged_attention import LOG2E, _tile_ends, default_mixed_config, num_q_tiles


@functools.lru_cache(maxsize=1)
def triton_available() -> tuple[bool, str]:
    """``(True, "")`` when a GPU backend, triton and jax_triton are present, else the reason.

    The GPU is checked first: on a CPU machine triton is never imported here, which keeps the
    process free to import it in interpreter mode later (see :func:`_interpreted_kernels`).
    """
    try:
        gpus = jax.devices("gpu")
    except Exception as e:  # noqa: BLE001 - any failure means "not available"
        return False, f"no GPU backend in this jaxlib ({type(e).__name__}: {e})"
    if not gpus:
        return False, "no GPU device visible to jax"
    return jax_triton_importable()


@functools.lru_cache(maxsize=1)
def jax_triton_importable() -> tuple[bool, str]:
    """``(True, "")`` when triton and jax_triton import (enough to lower for a compile-only GPU)."""
    for name in ("triton", "jax_triton"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            return False, f"{name} is not importable ({type(e).__name__}: {e})"
    return True, ""


@functools.lru_cache(maxsize=1)
def triton_interpret_available() -> tuple[bool, str]:
    """``(True, "")`` when the kernel can run in Triton's interpreter (triton and torch), else why.

    Only looks the packages up: importing triton now would fix it in compiled mode.
    """
    for name in ("triton", "torch"):
        if importlib.util.find_spec(name) is None:
            return False, f"{name} is not installed"
    if "triton" in sys.modules and not _triton_interprets():
        return False, "triton was imported in compiled mode before the interpreter was asked for"
    return True, ""


def _triton_interprets() -> bool:
    """Triton picks interpreted or compiled versions of its own library when first imported."""
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


@contextlib.contextmanager
def _triton_interpret_env():
    """Triton reads TRITON_INTERPRET when a kernel is defined and again while it runs."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


@functools.lru_cache(maxsize=1)
def _interpreted_kernels():
    """A private copy of ``_triton_kernels`` whose ``@triton.jit`` functions are interpreted."""
    _require_interpreter()
    path = Path(__file__).with_name("_triton_kernels.py")
    spec = importlib.util.spec_from_file_location(f"{__package__}._triton_kernels_interpreted", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    with _triton_interpret_env():  # the first import of triton happens here, in interpreter mode
        spec.loader.exec_module(module)
    return module


@dataclasses.dataclass(frozen=True)
class TritonLaunchPlan:
    grid: tuple[int, int]
    num_warps: int
    num_stages: int
    out_rows: int  # rows of the [T * Hq, D] output
    r_pad: int  # length of the padded tile-end vector
    constexprs: dict  # keyword metaparameters of the kernel


def triton_launch_plan(*, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       num_blocks: int, block_size: int, num_seqs: int, max_blocks: int,
                       dtype, sm_scale: float, sliding_window: int | None = None,
                       soft_cap: float | None = None, block_q: int | None = None,
                       block_kv: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None) -> TritonLaunchPlan:
    """Grid, metaparameters and checks for one launch (pure Python, no GPU needed)."""
    t, hq, hkv, d = num_tokens, num_q_heads, num_kv_heads, head_dim
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    dflt = default_mixed_config(t, num_seqs, hq, hkv, d, dtype)
    block_q = dflt.block_q if block_q is None else int(block_q)
    block_kv = dflt.block_kv if block_kv is None else int(block_kv)
    num_warps = dflt.num_warps if num_warps is None else int(num_warps)
    num_stages = dflt.num_stages if num_stages is None else int(num_stages)
    g = hq // hkv
    g_pad = next_pow2(g)
    rows = block_q * g_pad
    for name, v in dict(head_dim=d, block_size=block_size, block_q=block_q,
                        block_kv=block_kv).items():
        if not is_pow2(v):
            raise ValueError(f"{name}={v} must be a power of two for Triton")
    for name, v in dict(rows=rows, block_kv=block_kv, head_dim=d).items():
        if v < 16:
            raise ValueError(f"{name}={v} must be >= 16 for tl.dot (raise block_q/block_kv)")
    if soft_cap is None:
        scale = float(sm_scale) * LOG2E
    else:
        scale = float(sm_scale)
    constexprs = dict(
        HQ=hq, HKV=hkv, G=g, G_PAD=g_pad, D=d, NB=num_blocks, BS=block_size, MB=max_blocks,
        R=num_seqs, R_PAD=next_pow2(num_seqs), BLOCK_Q=block_q, BLOCK_KV=block_kv, ROWS=rows,
        SCALE=scale, SOFT_CAP=0.0 if soft_cap is None else float(soft_cap),
        WINDOW=0 if sliding_window is None else int(sliding_window),
        IEEE=bool(jnp.dtype(dtype) == jnp.float32),
    )
    return TritonLaunchPlan(grid=(num_q_tiles(t, num_seqs, block_q), hkv), num_warps=num_warps,
                            num_stages=num_stages, out_rows=t * hq, r_pad=next_pow2(num_seqs),
                            constexprs=constexprs)


def triton_ready(interpret: bool, compute_capability: int | None = None) -> tuple[bool, str]:
    """Whether the kernel can run here: in Triton's interpreter, compiled ahead of time for a GPU
    of ``compute_capability`` (present or not), or on this machine's GPU; (False, why) otherwise."""
    if interpret:
        return triton_interpret_available()
    if compute_capability is not None:
        return jax_triton_importable()
    return triton_available()


def _require_interpreter() -> None:
    ok, reason = triton_ready(interpret=True)
    if not ok:
        raise RuntimeError(f"the triton backend cannot interpret here: {reason}")


def _require_triton(compute_capability: int | None = None):
    ok, reason = triton_ready(False, compute_capability)
    if not ok:
        raise RuntimeError(f"the triton attention backend is unavailable: {reason}")
    import jax_triton

    from . import _triton_kernels
    from .triton_ptx import pin_ptx_to_cuda12

    pin_ptx_to_cuda12()
    return jax_triton, _triton_kernels


def ragged_paged_attention_triton(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                                  num_seqs, *, sm_scale, sliding_window=None, soft_cap=None,
                                  interpret=False, block_q=None, block_kv=None, num_warps=None,
                                  num_stages=None, compute_capability=None):
    """Ragged paged attention through a Triton kernel. Same contract as the others.

    On a GPU through ``jax_triton``; with ``interpret=True`` in Triton's interpreter on the host.
    ``compute_capability`` (e.g. 90) compiles for that GPU without one present (ahead of time).
    """
    if interpret:
        _require_interpreter()  # at trace time, not first inside the host callback
    else:
        jt, kernels = _require_triton(compute_capability)
    plan, operands = _plan_and_operands(
        q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, block_q=block_q, block_kv=block_kv,
        num_warps=num_warps, num_stages=num_stages)
    if interpret:
        out = _interpret(plan, operands, q.dtype)
    else:
        out_sds = jax.ShapeDtypeStruct((plan.out_rows, q.shape[-1]), q.dtype)
        params = inspect.signature(jt.triton_call).parameters
        out_kw = {"out_type": out_sds} if "out_type" in params else {"out_shape": out_sds}
        out = jt.triton_call(
            *operands, kernel=kernels.ragged_paged_attention_kernel, grid=plan.grid,
            num_warps=plan.num_warps, num_stages=plan.num_stages, compute_capability=compute_capability,
            **out_kw, **plan.constexprs)
    return _zero_padding(out.reshape(q.shape), operands[1], num_seqs)


def ragged_paged_attention_triton_torch(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                                        num_seqs, *, sm_scale, sliding_window=None, soft_cap=None,
                                        device="cuda", **tuning) -> np.ndarray:
    """The same kernel launched by triton on torch tensors, without jax_triton: compiled on a
    ``"cuda"`` device (a GPU machine lacking jax_triton can still check the kernel), or in Triton's
    interpreter on ``"cpu"``. Not jittable; host arrays in, a host ``[T, Hq, D]`` array out."""
    plan, operands = _plan_and_operands(
        q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, **tuning)
    out = _launch_on(device, plan, *operands)
    return np.asarray(_zero_padding(out.reshape(q.shape), operands[1], num_seqs))


def _plan_and_operands(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
                       sm_scale, sliding_window, soft_cap, **tuning):
    """The launch plan and the kernel's seven array operands (jax or numpy arrays in)."""
    check_options(sliding_window, soft_cap)
    t, hq, d, nb, bs, hkv, r, mb = check_shapes(q, k_cache, v_cache, kv_lens, block_tables,
                                                query_start_loc)
    plan = triton_launch_plan(num_tokens=t, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                              num_blocks=nb, block_size=bs, num_seqs=r, max_blocks=mb,
                              dtype=q.dtype, sm_scale=sm_scale, sliding_window=sliding_window,
                              soft_cap=soft_cap, **tuning)
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    te = _tile_ends(qsl, num_seqs, r, plan.constexprs["BLOCK_Q"])
    operands = (te, qsl, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(block_tables, jnp.int32),
                jnp.reshape(q, (t * hq, d)), jnp.reshape(k_cache, (nb * bs, hkv, d)),
                jnp.reshape(v_cache, (nb * bs, hkv, d)))
    return plan, operands


def _zero_padding(out, query_start_loc, num_seqs):
    valid = valid_token_mask(query_start_loc, num_seqs, out.shape[0])
    return jnp.where(valid[:, None, None], out, jnp.zeros((), out.dtype))


# Triton's interpreter is not thread-safe (it parses and imports lazily), and a step split over
# several devices runs one host callback per device at once.
_INTERPRETER_LOCK = threading.Lock()


def _interpret(plan: TritonLaunchPlan, operands, dtype):
    """Launch the kernel in Triton's interpreter from inside a traced function (host callback)."""
    run_dtype = jnp.float32 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)
    if run_dtype != jnp.dtype(dtype):
        plan = dataclasses.replace(plan, constexprs={**plan.constexprs, "IEEE": True})
    # torch arrays of bf16/fp8 have no numpy twin in the interpreter: it runs on exact up-casts
    # (an fp8 pool's values are exact in any wider float; the compiled kernel casts in registers)
    operands = operands[:4] + tuple(x if x.dtype == run_dtype else x.astype(run_dtype) for x in operands[4:])
    out_sds = jax.ShapeDtypeStruct((plan.out_rows, operands[4].shape[-1]), run_dtype)
    out = jax.pure_callback(functools.partial(_launch_on, "cpu", plan), out_sds, *operands)
    return out.astype(dtype)


def _launch_on(device: str, plan: TritonLaunchPlan, *operands) -> np.ndarray:
    """Launch through triton on torch tensors: interpreted on "cpu", compiled elsewhere."""
    if device == "cpu":
        kernel = _interpreted_kernels().ragged_paged_attention_kernel
        with _INTERPRETER_LOCK, _triton_interpret_env():
            return _launch_with_torch(kernel, plan, operands, device)
    from . import _triton_kernels

    return _launch_with_torch(_triton_kernels.ragged_paged_attention_kernel, plan, operands, device)


def _launch_with_torch(kernel, plan: TritonLaunchPlan, operands, device: str) -> np.ndarray:
    """Launch ``kernel`` through triton itself on torch tensors; host arrays in and out."""
    import torch

    def to_torch(x):
        x = np.asarray(x)
        if x.dtype == jnp.bfloat16:  # numpy's bfloat16 (ml_dtypes) has no torch twin: go by bits
            return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).to(device)
        if x.dtype == jnp.float8_e4m3fn:  # an fp8 pool, likewise
            return torch.from_numpy(x.view(np.uint8).copy()).view(torch.float8_e4m3fn).to(device)
        return torch.from_numpy(np.array(x, copy=True)).to(device)

    tensors = [to_torch(x) for x in operands]
    out = torch.zeros((plan.out_rows, tensors[4].shape[-1]), dtype=tensors[4].dtype, device=device)
    kernel[plan.grid](*tensors, out, num_warps=plan.num_warps, num_stages=plan.num_stages,
                      **plan.constexprs)
    if out.dtype == torch.bfloat16:
        return out.cpu().view(torch.int16).numpy().view(jnp.bfloat16)
    return out.cpu().numpy()
