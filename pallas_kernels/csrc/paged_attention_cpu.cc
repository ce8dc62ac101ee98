// Ragged paged attention for the CPU, called by XLA through its FFI (the `cpu` backend).
//
// Why C++ here when every other backend is jnp, Pallas or Triton: on the CPU, XLA can only
// express paged attention as a gather of each tile's pages into a fresh array followed by small
// batched dots. The gather writes and re-reads every context position it touches, and in a
// decode step that traffic (about 1 KB per position per layer, f32) is most of the step. This
// kernel reads each K/V row straight from its page, once per work item, prefetches the pages
// that follow, and keeps the scores, the online softmax and the output accumulator in a few KB
// of per-thread scratch.
//
// Contract: that of pallas_kernels (see __init__.py). Work items are (request, tile of up to
// kTileRows / Hq queries) with all heads; each owns its output rows, so items never share
// writes. They are claimed from an atomic counter by the calling thread and by helpers
// scheduled on XLA's intra-op thread pool, most expensive first.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows (query, head) per work item: a prefill tile reuses each K/V row it loads this many times,
// while its scores and accumulator stay within the L1 cache.
constexpr int kTileRows = 64;
constexpr int kPrefetchPages = 3;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load(float x) { return x; }
inline float load(uint16_t bf16) {
  uint32_t bits = uint32_t(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// float8 e4m3fn (a KV cache of --kv-cache-dtype fp8), decoded through a table of its 256 values.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + float(m) / 8.0f, e - 7);
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();  // e4m3fn: no infinities
      v[b] = (b & 0x80) ? -x : x;
    }
  }
};
inline float load(uint8_t fp8) {
  static const Fp8Table table;
  return table.v[fp8];
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *dst = uint16_t((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = uint16_t(bits >> 16);
}

// exp for x <= 0 (scores minus their running max), written so that the loop around it
// vectorizes: Cody-Waite range reduction and a degree-6 polynomial, within 1 ulp of exp on
// [-80, 0] (checked at 8 million points). Inputs below -87 (including -inf, a masked score)
// give exactly 0, a weight too small to change any sum it joins.
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.0f : p * scale;
}

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* query_start_loc;
  int64_t num_q_heads, head_dim, num_blocks, block_size, num_kv_heads, max_blocks;
  int64_t head_stride;  // elements between a position's KV heads: head_dim, or head_dim + 4 (int8)
  float sm_scale;
  int32_t window;  // 0: none
  float soft_cap;  // 0: none
  const float* sinks;  // [Hq] attention-sink logits (gpt-oss), in the denominator only; null: none
};

struct WorkItem {
  int32_t req, q_begin, q_end;  // q_begin/q_end: token indices into q
  int64_t cost;
};

// A position's K/V row (all heads) as float: f32 rows are read in place, bf16 and fp8 rows
// converted into `buf`; heads stay pb.head_stride apart.
inline const float* as_f32(const float* src, float*, const Problem&, int) { return src; }
template <typename KV>
inline const float* as_f32(const KV* src, float* buf, const Problem& pb, int) {
  const int64_t n = pb.num_kv_heads * pb.head_stride;
  for (int64_t i = 0; i < n; ++i) buf[i] = load(src[i]);
  return buf;
}
// An int8 row (--kv-cache-dtype int8): each head's D values, then its float32 scale in 4 bytes
// (pallas_kernels/int8_kv.py), dequantized here so the pool is read at one byte per element.
inline const float* as_f32(const int8_t* src, float* buf, const Problem& pb, int D) {
  for (int64_t h = 0; h < pb.num_kv_heads; ++h) {
    const int8_t* head = src + h * pb.head_stride;
    float scale;
    std::memcpy(&scale, head + D, 4);
    float* dst = buf + h * pb.head_stride;
#pragma omp simd
    for (int d = 0; d < D; ++d) dst[d] = float(head[d]) * scale;
  }
  return buf;
}

