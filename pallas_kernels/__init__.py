"""Paged-attention kernels for jaxserve (imports jax/numpy only, never jaxserve).

Contract shared by every backend::

    ragged_paged_attention(
        q,                 # [T, Hq, D] all scheduled tokens, packed request by request
        k_cache, v_cache,  # [num_blocks, block_size, Hkv, D], already holding this step's K/V
        kv_lens,           # int32 [R]: context length of each request incl. this step's tokens
        block_tables,      # int32 [R, max_blocks_per_seq]
        query_start_loc,   # int32 [R + 1]: request r owns q[qsl[r]:qsl[r+1]]
        num_seqs,          # int32 scalar or [1]: rows at and after num_seqs are padding
        *, sm_scale, sliding_window=None, soft_cap=None, interpret=False, <tuning>)
      -> [T, Hq, D]

The tokens of request r are the last q_len_r positions of its kv_len_r context, attended causally
(``sliding_window``: only the last W positions, the token itself included; ``soft_cap``: scores
``cap * tanh(score / cap)`` after scaling). Padding tokens (at and after ``qsl[num_seqs]``) give 0.

Backends: ``xla`` = :func:`ragged_paged_attention_xla` (jnp, runs anywhere; query tiles grouped
by the context they need; :func:`ragged_paged_attention_reference` is the oracle), ``pallas`` =
:func:`ragged_paged_attention` (Pallas, Triton lowering; ``interpret=True`` on CPU), ``triton`` =
:func:`ragged_paged_attention_triton` (Triton via jax_triton on a GPU; ``interpret=True`` runs the
same kernel in Triton's interpreter on CPU), ``cpu`` = :func:`ragged_paged_attention_cpu` (a C++
kernel called through XLA's FFI, built on first use; the fast path on a CPU), ``mosaic`` =
:func:`ragged_paged_attention_mosaic` (Pallas Mosaic GPU for Hopper: TMA, wgmma, split-K decode;
bf16/f16, ``head_dim`` a multiple of 64; ``interpret=True`` runs it in Mosaic GPU's interpret mode
on CPU, for tests only).

More backends are registered at run time: ``register_attention_backend(name, fn)`` checks ``fn``
against the reference on small ragged batches (:func:`check_against_reference`) and makes it
available to :func:`get_attention_fn` and to ``EngineConfig(attention_backend=name)`` in this
process; :func:`available_backends` lists built-in and registered names.

For the runner: all shapes are static (bucketed T and R); every data-dependent quantity
(``kv_lens``, ``block_tables``, ``query_start_loc``, ``num_seqs``) may be traced. ``sm_scale``,
``sliding_window``, ``soft_cap`` and the tuning keywords are static Python values. The Pallas and
Triton kernels need power-of-two ``head_dim`` and ``block_size`` (any GQA group size works; it is
padded to a power of two inside the tile). Pallas ``mode="decode"`` is only valid when every
request has ``q_len <= 1``. :func:`lowerable_configs` lists the configurations the tests lower for
CUDA; :func:`write_kv` is a plain XLA scatter meant to be jitted with the caches donated.
"""

from __future__ import annotations

import functools

import jax

from .cpu_attention import cpu_attention_available, ragged_paged_attention_cpu
from .mosaic_attention import (
    MosaicConfig,
    default_mosaic_config,
    mosaic_self_check,
    mosaic_supports,
    ragged_paged_attention_mosaic,
)
from .ragged_paged_attention import (
    DecodeConfig,
    MixedConfig,
    default_decode_config,
    default_mixed_config,
    lower_for_cuda,
    lowerable_configs,
    num_q_tiles,
    ragged_paged_attention,
    ragged_paged_attention_decode,
    ragged_paged_attention_mixed,
)
from .reference import ragged_paged_attention_reference, write_kv
from .registry import (
    BUILTIN_BACKENDS,
    BackendCheck,
    available_backends,
    check_against_reference,
    register_attention_backend,
    registered_attention_fn,
    unregister_attention_backend,
)
from .triton_attention import (
    TritonLaunchPlan,
    jax_triton_importable,
    ragged_paged_attention_triton,
    triton_available,
    triton_interpret_available,
    triton_launch_plan,
    triton_ready,
)
from .xla_attention import ragged_paged_attention_xla

BACKENDS = BUILTIN_BACKENDS

__all__ = [
    "available_backends", "BackendCheck", "BACKENDS", "check_against_reference", "register_attention_backend",
    "unregister_attention_backend", "cpu_attention_available", "DecodeConfig", "default_decode_config",
    "default_mixed_config", "get_attention_fn", "lower_for_cuda", "lowerable_configs",
    "MixedConfig", "MosaicConfig", "default_mosaic_config", "mosaic_self_check", "mosaic_supports",
    "num_q_tiles", "ragged_paged_attention_mosaic", "ragged_paged_attention", "ragged_paged_attention_cpu",
    "ragged_paged_attention_decode", "ragged_paged_attention_mixed",
    "ragged_paged_attention_reference", "ragged_paged_attention_triton",
    "ragged_paged_attention_xla", "jax_triton_importable", "triton_available", "triton_interpret_available",
    "triton_ready", "triton_launch_plan", "TritonLaunchPlan", "write_kv",
]


def get_attention_fn(backend: str, interpret: bool = False, build_dir=None, **tuning):
    """A callable with the contract signature for ``backend``, built in (:data:`BACKENDS`) or
    registered (:func:`register_attention_backend`; ``interpret`` and ``build_dir`` do not apply).

    ``interpret`` applies to ``pallas`` (Pallas interpret mode), ``triton`` (Triton's
    interpreter) and ``mosaic`` (Mosaic GPU's interpret mode); ``tuning`` keywords are bound into
    the callable (e.g. ``mode="decode"``, ``block_q=16`` for pallas; ``kv_chunk`` for xla;
    ``config=MosaicConfig(...)`` for mosaic). ``build_dir`` is where ``cpu`` builds its
    library. ``triton`` and ``cpu`` raise a RuntimeError with the reason when they cannot run here.
    """
    if backend == "xla":
        return functools.partial(ragged_paged_attention_xla, **tuning)
    if backend == "pallas":
        return functools.partial(ragged_paged_attention, interpret=interpret, **tuning)
    if backend == "triton":
        ok, reason = triton_ready(interpret, tuning.get("compute_capability"))
        if not ok:
            what = "cannot interpret here" if interpret else "is unavailable"
            raise RuntimeError(f"the triton attention backend {what}: {reason}")
        return functools.partial(ragged_paged_attention_triton, interpret=interpret, **tuning)
    if backend == "cpu":
        ok, reason = cpu_attention_available(build_dir)
        if not ok:
            raise RuntimeError(f"the cpu attention backend is unavailable: {reason}")
        return functools.partial(ragged_paged_attention_cpu, **tuning)
    if backend == "mosaic":
        fn = functools.partial(ragged_paged_attention_mosaic, interpret=interpret, **tuning)
        if interpret:  # interpret mode's callbacks under a nested jit deadlocked a full CPU test run
            return fn
        # jitted: the layers' identical calls then share one lowering of the kernel (Mosaic GPU's
        # lowering is seconds of Python per call) instead of one per layer
        return jax.jit(fn, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
    registered = registered_attention_fn(backend)
    if registered is not None:
        return functools.partial(registered, **tuning)
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {available_backends()}")
