"""Attention backends registered at run time: a name -> a callable with the shared contract.

``register_attention_backend("mine", fn)`` makes ``EngineConfig(attention_backend="mine")`` (and
``get_attention_fn("mine")``) use ``fn`` in the engine's compiled step, in this process. Before a
callable is accepted it is run under ``jax.jit`` on small ragged batches (prefill chunks, decode
tokens, prefix-cache hits, grouped-query heads, padding rows and tokens) and compared with
:func:`ragged_paged_attention_reference`; a callable that disagrees, or cannot be traced with the
data-dependent arguments as tracers, is refused with the reason.

Invariant: a built-in name is never shadowed, and every registered callable passed its check
(unless registered with ``check=False``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .reference import ragged_paged_attention_reference

BUILTIN_BACKENDS = ("xla", "pallas", "triton", "cpu", "mosaic")
RESERVED_NAMES = ("auto",)  # the engine's own choice among the built-ins

AttentionFn = Callable[..., jax.Array]

_registered: dict[str, AttentionFn] = {}


@dataclasses.dataclass(frozen=True)
class CheckCase:
    """One ragged batch: (q_len, kv_len) per request, padded to ``num_tokens`` and ``num_reqs``."""

    name: str
    requests: tuple[tuple[int, int], ...]
    num_tokens: int = 32
    num_reqs: int = 8


# Small enough to check in well under a second on a CPU; together they touch every branch of
# the contract: chunked prefill, decode, prefix hits (q_len < kv_len), padding, a full batch.
CHECK_CASES = (
    CheckCase("prefill", ((13, 13), (1, 1), (9, 9))),
    CheckCase("decode", ((1, 13), (1, 16), (1, 1), (1, 40))),
    CheckCase("mixed", ((1, 40), (9, 9), (5, 21), (3, 48), (1, 2))),
    CheckCase("full", tuple((4, n) for n in (4, 20, 33, 48, 9, 4, 12, 7))),
)


@dataclasses.dataclass(frozen=True)
class CheckShape:
    """Head and page shapes of the check batches (grouped-query: 2 query heads per KV head)."""

    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 8
    num_blocks: int = 40
    max_blocks: int = 6


@dataclasses.dataclass(frozen=True)
class BackendCheck:
    """The largest absolute difference from the reference, per case, and the tolerance used."""

    errors: dict[str, float]
    atol: float

    @property
    def max_abs_error(self) -> float:
        return max(self.errors.values())

    @property
    def ok(self) -> bool:
        return self.max_abs_error <= self.atol


def make_check_batch(case: CheckCase, shape: CheckShape = CheckShape(), *, seed: int = 0, dtype=jnp.float32,
                     kv_dtype=None):
    """The contract's positional arguments for ``case``: pages drawn at random from the pool
    (block 0 stays the null block), random q and caches (of ``kv_dtype``, default ``dtype``),
    ``num_seqs`` as an int32 [1]."""
    rng = np.random.default_rng(seed)
    n, r, s = len(case.requests), case.num_reqs, shape
    q_lens = np.array([q for q, _ in case.requests], np.int32)
    kv = np.array([k for _, k in case.requests], np.int32)
    if n > r or q_lens.sum() > case.num_tokens or (q_lens > kv).any() or kv.max() > s.max_blocks * s.block_size:
        raise ValueError(f"case {case.name} does not fit its shapes")
    qsl = np.zeros(r + 1, np.int32)
    qsl[1 : n + 1] = np.cumsum(q_lens)
    qsl[n + 1 :] = qsl[n]
    kv_lens = np.zeros(r, np.int32)
    kv_lens[:n] = kv
    tables = np.zeros((r, s.max_blocks), np.int32)
    pages = rng.permutation(np.arange(1, s.num_blocks))
    used = 0
    for i, length in enumerate(kv):
        need = -(-int(length) // s.block_size)
        tables[i, :need] = pages[used : used + need]
        used += need
    q = rng.standard_normal((case.num_tokens, s.num_q_heads, s.head_dim))
    cache_shape = (s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    k_cache, v_cache = rng.standard_normal(cache_shape), rng.standard_normal(cache_shape)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return (jnp.asarray(q, dtype), jnp.asarray(k_cache, kv_dtype), jnp.asarray(v_cache, kv_dtype), jnp.asarray(kv_lens),
            jnp.asarray(tables), jnp.asarray(qsl), jnp.asarray(np.array([n], np.int32)))


def check_against_reference(fn: AttentionFn, *, atol: float = 2e-3, sliding_window: int | None = None,
                            soft_cap: float | None = None, cases=CHECK_CASES,
                            shape: CheckShape = CheckShape(), dtype=jnp.float32, kv_dtype=None) -> BackendCheck:
    """Run ``fn`` jitted on each case and compare it, padding tokens included, with the reference
    (both given q of ``dtype`` and caches of ``kv_dtype``, default ``dtype``: an fp8 pool is
    checked on the same fp8 values)."""
    options = dict(sm_scale=shape.head_dim ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    candidate = jax.jit(functools.partial(fn, **options))
    errors = {}
    dtype = jnp.dtype(dtype)
    kv_dtype = dtype if kv_dtype is None else jnp.dtype(kv_dtype)
    for i, case in enumerate(cases):
        args = make_check_batch(case, shape, seed=i, dtype=dtype, kv_dtype=kv_dtype)
        # wait for the kernel before the reference runs: an interpreted kernel's host callbacks
        # still in flight while the next program dispatches hung a CPU test run
        got = jax.block_until_ready(candidate(*args))
        want = _reference_output(case, shape, i, tuple(sorted(options.items())), dtype, kv_dtype)
        if got.shape != want.shape:
            raise ValueError(f"case {case.name}: output shape {got.shape}, the contract's is {want.shape}")
        errors[case.name] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    return BackendCheck(errors, atol)


@functools.lru_cache(maxsize=64)
def _reference_output(case: CheckCase, shape: CheckShape, seed: int, options: tuple, dtype=jnp.float32,
                      kv_dtype=None) -> jax.Array:
    """The reference's answer on a check batch, computed once per batch, options and dtypes."""
    args = make_check_batch(case, shape, seed=seed, dtype=dtype, kv_dtype=kv_dtype)
    return ragged_paged_attention_reference(*args, **dict(options))