// For kR rows r: acc_r[0:D] = alpha[r] * acc_r + sum_j p_r[j] * v_r[j * stride : j * stride + D].
// Rows lie kD apart in acc and p_stride apart in p; v[r] is row r's first V row. The rows'
// accumulators are held in registers together: one row alone is a chain of dependent FMAs per
// register (each waits ~4 cycles for the last), while kR rows interleaved keep the FMA unit busy.
// Each row's arithmetic is the same whatever kR, so results never depend on the blocking.
// AVX-512 only (the caller checks kVectorScores); other builds take accumulate_row_portable.
template <int kD, int kR>
inline void accumulate_rows(float* acc, const float* alpha, const float* p, int p_stride, const float* const* v,
                            int n, int64_t stride) {
#if defined(__AVX512F__)
  constexpr int kV = kD / 16;
  __m512 a[kR][kV];
  for (int r = 0; r < kR; ++r) {
    const __m512 scale = _mm512_set1_ps(alpha[r]);
    for (int i = 0; i < kV; ++i) a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * kD + 16 * i), scale);
  }
  for (int j = 0; j < n; ++j)
    for (int r = 0; r < kR; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * p_stride + j]);
      for (int i = 0; i < kV; ++i) a[r][i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v[r] + j * stride + 16 * i), a[r][i]);
    }
  for (int r = 0; r < kR; ++r)
    for (int i = 0; i < kV; ++i) _mm512_storeu_ps(acc + r * kD + 16 * i, a[r][i]);
#endif
}

// The same for one row of any D, in portable loops (bf16 pages are converted by the caller).
inline void accumulate_row_portable(float* acc, float alpha, const float* p, const float* v, int n, int64_t stride,
                                    int D) {
  for (int d = 0; d < D; ++d) acc[d] *= alpha;
  for (int j = 0; j < n; ++j)
    for (int d = 0; d < D; ++d) acc[d] += p[j] * v[j * stride + d];
}

#if defined(__AVX512F__)
constexpr bool kHaveAvx512 = true;
// out[0:16] = dot(q, k + j * stride) for j < 16. The 16 dot products are reduced together: a
// transpose-and-add tree turns 16 vectors of partial sums into one vector of totals in 45
// shuffles and adds, where 16 separate horizontal sums would take about 130.
template <int kD>
inline void score16_avx512(const float* q, const float* k, int64_t stride, float* out) {
  constexpr int kV = kD / 16;
  __m512 qv[kV];
  for (int i = 0; i < kV; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  __m512 v[16];
  for (int j = 0; j < 16; ++j) {
    const float* kj = k + j * stride;
    __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kj));
    for (int i = 1; i < kV; ++i) s = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kj + 16 * i), s);
    v[j] = s;
  }
  __m512 s1[8], s2[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of vectors 4i..4i+3
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x44), _mm512_shuffle_f32x4(s2[0], s2[1], 0xEE));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], 0x44), _mm512_shuffle_f32x4(s2[2], s2[3], 0xEE));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD)));
}
#else
constexpr bool kHaveAvx512 = false;
template <int kD>
inline void score16_avx512(const float*, const float*, int64_t, float*) {}
#endif

