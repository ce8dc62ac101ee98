"""Ragged paged attention as a Pallas Mosaic GPU kernel (Hopper: TMA, wgmma), the ``mosaic`` backend.

Work split (one CTA = one warpgroup per ``(q tile, kv head, kv split)``):

* A *query tile* is ``block_q = 64 // G_pad`` consecutive tokens of ONE request times the
  ``G_pad`` query heads of one KV head (the GQA group padded to a power of two): the 64 rows of
  one ``wgmma``, sharing every K/V page load. The tiles are packed in jnp before the launch
  (``[W, Hkv, 64, D]``, a gather of ``T * Hq * D`` elements) with their metadata (request, first
  position, token count); ``W = (T + min(R, T) * (block_q - 1)) // block_q`` bounds the tiles of
  any ragged split of ``T`` tokens, so the grid is static. A decode token is a tile of its own.
* The KV range a tile needs (``[0, last position + 1)``, causal) is walked in steps of
  ``block_kv`` positions (``block_kv / block_size`` pages). With ``num_splits > 1`` it is cut into
  up to that many contiguous runs of at least ``min_split_steps`` steps (split-K,
  flash-decoding), each run in its own CTA, so a batch-1 long-context decode fills the SMs while
  short contexts are not split for nothing (the run length is chosen per tile at run time; the
  split count only bounds the grid); every CTA writes an unnormalised partial
  (acc, max, sum, base 2) and a small jnp step combines the splits and gathers the rows back to
  ``[T, Hq, D]``.
* Per step: one TMA copy per page of K and of V (``k_cache[block, :, h, :]``, a strided
  ``[block_size, D]`` box) into a ``num_stages``-deep ring of shared-memory slots, one barrier per
  slot; the loads of step ``k + num_stages`` are issued as soon as step ``k``'s slot is free, so
  ``num_stages - 1`` steps are in flight while one is computed. ``wgmma`` computes ``Q Kᵀ`` into
  an f32 accumulator, the online softmax runs in registers (base 2, ``log2 e`` folded into the
  scale), ``p`` is cast to the cache dtype and a second ``wgmma`` adds ``p V``.
* Stale cache slots (the unused tail of a context's last page; with a window, the pages before
  it, which the scheduler releases while the block table still names them) may hold anything, NaN
  included: scores are masked with a select, and the V rows past the context (last step) or
  before the tile's window (first step) are zeroed in shared memory before the ``p V`` product
  (0 * NaN would otherwise leak in).
* An fp8 (e4m3) pool is copied by TMA as stored (half the bytes of bf16) into an fp8 ring; each
  step casts its K and V slot in registers into one bf16 staging tile each, which the ``wgmma``
  reads (Hopper's fp8 ``wgmma`` wants a K-major B operand and fp8 P, which V is not and would lose).
* A sliding window starts each tile's walk at the step holding its first token's window start:
  pages wholly before it are never loaded; the rest of the window is a select on the scores.

Not yet: soft caps (:func:`check_mosaic_options` is the one place that refuses them), warp
specialisation (a producer warpgroup issuing the TMA while two consumer warpgroups alternate,
FlashAttention-3's ping-pong).

On a CPU the kernel runs in Mosaic GPU's interpret mode (``interpret=True``), which simulates
shared memory, barriers, TMA and wgmma: for tests only, it is slow. Constraints: a 2-byte dtype
(bf16/f16) for q, the same or fp8 e4m3 for the pools, ``head_dim`` a multiple of 64,
``block_size`` a multiple of 8 dividing ``block_kv``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._common import check_options, check_shapes, next_pow2, scalar_num_seqs
from .reference import token_metadata
from .registry import CheckShape, check_against_reference

LOG2E = 1.4426950408889634
NUM_SMS_H200 = 132
TILE_ROWS = 64  # rows of one warpgroup's wgmma
MAX_SPLITS = 16
SMEM_BYTES_H200 = 232448  # the opt-in shared memory of one SM (227 KiB)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tile schedule of one launch: KV positions per step, pipeline depth, context splits."""

    block_kv: int = 64
    num_stages: int = 3
    num_splits: int = 1
    min_split_steps: int = 8  # a split's Q load and partial store are worth 8 steps of K and V