def register_attention_backend(name: str, fn: AttentionFn, *, check: bool = True, atol: float = 2e-3,
                               replace: bool = False) -> BackendCheck | None:
    """Make ``fn`` the attention backend ``name`` in this process; returns its check (None with
    ``check=False``). Raises ValueError for a built-in or reserved name, a name already taken
    (unless ``replace``), or a callable that disagrees with the reference by more than ``atol``."""
    if not name or name in BUILTIN_BACKENDS or name in RESERVED_NAMES:
        raise ValueError(f"cannot register attention backend {name!r}: the name is built in or reserved")
    if name in _registered and not replace:
        raise ValueError(f"attention backend {name!r} is already registered (pass replace=True)")
    result = check_against_reference(fn, atol=atol) if check else None
    if result is not None and not result.ok:
        raise ValueError(f"attention backend {name!r} disagrees with ragged_paged_attention_reference: "
                         f"max abs error per case {result.errors} > atol {atol}")
    _registered[name] = fn
    return result


def unregister_attention_backend(name: str) -> None:
    """Forget a registered backend (engines already built keep their compiled steps)."""
    if name not in _registered:
        raise KeyError(f"attention backend {name!r} is not registered")
    del _registered[name]


def registered_attention_fn(name: str) -> AttentionFn | None:
    return _registered.get(name)


def available_backends() -> tuple[str, ...]:
    """The built-in backends, then the registered ones in order of registration."""
    return BUILTIN_BACKENDS + tuple(_registered)