// One work item: queries [q_begin, q_end) of request `req`, all heads. Rows of the tile are
// (query, q head); a page's K/V rows ([Hkv, D] per position, contiguous) are read once for all.
//
// Batch invariance: a row's result must not depend on which tile it lands in (tiles follow the
// step's chunking, and a seeded sample must not change with the batch). So every row is scored
// by the same code whatever the tile's size, and the softmax and the P.V sum run over whole
// pages: the positions a tile adds past a row's own (later queries' keys) enter as exact zeros
// (a page a row cannot see rescales it by exactly 1 and adds exactly 0).
//
// Each page is taken in passes over all the tile's rows (scores; masks and maxima; weights;
// P.V), not row by row: a row's online-softmax update is a chain of dependent operations, and
// rows side by side in one pass let the core overlap their chains. The softmax denominator is
// kept as 16 partial sums per row (by position mod 16) and added up once at the end
// (docs/benchmarks.md compares it with the row-by-row loop).
// T: q and out; KV: the pages (T itself, uint8_t for float8 e4m3fn, int8_t for int8 with scales).
template <typename T, typename KV, int kD>
void attend(const Problem& pb, const WorkItem& it) {
  const int D = kD > 0 ? kD : int(pb.head_dim);
  const int HQ = int(pb.num_q_heads), G = int(pb.num_q_heads / pb.num_kv_heads);
  const int BS = int(pb.block_size);
  const int nq = it.q_end - it.q_begin;
  const int rows = nq * HQ;
  const T* q = static_cast<const T*>(pb.q);
  const KV* kc = static_cast<const KV*>(pb.k);
  const KV* vc = static_cast<const KV*>(pb.v);
  T* out = static_cast<T*>(pb.out);
  const int32_t* table = pb.block_tables + int64_t(it.req) * pb.max_blocks;
  const int ctx = pb.kv_lens[it.req];
  const int qsl0 = pb.query_start_loc[it.req];
  const int q_len = pb.query_start_loc[it.req + 1] - qsl0;
  const int first_pos = ctx - q_len + (it.q_begin - qsl0);  // context position of q_begin
  const int64_t row_stride = pb.num_kv_heads * pb.head_stride;  // elements between positions in a page
  // An int8 page (float32 queries) is dequantized once into float scratch and then read by the
  // vector paths as a float32 page is: the per-position portable loops cost more than the pool's
  // smaller reads save (docs/benchmarks.md, the int8 KV cache).
  constexpr bool kDequantPages = std::is_same_v<KV, int8_t>;
  constexpr bool kVectorScores = kHaveAvx512 && std::is_same_v<T, float> &&
                                 (std::is_same_v<KV, float> || kDequantPages) && kD > 0 && kD % 16 == 0;
  const bool vector_scores = kVectorScores && BS % 16 == 0;
  thread_local std::vector<float> dequantized;  // [2, BS, row_stride]: one page's K, then its V
  if constexpr (kVectorScores && kDequantPages) dequantized.resize(size_t(2) * BS * row_stride);

  // Per-thread scratch, grown on demand: items run on XLA's pool threads, whose stacks are small.
  thread_local std::vector<float> scratch;
  thread_local std::vector<int> head_off;  // row -> offset of its KV head in a [Hkv, D] row
  constexpr int kLanes = 16;
  scratch.resize(size_t(rows) * (2 * D + BS + kLanes + 3) + row_stride);
  head_off.resize(rows);
  float* qs = scratch.data();      // [rows, D], pre-scaled
  float* acc = qs + rows * D;      // [rows, D]
  float* scores = acc + rows * D;  // [rows, BS]: position within the page
  float* l = scores + rows * BS;   // [rows, kLanes]: the softmax denominator by position mod 16
  float* m = l + rows * kLanes;    // running max of each row's visible scores
  float* shift = m + rows;       // what this page's scores are exponentiated against
  float* alpha = shift + rows;   // this page's rescale of each row's accumulator and sums
  float* kv_buf = alpha + rows;  // one K row converted from bf16

  for (int row = 0; row < rows; ++row) {
    const T* src = q + (int64_t(it.q_begin) * HQ + row) * D;  // rows are q's own [T, Hq] order
    for (int d = 0; d < D; ++d) qs[row * D + d] = load(src[d]) * pb.sm_scale;
    head_off[row] = int((row % HQ) / G * pb.head_stride);
    m[row] = kNegInf;
  }
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(l, l + rows * kLanes, 0.0f);

  const int last_pos = first_pos + nq - 1;
  const int k_begin = pb.window > 0 ? std::max(0, first_pos - pb.window + 1) : 0;
  const int k_end = std::min(last_pos + 1, ctx);
  for (int page = k_begin / BS; page * BS < k_end; ++page) {
    const int page_start = page * BS;
    const int valid = std::min(BS, ctx - page_start);  // positions holding this request's K/V
    const int64_t page_base = std::clamp<int64_t>(table[page], 0, pb.num_blocks - 1) * BS * row_stride;
    // The next pages into L2 while this one is computed: pages are scattered over the pool, so
    // the hardware prefetcher cannot follow them. Each of the next kPrefetchPages pages is asked
    // for again at every page: a prefetch finding the miss queue full is dropped, and asking
    // again is cheap once a line is there. Three pages ahead was the fastest distance tried
    // (docs/benchmarks.md).
    for (int ahead = 1; ahead <= kPrefetchPages && (page + ahead) * BS < k_end; ++ahead) {
      const int64_t next = std::clamp<int64_t>(table[page + ahead], 0, pb.num_blocks - 1) * BS * row_stride;
      const char* nk = reinterpret_cast<const char*>(kc + next);
      const char* nv = reinterpret_cast<const char*>(vc + next);
      for (int64_t o = 0; o < BS * row_stride * int64_t(sizeof(KV)); o += 64) {
        __builtin_prefetch(nk + o, 0, 2);  // locality 2: into L2 (x86 prefetcht1)
        __builtin_prefetch(nv + o, 0, 2);
      }
    }
    const float* kpage = nullptr;  // this page's K and V rows as float32 (the vector paths)
    const float* vpage = nullptr;
    if constexpr (kVectorScores) {
      if constexpr (kDequantPages) {
        float* kbuf = dequantized.data();
        float* vbuf = kbuf + BS * row_stride;
        if (vector_scores)  // whole pages are scored; stale rows give anything, masked below
          for (int jj = 0; jj < BS; ++jj) as_f32(kc + page_base + jj * row_stride, kbuf + jj * row_stride, pb, D);
        for (int jj = 0; jj < valid; ++jj) as_f32(vc + page_base + jj * row_stride, vbuf + jj * row_stride, pb, D);
        kpage = kbuf;
        vpage = vbuf;
      } else {
        kpage = kc + page_base;
        vpage = vc + page_base;
      }
    }
    bool scored = false;
    if constexpr (kVectorScores) {
      if (vector_scores) {
        // Whole pages, 16 positions at a time; stale positions past the context are scored
        // from whatever they hold (even NaN) and masked below.
        for (int row = 0; row < rows; ++row)
          for (int sub = 0; sub < BS; sub += 16)
            score16_avx512<kD>(qs + row * D, kpage + sub * row_stride + head_off[row], row_stride,
                               scores + row * BS + sub);
        scored = true;
      }
    }
    if (!scored) {
      for (int jj = 0; jj < valid; ++jj) {
        const float* kr = as_f32(kc + page_base + jj * row_stride, kv_buf, pb, D);
        for (int row = 0; row < rows; ++row) {
          const float* qr = qs + row * D;
          const float* kh = kr + head_off[row];
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int d = 0; d < D; ++d) s += qr[d] * kh[d];
          scores[row * BS + jj] = s;
        }
      }
      for (int row = 0; row < rows; ++row) std::fill(scores + row * BS + valid, scores + (row + 1) * BS, 0.0f);
    }

    // Masks (causal, window) and each row's new running max.
    for (int row = 0; row < rows; ++row) {
      float* sr = scores + row * BS;
      const int pos = first_pos + row / HQ;  // < ctx, so stale positions are never visible
      const int lo = pb.window > 0 ? pos - pb.window + 1 : 0;
      if (pb.soft_cap > 0.0f)
        for (int jj = 0; jj < BS; ++jj) sr[jj] = pb.soft_cap * std::tanh(sr[jj] / pb.soft_cap);
      float block_max = kNegInf;
#pragma omp simd reduction(max : block_max)
      for (int jj = 0; jj < BS; ++jj) {
        const int j = page_start + jj;
        const float s = (j <= pos && j >= lo) ? sr[jj] : kNegInf;
        sr[jj] = s;
        block_max = std::max(block_max, s);
      }
      const float m_new = std::max(m[row], block_max);
      shift[row] = m_new == kNegInf ? 0.0f : m_new;  // a row that has seen nothing yet stays at 0
      alpha[row] = m[row] - shift[row];              // <= 0, or -inf: exponentiated below
      m[row] = m_new;
    }
#pragma omp simd
    for (int row = 0; row < rows; ++row) alpha[row] = exp_nonpositive(alpha[row]);

    // Weights, and the denominator's partial sums, in one pass: a pass of its own helps prefill
    // tiles a little and costs decode ones more.
    for (int row = 0; row < rows; ++row) {
      float* sr = scores + row * BS;
      float* lr = l + row * kLanes;
      const float sh = shift[row], a = alpha[row];
#pragma omp simd
      for (int jj = 0; jj < BS; ++jj) sr[jj] = exp_nonpositive(sr[jj] - sh);  // masked: exactly 0
#pragma omp simd
      for (int lane = 0; lane < kLanes; ++lane) lr[lane] *= a;
      if (BS % kLanes == 0) {
        for (int c = 0; c < BS; c += kLanes)
#pragma omp simd
          for (int lane = 0; lane < kLanes; ++lane) lr[lane] += sr[c + lane];
      } else {
        for (int jj = 0; jj < BS; ++jj) lr[(page_start + jj) % kLanes] += sr[jj];
      }
    }

    // P.V over the positions that hold K/V (p is 0 for the invisible ones; stale rows past the
    // context are never read, since 0 * NaN would poison the sum).
    if constexpr (kVectorScores) {
      constexpr int kR = kD >= 128 ? 1 : 128 / kD;  // rows per pass: 8 accumulator registers
      const float* v_rows[kR];
      int row = 0;
      for (; row + kR <= rows; row += kR) {
        for (int r = 0; r < kR; ++r) v_rows[r] = vpage + head_off[row + r];
        accumulate_rows<kD, kR>(acc + row * D, alpha + row, scores + row * BS, BS, v_rows, valid, row_stride);
      }
      for (; row < rows; ++row) {
        v_rows[0] = vpage + head_off[row];
        accumulate_rows<kD, 1>(acc + row * D, alpha + row, scores + row * BS, BS, v_rows, valid, row_stride);
      }
    } else if constexpr (std::is_same_v<KV, float>) {
      for (int row = 0; row < rows; ++row)
        accumulate_row_portable(acc + row * D, alpha[row], scores + row * BS, vc + page_base + head_off[row],
                                valid, row_stride, D);
    } else {
      for (int row = 0; row < rows; ++row)
        for (int d = 0; d < D; ++d) acc[row * D + d] *= alpha[row];
      for (int jj = 0; jj < valid; ++jj) {
        const float* vr = as_f32(vc + page_base + jj * row_stride, kv_buf, pb, D);
        for (int row = 0; row < rows; ++row) {
          const float p = scores[row * BS + jj];
          const float* vh = vr + head_off[row];
          float* ar = acc + row * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) ar[d] += p * vh[d];
        }
      }
    }
  }

  for (int row = 0; row < rows; ++row) {
    T* dst = out + (int64_t(it.q_begin) * HQ + row) * D;
    float sum = 0.0f;
    for (int lane = 0; lane < kLanes; ++lane) sum += l[row * kLanes + lane];
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    if (pb.sinks != nullptr) {  // l is relative to m (when m is finite): fold the sink in at their max
      const float sink = pb.sinks[row % HQ];
      const float top = std::max(m[row], sink);
      const float scale = m[row] == kNegInf ? 0.0f : std::exp(m[row] - top);
      inv = scale / (sum * scale + std::exp(sink - top));
    }
    for (int d = 0; d < D; ++d) store(dst + d, acc[row * D + d] * inv);
  }
}