@dataclasses.dataclass(frozen=True)
class _Static:
    w: int  # query tiles
    hkv: int
    g_pad: int
    d: int
    bs: int
    mb: int
    block_kv: int
    stages: int
    splits: int
    min_split_steps: int
    scale_log2: float
    dtype: str
    kv_dtype: str  # the pools' dtype: q's, or float8_e4m3fn (cast in the kernel)
    window: int  # sliding window in positions; 0 = none
    interpret: bool  # the interpreter has no layout casts (they only pin register layouts)

    def layout(self, x, layout):
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, shape, dim):
        return self.layout(lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA)

    @property
    def pages_per_step(self) -> int:
        return self.block_kv // self.bs


FP8_KV = jnp.dtype(jnp.float8_e4m3fn)


def check_mosaic_options(dtype, head_dim: int, block_size: int, block_kv: int, sliding_window, soft_cap,
                         kv_dtype=None) -> None:
    """Raise ValueError for what this kernel does not do (yet); the one place to extend."""
    if soft_cap is not None:
        raise ValueError("the mosaic attention kernel has no soft cap yet")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"the mosaic attention kernel needs bf16 or f16 queries, got {jnp.dtype(dtype)}")
    if kv_dtype is not None and jnp.dtype(kv_dtype) not in (jnp.dtype(dtype), FP8_KV):
        raise ValueError(f"the mosaic attention kernel needs caches of q's dtype {jnp.dtype(dtype)} or "
                         f"float8_e4m3fn, got {jnp.dtype(kv_dtype)}")
    if head_dim % 64:
        raise ValueError(f"the mosaic attention kernel needs head_dim a multiple of 64, got {head_dim}")
    if block_size % 8 or block_kv % block_size or block_kv % 8:
        raise ValueError(f"the mosaic attention kernel needs block_size a multiple of 8 that divides "
                         f"block_kv, got block_size {block_size}, block_kv {block_kv}")


