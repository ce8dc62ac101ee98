"""The Triton kernel behind ``ragged_paged_attention_triton``.

Imported lazily (only when ``triton`` and ``jax_triton`` are importable): importing this module
imports ``triton``. Same tiling as the Pallas ``mixed`` kernel (see ``ragged_paged_attention.py``):
grid ``(num_q_tiles, num_kv_heads)``, a tile = ``BLOCK_Q`` tokens of one request x the padded GQA
group of one KV head, online softmax in base 2 over ``BLOCK_KV``-position KV tiles gathered through
the block table. All sizes are ``tl.constexpr`` (one compile per shape bucket).
"""

import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    # tanh via exp2, saturating correctly at +-inf without libdevice
    return 2.0 / (1.0 + tl.exp2(x * (-2.0 * 1.4426950408889634))) - 1.0


@triton.jit
def ragged_paged_attention_kernel(
    te_ptr,  # int32 [R_PAD]  cumulative q-tile ends per request, INT32_MAX padded
    qsl_ptr,  # int32 [R + 1]
    kvl_ptr,  # int32 [R]
    bt_ptr,  # int32 [R, MB]
    q_ptr,  # [T * HQ, D]
    k_ptr,  # [NB * BS, HKV, D]
    v_ptr,  # [NB * BS, HKV, D]
    o_ptr,  # [T * HQ, D]
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    NB: tl.constexpr,
    BS: tl.constexpr,
    MB: tl.constexpr,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    ROWS: tl.constexpr,
    SCALE: tl.constexpr,  # sm_scale * log2(e) without soft cap, sm_scale with it
    SOFT_CAP: tl.constexpr,  # 0.0 = off
    WINDOW: tl.constexpr,  # 0 = off
    IEEE: tl.constexpr,  # float32 inputs: full-precision dots
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    te = tl.load(te_ptr + tl.arange(0, R_PAD))
    r = tl.sum((te <= i).to(tl.int32), axis=0)
    if r < R:
        q_start = tl.load(qsl_ptr + r)
        q_len = tl.load(qsl_ptr + r + 1) - q_start
        kv_len = tl.load(kvl_ptr + r)
        n_tiles = (q_len + BLOCK_Q - 1) // BLOCK_Q
        tile = i - (tl.load(te_ptr + r) - n_tiles)

        row = tl.arange(0, ROWS)
        tq = row // G_PAD
        gi = row % G_PAD
        off = tile * BLOCK_Q + tq
        valid = (off < q_len) & (gi < G)
        dst = ((q_start + off) * HQ + h * G + gi).to(tl.int64)
        dcol = tl.arange(0, D)
        q = tl.load(q_ptr + dst[:, None] * D + dcol[None, :], mask=valid[:, None], other=0.0)

        ctx0 = kv_len - q_len
        q_pos = tl.where(valid, ctx0 + off, -1)
        first = ctx0 + tile * BLOCK_Q
        last = ctx0 + tl.minimum(q_len, tile * BLOCK_Q + BLOCK_Q) - 1
        if WINDOW > 0:
            lo_t = tl.maximum(first - (WINDOW - 1), 0) // BLOCK_KV
        else:
            lo_t = 0
        hi_t = (last + BLOCK_KV) // BLOCK_KV
        kv_last = tl.maximum(kv_len - 1, 0)

        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for j in range(lo_t, hi_t):
            kv_pos = j * BLOCK_KV + tl.arange(0, BLOCK_KV)
            pos_c = tl.minimum(kv_pos, kv_last)
            page = tl.minimum(pos_c // BS, MB - 1)
            blk = tl.load(bt_ptr + r * MB + page)
            blk = tl.minimum(tl.maximum(blk, 0), NB - 1)
            slot = blk.to(tl.int64) * BS + (pos_c % BS)
            kv_off = (slot * HKV + h)[:, None] * D + dcol[None, :]
            # an fp8 pool is loaded as stored (half the bytes) and cast to the query dtype here
            k = tl.load(k_ptr + kv_off).to(q.dtype)
            v = tl.load(v_ptr + kv_off).to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * SCALE
            if SOFT_CAP > 0:
                s = (SOFT_CAP * 1.4426950408889634) * _tanh(s / SOFT_CAP)
            mask = kv_pos[None, :] <= q_pos[:, None]
            if WINDOW > 0:
                mask = mask & (kv_pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(mask, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new

        ok = l > 0
        out = tl.where(ok[:, None], acc / tl.where(ok, l, 1.0)[:, None], 0.0)
        tl.store(o_ptr + dst[:, None] * D + dcol[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=valid[:, None])