template <typename T, typename KV>
void attend_any(const Problem& pb, const WorkItem& it) {
  switch (pb.head_dim) {
    case 32: return attend<T, KV, 32>(pb, it);
    case 64: return attend<T, KV, 64>(pb, it);
    case 128: return attend<T, KV, 128>(pb, it);
    default: return attend<T, KV, 0>(pb, it);
  }
}

// Shared by the caller and its helpers; helpers hold it by shared_ptr, so one that starts after
// the call returned finds no work left and touches nothing else.
struct Job {
  Problem problem;
  std::vector<WorkItem> items;
  bool bf16 = false;
  bool fp8_kv = false;
  bool int8_kv = false;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    const int64_t n = int64_t(items.size());
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      if (int8_kv) {
        if (bf16) attend_any<uint16_t, int8_t>(problem, items[i]);
        else attend_any<float, int8_t>(problem, items[i]);
      } else if (fp8_kv) {
        if (bf16) attend_any<uint16_t, uint8_t>(problem, items[i]);
        else attend_any<float, uint8_t>(problem, items[i]);
      } else if (bf16) {
        attend_any<uint16_t, uint16_t>(problem, items[i]);
      } else {
        attend_any<float, float>(problem, items[i]);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                          ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Buffer<ffi::S32> block_tables,
                          ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                          int32_t sliding_window, float soft_cap, int32_t use_sinks) {
  const auto dtype = q.element_type();
  if (dtype != ffi::F32 && dtype != ffi::BF16)
    return ffi::Error::InvalidArgument("cpu paged attention supports float32 and bfloat16 only");
  const auto kv_dtype = k_cache.element_type();
  const bool int8_kv = kv_dtype == ffi::S8;
  if ((kv_dtype != dtype && kv_dtype != ffi::F8E4M3FN && !int8_kv) || v_cache.element_type() != kv_dtype ||
      out->element_type() != dtype)
    return ffi::Error::InvalidArgument(
        "q and out share one dtype; k_cache and v_cache it too, or float8_e4m3fn, or int8 with scales");
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2)
    return ffi::Error::InvalidArgument("expected q [T, Hq, D], caches [NB, BS, Hkv, D], tables [R, MB]");
  const int64_t hq = qd[1], d = qd[2], bs = kd[1], hkv = kd[2], r = bd[0];
  const int64_t head_stride = int8_kv ? d + 4 : d;  // an int8 row ends with its float32 scale
  if (kd[3] != head_stride || hq % hkv != 0)
    return ffi::Error::InvalidArgument("head_dim of q and caches differ (int8: head_dim + 4), or Hq % Hkv != 0");
  if (use_sinks && (sinks.dimensions().size() != 1 || sinks.dimensions()[0] != hq))
    return ffi::Error::InvalidArgument("sinks must be [Hq]");
  const int32_t tile_q = int32_t(std::max<int64_t>(1, kTileRows / hq));