def block_q_for(num_q_heads: int, num_kv_heads: int) -> int:
    """Tokens per query tile: the GQA group (padded to a power of two) fills the other rows."""
    g_pad = next_pow2(num_q_heads // num_kv_heads)
    if g_pad > TILE_ROWS:
        raise ValueError(f"GQA group {num_q_heads // num_kv_heads} is wider than one {TILE_ROWS}-row tile")
    return TILE_ROWS // g_pad


def num_query_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static bound on ``sum_r ceil(q_len_r / block_q)`` over any ragged batch of the bucket."""
    return max(1, (num_tokens + min(num_seqs, num_tokens) * (block_q - 1)) // block_q)


def default_mosaic_config(num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
                          head_dim: int, block_size: int, max_context: int, kv_itemsize: int = 2) -> MosaicConfig:
    """Split the context only when the tiles cannot fill the SMs twice over (decode buckets)."""
    block_kv = max(64, block_size)
    ctas = num_query_tiles(num_tokens, num_seqs, block_q_for(num_q_heads, num_kv_heads)) * num_kv_heads
    # A bucket whose tiles may not fill the SMs twice gets the most splits a context can use: the
    # bucket's rows may hold a single sequence, and each tile splits only as far as its context
    # allows (min_split_steps per split), so the bound costs empty CTAs, not work.
    splits = 1
    if ctas < 2 * NUM_SMS_H200:
        splits = max(1, min(MAX_SPLITS, max_context // (MosaicConfig.min_split_steps * block_kv)))
    # The deepest ring that fits an SM: three stages of 64 positions up to D = 128 (96 KiB of K
    # and V), fewer or shorter steps for wider heads.
    for stages, kv in ((3, block_kv), (2, block_kv), (2, max(32, block_size))):
        cfg = MosaicConfig(block_kv=kv, num_stages=stages, num_splits=splits)
        if smem_bytes(head_dim, cfg, kv_itemsize=kv_itemsize) <= SMEM_BYTES_H200:
            break
    return cfg


def smem_bytes(head_dim: int, cfg: MosaicConfig, itemsize: int = 2, kv_itemsize: int | None = None) -> int:
    """Shared memory of one CTA: Q tile, the K/V ring (and, for a narrower pool, the K/V staging
    tiles of q's dtype), the p tile, the f32 output staging, max/sum, barriers."""
    kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
    q = TILE_ROWS * head_dim * itemsize
    kv = 2 * cfg.num_stages * cfg.block_kv * head_dim * kv_itemsize
    staging = 0 if kv_itemsize == itemsize else 2 * cfg.block_kv * head_dim * itemsize
    p = TILE_ROWS * cfg.block_kv * itemsize
    out = TILE_ROWS * head_dim * 4 + 2 * TILE_ROWS * 4
    return q + kv + staging + p + out + 8 * (cfg.num_stages + 1)


def _transforms(d: int, itemsize: int = 2):
    swizzle = min(128, d * itemsize)  # bytes of one row segment; 64 bf16 = 128 bytes, the widest
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def split_run(pos0, ntok, split, block_kv: int, splits: int, min_split_steps: int, window: int = 0):
    """A tile's KV end (causal: its last token's position + 1) and split ``split``'s run of steps
    ``[lo, hi)``; empty (lo == hi) past the context. With a sliding ``window`` the run starts at
    the step of the tile's first token's window start: no earlier page is loaded. Scalars in the
    kernel, arrays in jnp."""
    kv_end = jnp.where(ntok > 0, pos0 + ntok, 0)
    n_steps = (kv_end + (block_kv - 1)) // block_kv
    first = jnp.minimum(jnp.maximum(pos0 - (window - 1), 0) // block_kv, n_steps) if window else 0
    per = jnp.maximum((n_steps - first + (splits - 1)) // splits, min_split_steps)
    lo = jnp.minimum(first + split * per, n_steps)
    return kv_end, lo, jnp.minimum(lo + per, n_steps)


def _kernel(meta_ref, bt_ref, q_ref, k_ref, v_ref, acc_out, m_out, l_out, *, c: _Static):
    w = lax.axis_index("tile")
    h = lax.axis_index("kv_head")
    s = lax.axis_index("split")
    req = meta_ref[w, 0]
    pos0 = meta_ref[w, 1]
    ntok = meta_ref[w, 2]
    kv_end, lo, hi = split_run(pos0, ntok, s, c.block_kv, c.splits, c.min_split_steps, c.window)
    bkv, bs, ppp = c.block_kv, c.bs, c.pages_per_step
    dtype = jnp.dtype(c.dtype)
    cast_kv = jnp.dtype(c.kv_dtype) != dtype
    log_g = int(math.log2(c.g_pad))

    def body(q_smem, k_smem, v_smem, p_smem, o_smem, m_smem, l_smem, q_bar, kv_bar, *staging):
        def issue(step, slot):
            for i in range(ppp):  # one TMA box per page: pages are not contiguous in the pool
                page = jnp.minimum(step * ppp + i, c.mb - 1)
                blk = bt_ref[req, page]
                dst = pl.ds(i * bs, bs)
                plgpu.copy_gmem_to_smem(k_ref.at[blk, :, h], k_smem.at[slot, dst], kv_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[blk, :, h], v_smem.at[slot, dst], kv_bar.at[slot])

        plgpu.copy_gmem_to_smem(q_ref.at[w, h], q_smem, q_bar)
        for i in range(c.stages):  # the prologue: fill the ring
            pl.when(lo + i < hi)(functools.partial(issue, lo + i, i))
        plgpu.barrier_wait(q_bar)

        def step_fn(step, carry):
            acc, m, l = carry
            slot = lax.rem(step - lo, jnp.int32(c.stages))
            plgpu.barrier_wait(kv_bar.at[slot])
            if cast_kv:  # fp8 slot -> registers -> q's dtype in the staging tiles the wgmmas read
                k_tile, v_tile = staging
                # through f32: the H200 compile has no direct e4m3 -> bf16 conversion (ptxas of CUDA 12)
                k_tile[...] = k_smem.at[slot][...].astype(jnp.float32).astype(dtype)
                v_tile[...] = v_smem.at[slot][...].astype(jnp.float32).astype(dtype)
                plgpu.commit_smem()
            else:
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
                return acc_ref[...]

            if c.interpret:  # jax 0.10.2's interpreter cannot read a transposed wgmma operand
                scores = lax.dot_general(q_smem[...], k_tile[...], (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
            else:
                scores = pl.run_scoped(qk, plgpu.ACC((TILE_ROWS, bkv), jnp.float32))
            rows, cols = c.iota((TILE_ROWS, bkv), 0), c.iota((TILE_ROWS, bkv), 1)
            tok = lax.shift_right_logical(rows, jnp.int32(log_g))
            mask = (cols + step * bkv <= tok + pos0) & (tok < ntok)
            if c.window:
                mask = mask & (cols + step * bkv > tok + pos0 - c.window)
            sc = jnp.where(mask, scores * jnp.float32(c.scale_log2), -jnp.inf)
            m_new = jnp.maximum(m, sc.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(sc - lax.broadcast_in_dim(m_safe, sc.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            # V rows no token of the tile may see can hold anything, NaN included, and 0 * NaN
            # would leak into p V: the tail past the context (its last step) and, with a window,
            # the rows before the first token's window (its first step), whose pages the
            # scheduler may have released to another request.
            win_lo = jnp.maximum(pos0 - (c.window - 1), 0) if c.window else 0

            @pl.when((step * bkv + bkv > kv_end) | (step * bkv < win_lo))
            def _zero_stale_rows():
                v_pos = c.iota((bkv, c.d), 0) + step * bkv
                keep = (v_pos < kv_end) & (v_pos >= win_lo)
                v_tile[...] = jnp.where(keep, v_tile[...], jnp.zeros((), v_tile.dtype))
                plgpu.commit_smem()

            # p goes through shared memory (not wgmma's register operand) and into a fresh
            # accumulator added to the running one (not pl.run_state(ACC.init(acc))): jax 0.10.2's
            # interpreter has neither, and the compiled kernel should be the one verified.
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_tile)
                return acc_ref[...]

            acc = acc + pl.run_scoped(pv, plgpu.ACC((TILE_ROWS, c.d), jnp.float32))

            @pl.when(step + c.stages < hi)
            def _():
                issue(step + c.stages, slot)  # the slot is free: its wgmmas have completed

            return acc, m_new, l

        acc0 = c.layout(jnp.zeros((TILE_ROWS, c.d), jnp.float32), plgpu.Layout.WGMMA)
        m0 = c.layout(jnp.full((TILE_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l0 = c.layout(jnp.zeros((TILE_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc, m, l = lax.fori_loop(lo, hi, step_fn, (acc0, m0, l0))
        o_smem[...] = acc
        m_smem[...] = m
        l_smem[...] = l
        plgpu.commit_smem()
        # Only the tile's real rows of the accumulator (ntok * G_pad of 64: G_pad for a decode
        # token) go back, as a ladder of power-of-two TMA boxes (a box's shape is static).
        def store_rows(start, size):
            rows = pl.ds(start, size)
            plgpu.copy_smem_to_gmem(o_smem.at[rows], acc_out.at[s, w, h, rows])

        real, start, n = ntok * c.g_pad, 0, TILE_ROWS
        while n >= c.g_pad:
            pl.when((real & n) != 0)(functools.partial(store_rows, start, n))
            start, n = start + (real & n), n // 2
        plgpu.copy_smem_to_gmem(m_smem, m_out.at[s, w, h])
        plgpu.copy_smem_to_gmem(l_smem, l_out.at[s, w, h])
        plgpu.wait_smem_to_gmem(0)

    tr = _transforms(c.d)
    kv_dtype = jnp.dtype(c.kv_dtype)
    tr_kv = _transforms(c.d, kv_dtype.itemsize)
    staging = [plgpu.SMEM((bkv, c.d), dtype, transforms=tr)] * 2 if cast_kv else []
    # An empty tile (past the batch's last one: the grid is a static bound) or an empty split
    # (past its tile's context) does nothing, not even its stores: the combine ignores it.
    pl.when(lo < hi)(lambda: pl.run_scoped(
        body,
        plgpu.SMEM((TILE_ROWS, c.d), dtype, transforms=tr),
        plgpu.SMEM((c.stages, bkv, c.d), kv_dtype, transforms=tr_kv),
        plgpu.SMEM((c.stages, bkv, c.d), kv_dtype, transforms=tr_kv),
        plgpu.SMEM((TILE_ROWS, bkv), dtype, transforms=_transforms(bkv)),
        plgpu.SMEM((TILE_ROWS, c.d), jnp.float32),
        plgpu.SMEM((TILE_ROWS,), jnp.float32),
        plgpu.SMEM((TILE_ROWS,), jnp.float32),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=2 * ppp, num_barriers=c.stages),
        *staging,
    ))


def _interpret_params(interpret):
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # private in 0.10.2

        return InterpretGPUParams()
    return interpret or None


def tile_plan(query_start_loc, kv_lens, num_seqs, r: int, w: int, block_q: int):
    """Per query tile ``[W, 3]`` int32 (request, first position, tokens; 0 tokens = an empty tile),
    each tile's first token ``[W]`` and each request's first tile ``[R]``."""
    ns = scalar_num_seqs(num_seqs)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    q_lens = jnp.where(jnp.arange(r) < ns, q_lens, 0)
    tiles = (q_lens + (block_q - 1)) // block_q
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    wi = jnp.arange(w, dtype=jnp.int32)
    req = jnp.minimum(jnp.sum(tile_end[None, :] <= wi[:, None], axis=1), r - 1).astype(jnp.int32)
    local = (wi - tile_start[req]) * block_q  # first token of the tile within its request
    ntok = jnp.where(wi < tile_end[r - 1], jnp.clip(q_lens[req] - local, 0, block_q), 0)
    pos0 = kv_lens[req] - q_lens[req] + local
    meta = jnp.stack([req, pos0, ntok], axis=1).astype(jnp.int32)
    return meta, (query_start_loc[req] + local).astype(jnp.int32), tile_start.astype(jnp.int32)


def ragged_paged_attention_mosaic(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
                                  sm_scale: float, sliding_window=None, soft_cap=None, interpret=False,
                                  config: MosaicConfig | None = None):
    """The shared contract (see :mod:`pallas_kernels`) on the Mosaic GPU kernel; ``interpret``:
    True (or an ``InterpretGPUParams``) runs it in Mosaic GPU's interpret mode on any backend."""
    check_options(sliding_window, soft_cap)
    t, hq, d, nb, bs, hkv, r, mb = check_shapes(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc)
    if config is None:
        config = default_mosaic_config(t, r, hq, hkv, d, bs, mb * bs, jnp.dtype(k_cache.dtype).itemsize)
    check_mosaic_options(q.dtype, d, bs, config.block_kv, sliding_window, soft_cap, k_cache.dtype)
    window = 0 if sliding_window is None else int(sliding_window)
    g = hq // hkv
    bq = block_q_for(hq, hkv)
    g_pad = TILE_ROWS // bq
    w = num_query_tiles(t, r, bq)
    kv_lens = kv_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    meta, first_tok, tile_start = tile_plan(query_start_loc, kv_lens, num_seqs, r, w, bq)

    # Pack: row j * G_pad + g of tile (w, h) is token first_tok + j, query head h * G + g.
    j = jnp.arange(bq, dtype=jnp.int32)
    tok = first_tok[:, None] + j[None, :]  # [W, bq]
    tok_ok = j[None, :] < meta[:, 2:3]
    qg = q.reshape(t, hkv, g, d)
    if g_pad != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, g_pad - g), (0, 0)))
    packed = jnp.where(tok_ok[:, :, None, None, None], qg[jnp.clip(tok, 0, t - 1)], 0)  # [W, bq, Hkv, Gp, D]
    packed = packed.transpose(0, 2, 1, 3, 4).reshape(w, hkv, TILE_ROWS, d)

    c = _Static(w=w, hkv=hkv, g_pad=g_pad, d=d, bs=bs, mb=mb, block_kv=config.block_kv,
                stages=config.num_stages, splits=config.num_splits,
                min_split_steps=config.min_split_steps, scale_log2=float(sm_scale) * LOG2E,
                dtype=jnp.dtype(q.dtype).name, kv_dtype=jnp.dtype(k_cache.dtype).name, window=window,
                interpret=bool(interpret))
    s = config.num_splits
    f32 = jnp.float32
    out_type = (jax.ShapeDtypeStruct((s, w, hkv, TILE_ROWS, d), f32),
                jax.ShapeDtypeStruct((s, w, hkv, TILE_ROWS), f32),
                jax.ShapeDtypeStruct((s, w, hkv, TILE_ROWS), f32))
    acc, m, l = plgpu.kernel(functools.partial(_kernel, c=c), out_type=out_type, grid=(w, hkv, s),
                             grid_names=("tile", "kv_head", "split"),
                             compiler_params=plgpu.CompilerParams(approx_math=True),
                             interpret=_interpret_params(interpret))(meta, block_tables, packed, k_cache, v_cache)

    # Unpack: token t of request r sits in tile tile_start[r] + i // bq, rows (i % bq) * G_pad + g.
    # The rows are gathered first and combined after, so only the tokens' partials are read.
    req, _, valid = token_metadata(query_start_loc, kv_lens, num_seqs, t)
    i = jnp.arange(t, dtype=jnp.int32) - query_start_loc[req]
    tile = jnp.clip(tile_start[req] + i // bq, 0, w - 1)[:, None, None]
    row = ((i % bq)[:, None] * g_pad + jnp.arange(g, dtype=jnp.int32)[None, :])[:, None, :]  # [T, 1, G]
    head = jnp.arange(hkv)[None, :, None]
    _, lo, hi = split_run(meta[:, 1][None], meta[:, 2][None], jnp.arange(s)[:, None], config.block_kv, s,
                          config.min_split_steps, window)
    ran = (lo < hi)[:, tile]  # [S, T, 1, 1]: the splits that wrote their partials
    got = combine_splits(jnp.where(ran[..., None], acc[:, tile, head, row], 0.0),
                         jnp.where(ran, m[:, tile, head, row], -jnp.inf),
                         jnp.where(ran, l[:, tile, head, row], 0.0))  # [T, Hkv, G, D]
    got = jnp.where(valid[:, None, None, None], got, 0.0)  # a select: an unwritten row's garbage goes
    return got.reshape(t, hq, d).astype(q.dtype)


def combine_splits(acc, m, l):
    """Merge the splits' partials (axis 0; base-2 max and sum) into normalised rows."""
    m_all = jnp.max(m, axis=0)
    m_safe = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
    wgt = jnp.exp2(m - m_safe[None])  # 0 for a split that saw no key of the row
    den = jnp.sum(wgt * l, axis=0)
    num = jnp.sum(wgt[..., None] * acc, axis=0)
    return jnp.where((den > 0)[..., None], num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def mosaic_supports(dtype, head_dim: int, block_size: int, sliding_window=None) -> tuple[bool, str]:
    """(True, "") when a model of ``dtype`` and ``head_dim`` (and ``sliding_window``) with pages of
    ``block_size`` can run on this kernel at its default tiles; (False, why) otherwise."""
    try:
        check_mosaic_options(dtype, head_dim, block_size, max(64, block_size), sliding_window, None)
    except ValueError as e:
        return False, str(e)
    return True, ""


# The start-up self-check: the registry's ragged cases at the kernel's own shapes (bf16, head_dim
# 64, pages of 16), two context splits so that the combine runs too.
SELF_CHECK_SHAPE = CheckShape(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=40, max_blocks=6)
SELF_CHECK_ATOL = 2e-2  # bf16 outputs of magnitude ~1: a few ulps


def mosaic_self_check(interpret=False, kv_dtype=None) -> tuple[bool, str]:
    """Run the kernel (compiled on this GPU, or interpreted) on the registry's check batches
    against the reference, over a pool of ``kv_dtype`` (bf16 by default; fp8 e4m3 runs the fp8
    ring and staging tiles, compared with the reference on the same fp8 values); (True, "") when
    it agrees, (False, why) when it fails or disagrees."""
    fn = functools.partial(ragged_paged_attention_mosaic, interpret=interpret,
                           config=MosaicConfig(block_kv=64, num_stages=2, num_splits=2, min_split_steps=1))
    try:
        result = check_against_reference(fn, atol=SELF_CHECK_ATOL, shape=SELF_CHECK_SHAPE, dtype=jnp.bfloat16,
                                         kv_dtype=kv_dtype)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot compile or run here is the answer
        return False, f"{type(e).__name__}: {e}"[:500]
    if not result.ok:
        pool = "" if kv_dtype is None else f" ({jnp.dtype(kv_dtype).name} pool)"
        return False, f"max abs error per case{pool} {result.errors} > {result.atol}"
    return True, ""
