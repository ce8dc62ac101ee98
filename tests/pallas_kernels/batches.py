"""Random ragged paged-attention batches and a naive numpy oracle for the kernel tests."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Static shapes of a test step (one compile per bucket and kernel option set)."""
    num_tokens: int = 32  # T
    num_reqs: int = 8  # R
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_blocks: int = 48
    block_size: int = 8
    max_blocks: int = 8  # context <= 64


# (q_len, kv_len) per request; the rest of the R rows and T tokens are padding.
SCENARIOS = {
    # decode only; contexts ending mid-block, on a block edge, a 1-token context
    "decode": [(1, 13), (1, 1), (1, 16), (1, 64), (1, 30), (1, 9)],
    # prefill only (q_len == kv_len), including a 1-token prompt
    "prefill": [(13, 13), (1, 1), (9, 9), (8, 8)],
    # mixed prefill chunks, decode tokens, prefix-cache hits (q_len < kv_len)
    "mixed": [(1, 40), (9, 9), (1, 17), (5, 21), (3, 64), (6, 6), (1, 2)],
    # prefix hits only: chunks in the middle of long contexts
    "prefix": [(7, 50), (12, 12 + 37), (4, 5), (9, 17)],
    # every row in use (num_seqs == R) and T full
    "full": [(4, 4), (4, 20), (4, 33), (4, 64), (4, 9), (4, 4), (4, 12), (4, 7)],
}


def make_batch(bucket: Bucket, reqs, *, dtype=jnp.float32, seed=0, num_seqs_scalar=False):
    """Build contract arguments for ``reqs`` [(q_len, kv_len)] padded to ``bucket``."""
    b = bucket
    rng = np.random.default_rng(seed)
    n = len(reqs)
    q_lens = np.array([q for q, _ in reqs], np.int32)
    kv_lens_ = np.array([k for _, k in reqs], np.int32)
    assert n <= b.num_reqs and q_lens.sum() <= b.num_tokens and (q_lens <= kv_lens_).all()
    assert kv_lens_.max() <= b.max_blocks * b.block_size
    qsl = np.zeros(b.num_reqs + 1, np.int32)
    qsl[1 : n + 1] = np.cumsum(q_lens)
    qsl[n + 1 :] = qsl[n]
    kv_lens = np.zeros(b.num_reqs, np.int32)
    kv_lens[:n] = kv_lens_
    block_tables = np.zeros((b.num_reqs, b.max_blocks), np.int32)  # 0 = null block
    free = rng.permutation(np.arange(1, b.num_blocks))
    used = 0
    for i in range(n):
        nblk = -(-int(kv_lens_[i]) // b.block_size)
        assert used + nblk <= len(free), "bucket has too few blocks"
        block_tables[i, :nblk] = free[used : used + nblk]
        used += nblk
    q = rng.standard_normal((b.num_tokens, b.num_q_heads, b.head_dim), np.float32)
    kc = rng.standard_normal((b.num_blocks, b.block_size, b.num_kv_heads, b.head_dim), np.float32)
    vc = rng.standard_normal((b.num_blocks, b.block_size, b.num_kv_heads, b.head_dim), np.float32)
    num_seqs = np.int32(n) if num_seqs_scalar else np.array([n], np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(kc, dtype), jnp.asarray(vc, dtype),
            jnp.asarray(kv_lens), jnp.asarray(block_tables), jnp.asarray(qsl),
            jnp.asarray(num_seqs))


def naive_attention(q, k_cache, v_cache, kv_lens, block_tables, qsl, num_seqs, *, sm_scale,
                    sliding_window=None, soft_cap=None, sinks=None):
    """Dense causal attention per request over its gathered context, float64, loops. ``sinks [Hq]``:
    one more logit per head in the softmax, with no value (transformers' gpt-oss eager form)."""
    q, kc, vc = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    kv_lens, block_tables, qsl = (np.asarray(x) for x in (kv_lens, block_tables, qsl))
    ns = int(np.asarray(num_seqs).reshape(-1)[0])
    t, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    g = hq // hkv
    out = np.zeros((t, hq, d))
    for r in range(ns):
        s, e, length = int(qsl[r]), int(qsl[r + 1]), int(kv_lens[r])
        pos = np.arange(length)
        blk = block_tables[r, pos // bs]
        keys, vals = kc[blk, pos % bs], vc[blk, pos % bs]  # [L, Hkv, D]
        for tok in range(s, e):
            p = length - (e - s) + (tok - s)
            allowed = pos <= p
            if sliding_window is not None:
                allowed &= pos > p - sliding_window
            for h in range(hq):
                sc = keys[:, h // g] @ q[tok, h] * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                sc = np.where(allowed, sc, -np.inf)
                sink = -np.inf if sinks is None else float(sinks[h])
                top = max(sc.max(), sink)
                w = np.exp(sc - top)
                # only the allowed keys' values: a slot outside them may hold NaN (see poison)
                out[tok, h] = (w[allowed] / (w.sum() + np.exp(sink - top))) @ vals[allowed, h // g]
    return out


@functools.cache
def jitted(backend: str, **options):
    """One jitted callable per (backend, static options); reused across tests and batches."""
    if backend == "xla":
        fn = functools.partial(pk.ragged_paged_attention_reference, **options)
    elif backend == "pallas":
        fn = functools.partial(pk.ragged_paged_attention, interpret=True, **options)
    else:
        raise ValueError(backend)
    return jax.jit(fn)


def call(backend: str, args, **options):
    return np.asarray(jitted(backend, **options)(*args).astype(jnp.float32))


def poison(args, sliding_window=None):
    """NaN everywhere a correct kernel must not read: padding tokens of q, and every cache slot
    outside the active requests' contexts (the null block, free blocks, the tails of last pages).
    With a ``sliding_window``, also the pages wholly before the window of a request's first query
    token: the scheduler has freed them (``remove_skipped_blocks``) while the runner's block table
    still names them, so another request may have written anything there (an fp8 overflow is NaN)."""
    q, kc, vc, kv_lens, block_tables, qsl, num_seqs = args
    ns = int(np.asarray(num_seqs).reshape(-1)[0])
    n_valid = int(np.asarray(qsl)[ns])
    nb, bs = kc.shape[:2]
    live = np.zeros(nb * bs, bool)
    for r in range(ns):
        pos = np.arange(int(kv_lens[r]))
        if sliding_window is not None:
            computed = int(kv_lens[r]) - int(np.asarray(qsl)[r + 1] - np.asarray(qsl)[r])
            pos = pos[pos >= (computed - sliding_window + 1) // bs * bs]
        live[np.asarray(block_tables)[r, pos // bs] * bs + pos % bs] = True
    live = jnp.asarray(live.reshape(nb, bs, 1, 1))
    q = q.at[n_valid:].set(jnp.nan)
    kc = jnp.where(live, kc, jnp.nan).astype(kc.dtype)
    vc = jnp.where(live, vc, jnp.nan).astype(vc.dtype)
    return (q, kc, vc, kv_lens, block_tables, qsl, num_seqs)