  auto job = std::make_shared<Job>();
  job->bf16 = dtype == ffi::BF16;
  job->fp8_kv = kv_dtype == ffi::F8E4M3FN;
  job->int8_kv = int8_kv;
  job->problem = Problem{q.untyped_data(), k_cache.untyped_data(), v_cache.untyped_data(),
                         out->untyped_data(), kv_lens.typed_data(), block_tables.typed_data(),
                         query_start_loc.typed_data(), hq, d, kd[0], bs, hkv, bd[1], head_stride,
                         sm_scale, sliding_window, soft_cap, use_sinks ? sinks.typed_data() : nullptr};
  std::memset(out->untyped_data(), 0, out->size_bytes());  // padding tokens give 0

  const int32_t* qsl = query_start_loc.typed_data();
  const int64_t ns = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, r);
  for (int32_t req = 0; req < ns; ++req) {
    const int32_t a = std::max(qsl[req], 0), b = std::min<int64_t>(qsl[req + 1], qd[0]);
    const int32_t ctx = kv_lens.typed_data()[req];
    for (int32_t t = a; t < b; t += tile_q) {
      const int32_t e = std::min(t + tile_q, b);
      const int64_t end = int64_t(ctx) - (qsl[req + 1] - qsl[req]) + (e - qsl[req]);  // causal reach
      const int64_t reach = sliding_window > 0 ? std::min<int64_t>(end, sliding_window + tile_q) : end;
      job->items.push_back({req, t, e, reach * (e - t + 4)});
    }
  }
  std::sort(job->items.begin(), job->items.end(),
            [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });

  const int64_t n = int64_t(job->items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionCpu, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("use_sinks"));
