// y = x @ W^T for a weight kept in GGUF's 32-wide blocks (Q8_0, Q4_0, Q4_1), called by XLA
// through its FFI: the CPU path of jaxserve's `--quantization gguf`.
//
// Why C++: XLA:CPU cannot fuse a block dequantization into its dot. It either writes the whole
// float weight before each product (reading 1 byte per weight to write 4: slower than float
// weights) or runs one small batched dot per block, slower still. A decode step reads every
// weight once, so its time is the bytes read: this kernel reads each block as stored, expands a
// few rows into L1-resident floats and multiplies them with every token's activations there.
//
// Layout (one row per output feature, blocks along the input), for a stack of L weights:
//   x     f32 [T, K]               activations
//   qs    u8  [L, N, K * bits / 8] the quants: bits 8 -> int8 values; bits 4 -> byte j of a block
//                                  holds element j in its low nibble and element j + 16 in its high one
//   layer s32 []                   which weight of the stack to multiply by
//   d     f16 [L, N, K / 32]       block scales, the file's half floats (widened here: exact)
//   m     f16 [L, N, K / 32]       block minimums, a last argument only for a format with them (Q4_1):
//                                  Q8_0 and Q4_0 pass none, so no zero array is kept or read
//   w[n, k] = d[l, n, k/32] * (q[l, n, k] - offset) + m[l, n, k/32]   (offset 8 for Q4_0, else 0)
// The stack and the index: a scanned model's layer reads its own blocks in place, where slicing
// them out first would copy every layer's blocks each step (a lone weight is a stack of one).
// Work items are runs of kRowsPerItem output rows; the calling thread and helpers scheduled on XLA's
// intra-op pool claim them from an atomic counter, and each writes only its own columns of y.

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 4;         // output rows expanded at once: each activation row read once per tile
// rows a work item claims: SmolLM2's 576-row o and down are 18 items, 9 a thread of two (at 64
// rows, 9 items: one thread took 5, the other waited)
constexpr int64_t kRowsPerItem = 32;
// The int8 path reads kRows rows side by side while they span at most this many bytes (a Q4 row
// of 576 inputs, 288 bytes), else, for several tokens, two (a Q8_0 row of 576 inputs: its
// activation loads shared), else one at a time (one token; down's 1536 inputs): four long rows
// read side by side ran up to 2x slower, two at one token 1.6x (docs/benchmarks.md).
constexpr int64_t kInt8TileBytes = 1280;
constexpr int64_t kPrefetchTiles = 2;  // how far ahead the int8 path prefetches its weights, in tiles

// An IEEE half (a file's scale) as a float; every half is a float exactly.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(float(man), -24);  // zero or subnormal
  } else if (exp == 31) {
    mag = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    const uint32_t bits = ((exp + 112u) << 23) | (man << 13);  // rebias 15 -> 127
    std::memcpy(&mag, &bits, sizeof mag);
  }
  return (h & 0x8000) ? -mag : mag;
#endif
}

struct Problem {
  const float* x;
  const uint8_t* qs;
  const uint16_t* d;  // halves
  const uint16_t* m;  // halves; nullptr for a format without minimums
  float* y;
  int64_t t, k, n, bits, offset;
  // int8 activations (see run_rows_int8): per token, K rounded up to whole block pairs
  const int8_t* xq = nullptr;  // [T, kp] the activations in int8 (pair_order), one scale per block of 32
  const float* dx = nullptr;   // [T, kp / 32] those scales
  const float* xs = nullptr;   // [T, kp / 32] each block's scale times its int8 sum
  int64_t kp = 0;
};

// nb halves as floats: 16 an instruction where AVX-512 has them (a conversion per block, beside
// the block's few vector instructions, measurably slowed a one-row product).
void widen(const uint16_t* h, int64_t nb, float* out) {
  int64_t b = 0;
#if defined(__AVX512F__)
  for (; b + 16 <= nb; b += 16)
    _mm512_storeu_ps(out + b, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + b))));
#endif
  for (; b < nb; ++b) out[b] = half_to_float(h[b]);
}

// Row n's weights as floats into w[0, k); `scales` holds 2 * K / 32 floats of scratch.
void expand_row(const Problem& p, int64_t n, float* w, float* scales) {
  const int64_t nb = p.k / kBlock;
  const int64_t row_bytes = p.k * p.bits / 8;
  const uint8_t* q = p.qs + n * row_bytes;
  float* d = scales;
  float* m = scales + nb;
  widen(p.d + n * nb, nb, d);
  if (p.m != nullptr) widen(p.m + n * nb, nb, m);
  for (int64_t b = 0; b < nb; ++b) {
    const float scale = d[b], low = (p.m != nullptr ? m[b] : 0.f) - scale * float(p.offset);
    float* out = w + b * kBlock;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(scale), vl = _mm512_set1_ps(low);
    if (p.bits == 8) {
      const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
      const __m512i lo = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(qb));
      const __m512i hi = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(qb, 1));
      _mm512_storeu_ps(out, _mm512_fmadd_ps(vs, _mm512_cvtepi32_ps(lo), vl));
      _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(vs, _mm512_cvtepi32_ps(hi), vl));
    } else {
      const __m128i qb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (kBlock / 2)));
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(qb, mask));
      const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qb, 4), mask));
      _mm512_storeu_ps(out, _mm512_fmadd_ps(vs, _mm512_cvtepi32_ps(lo), vl));
      _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(vs, _mm512_cvtepi32_ps(hi), vl));
    }
#else
    if (p.bits == 8) {
      const int8_t* qb = reinterpret_cast<const int8_t*>(q + b * kBlock);
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) out[j] = scale * float(qb[j]) + low;
    } else {
      const uint8_t* qb = q + b * (kBlock / 2);
#pragma omp simd
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        out[j] = scale * float(qb[j] & 0x0F) + low;
        out[j + kBlock / 2] = scale * float(qb[j] >> 4) + low;
      }
    }
#endif
  }
}

#if defined(__AVX512F__)
// y[t, n0 + r] for kRows expanded rows and one token: kRows independent FMA chains over K.
inline void dot_rows(const float* xt, const float* w, int64_t k, float* out) {
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 xv = _mm512_loadu_ps(xt + i);
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + r * k + i), acc[r]);
  }
  for (int r = 0; r < kRows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#if defined(__AVX512F__)
// One token on the float path (a decode row of Q8_0, the tied head's): each block's products
// summed in registers and scaled there, a row at a time, no expanded row written; the minimums
// and offsets enter through the token's per-block sums. Same products, another rounding order.
void run_rows_one_token(const Problem& p, int64_t first, int64_t last) {
  const int64_t nb = p.k / kBlock, row_bytes = p.k * p.bits / 8;
  thread_local std::vector<float> sums;
  if (int64_t(sums.size()) < nb) sums.resize(size_t(nb));
  for (int64_t b = 0; b < nb; ++b)
    sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(p.x + b * kBlock), _mm512_loadu_ps(p.x + b * kBlock + 16)));
  const __m512 offset = _mm512_set1_ps(float(p.offset));
  const __m128i nibbles = _mm_set1_epi8(0x0F);
  for (int64_t n = first; n < last; ++n) {
    const uint8_t* q = p.qs + n * row_bytes;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t i = 0; i < nb; i += 16) {
      const __mmask16 keep = nb - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - i)) - 1);
      const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, p.d + n * nb + i));
      const __m512 mins = p.m == nullptr ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, p.m + n * nb + i));
      acc[0] = _mm512_fmadd_ps(_mm512_fnmadd_ps(offset, d, mins), _mm512_maskz_loadu_ps(keep, sums.data() + i), acc[0]);
      for (int64_t b = i; b < std::min(nb, i + 16); ++b) {
        __m512 lo, hi;
        if (p.bits == 8) {
          lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kBlock))));
          hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kBlock + 16))));
        } else {
          const __m128i qb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (kBlock / 2)));
          lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qb, nibbles)));
          hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qb, 4), nibbles)));
        }
        const __m512 part = _mm512_fmadd_ps(hi, _mm512_loadu_ps(p.x + b * kBlock + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(p.x + b * kBlock)));
        acc[b % 2] = _mm512_fmadd_ps(part, _mm512_permutexvar_ps(_mm512_set1_epi32(int(b - i)), d), acc[b % 2]);
      }
    }
    p.y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
  }
}
#endif

void run_rows(const Problem& p, int64_t first, int64_t last) {
#if defined(__AVX512F__)
  if (p.t == 1) return run_rows_one_token(p, first, last);
#endif
  // kRows expanded rows, then one row's widened scales; pool threads have small stacks
  thread_local std::vector<float> scratch;
  const size_t need = size_t(kRows * p.k + 2 * (p.k / kBlock));
  if (scratch.size() < need) scratch.resize(need);  // not cleared: a short tile's spare rows are
                                                     // an earlier tile's floats, never written out
  float* scales = scratch.data() + kRows * p.k;
  for (int64_t n0 = first; n0 < last; n0 += kRows) {
    const int64_t rows = std::min(kRows, last - n0);
    for (int64_t r = 0; r < rows; ++r) expand_row(p, n0 + r, scratch.data() + r * p.k, scales);
    for (int64_t t = 0; t < p.t; ++t) {
      const float* xt = p.x + t * p.k;
#if defined(__AVX512F__)
      float out[kRows];
      dot_rows(xt, scratch.data(), p.k, out);  // K % 32 == 0; rows past `rows` hold stale values
      for (int64_t r = 0; r < rows; ++r) p.y[t * p.n + n0 + r] = out[r];
#else
      for (int64_t r = 0; r < rows; ++r) {
        const float* w = scratch.data() + r * p.k;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < p.k; ++i) s += xt[i] * w[i];
        p.y[t * p.n + n0 + r] = s;
      }
#endif
    }
  }
}


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kInt8Dots = true;
#else
constexpr bool kInt8Dots = false;
#endif

// llama.cpp's path for a block format: each token's activations quantized per block of 32 to
// int8 (scale = the block's absolute maximum / 127, as its Q8_0 activations), each weight block
// made unsigned (Q8_0's int8 plus 128, then an offset of 128; Q4's nibbles as they are) and
// multiplied by VNNI's u8 x s8 dot, 64 products an instruction against a float FMA's 16:
//   y[t, n] = sum_b d[b] dx[b] sum_j u[b, j] xq[b, j]  +  sum_b (m[b] - offset d[b]) dx[b] sum_j xq[b, j]
// xq holds each block pair (64 values) in the order its weights unpack to (pair_order), so the
// weights need no shuffle: a 4-bit pair unpacks as [lo nibbles of both blocks | hi nibbles of both].
// 4 bits: position of element e of block h (0 or 1) of a pair; 8 bits: the natural order.
inline int64_t pair_order(int bits, int64_t h, int64_t e) {
  return bits == 8 ? h * kBlock + e : (e / 16) * 32 + h * 16 + e % 16;
}

void quantize_activations(const Problem& p, int8_t* xq, float* dx, float* xs) {
  const int64_t nb = p.k / kBlock, nbp = p.kp / kBlock;
  for (int64_t t = 0; t < p.t; ++t) {
    const float* x = p.x + t * p.k;
    for (int64_t b = 0; b < nbp; ++b) {
      int8_t* pair = xq + t * p.kp + (b / 2) * 2 * kBlock;
      const int64_t h = b % 2;
      if (b >= nb) {  // the pad block of an odd block count
        for (int64_t e = 0; e < kBlock; ++e) pair[pair_order(int(p.bits), h, e)] = 0;
        dx[t * nbp + b] = 0.f;
        xs[t * nbp + b] = 0.f;
        continue;
      }
      const float* xb = x + b * kBlock;
      int8_t q[kBlock];
      int32_t sum = 0;
      float scale;
#if defined(__AVX512F__)
      // as the scalar loop below: cvtps rounds to nearest even under the default MXCSR, as nearbyint
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      scale = amax / 127.f;
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(ql));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qh));
      sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
#else
      float amax = 0.f;
      for (int64_t e = 0; e < kBlock; ++e) amax = std::max(amax, std::fabs(xb[e]));
      scale = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t e = 0; e < kBlock; ++e) {
        q[e] = int8_t(int32_t(std::nearbyint(xb[e] * inv)));
        sum += q[e];
      }
#endif
      if (p.bits == 8) {
        std::memcpy(pair + h * kBlock, q, kBlock);
      } else {  // halves 0-15 and 16-31 of the block go 32 bytes apart
        std::memcpy(pair + h * 16, q, 16);
        std::memcpy(pair + 32 + h * 16, q + 16, 16);
      }
      dx[t * nbp + b] = scale;
      xs[t * nbp + b] = scale * float(sum);
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Block pair j of a row (64 weights) as unsigned bytes in pair_order, read straight from the
// blocks; `one` when only its first block exists (an odd block count's last pair: no read past it).
inline __m512i weights_u8(const uint8_t* q, int64_t j, int bits, bool one) {
  if (bits == 8) {
    const __m512i v = one ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, q + j * 64) : _mm512_loadu_si512(q + j * 64);
    return _mm512_xor_si512(v, _mm512_set1_epi8(char(0x80)));
  }
  // the pair's 32 bytes in both halves, the upper half's 16-bit lanes shifted down a nibble
  const __m512i raw = one ? _mm512_broadcast_i64x4(_mm256_maskz_loadu_epi8(0xFFFFu, q + j * 32))
                          : _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 32)));
  return _mm512_and_si512(_mm512_mask_srli_epi16(raw, __mmask32(0xFFFF0000u), raw, 4), _mm512_set1_epi8(0x0F));
}

// Up to 16 halves (the lanes of `keep`) as floats, zeros elsewhere.
inline __m512 load_halves(__mmask16 keep, const uint16_t* h) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, h));
}

// Rows in groups of 16 blocks (8 pairs): a row's 16 scales are widened and multiplied by the
// activations' once a group, and each pair's dot picks its two lanes with one permute.
template <int64_t R>
void run_rows_int8(const Problem& p, int64_t first, int64_t last) {
  const int64_t nb = p.k / kBlock, nbp = p.kp / kBlock, pairs = nbp / 2;
  const int64_t row_bytes = p.k * p.bits / 8;
  const __m512 offset = _mm512_set1_ps(p.bits == 8 ? 128.f : float(p.offset));
  // which block of its pair each 32-bit dot lane sums (pair_order's)
  const __m512i lane_block = p.bits == 8 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                         : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int64_t n0 = first; n0 < last; n0 += R) {
    const int64_t rows = std::min(R, last - n0);
    const uint8_t* q[R];
    const uint16_t* d[R];
    const uint16_t* m[R];
    for (int r = 0; r < R; ++r) {  // a short tile repeats its last row, never written out
      const int64_t n = n0 + std::min<int64_t>(r, rows - 1);
      q[r] = p.qs + n * row_bytes;
      d[r] = p.d + n * nb;
      m[r] = p.m == nullptr ? nullptr : p.m + n * nb;
    }
    for (int64_t t = 0; t < p.t; ++t) {
      const int8_t* xq = p.xq + t * p.kp;
      const float* dx = p.dx + t * nbp;
      const float* xs = p.xs + t * nbp;
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t i = 0; i < nb; i += 16) {
        const __mmask16 keep = nb - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - i)) - 1);
        const __m512 dxv = _mm512_maskz_loadu_ps(keep, dx + i), xsv = _mm512_maskz_loadu_ps(keep, xs + i);
        __m512 scale[R];
        for (int r = 0; r < R; ++r) {  // d dx per block, and the zero terms (m - offset d) xs
          const __m512 dw = load_halves(keep, d[r] + i);
          scale[r] = _mm512_mul_ps(dw, dxv);
          const __m512 mins = m[r] == nullptr ? _mm512_setzero_ps() : load_halves(keep, m[r] + i);
          acc[r] = _mm512_fmadd_ps(_mm512_fnmadd_ps(offset, dw, mins), xsv, acc[r]);
        }
        const int64_t j_end = std::min(pairs, (i + 16) / 2);
        for (int64_t j = i / 2; j < j_end; ++j) {
          const bool one = 2 * j + 1 >= nb;
          const __m512i xv = _mm512_loadu_si512(xq + j * 64);
          const __m512i pick = _mm512_add_epi32(lane_block, _mm512_set1_epi32(int(2 * j - i)));
          for (int r = 0; r < R; ++r) {
            // the same spot kPrefetchTiles tiles on, a cache line per 64 bytes read: rows read side by
            // side are as many streams, which the hardware prefetcher follows poorly
            if (p.bits == 8 || j % 2 == 0)
              _mm_prefetch(reinterpret_cast<const char*>(q[r] + j * 8 * p.bits + kPrefetchTiles * R * row_bytes),
                           _MM_HINT_T0);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), weights_u8(q[r], j, int(p.bits), one), xv);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, scale[r]), acc[r]);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) p.y[t * p.n + n0 + r] = _mm512_reduce_add_ps(acc[r]);
    }
  }
}
#endif

struct Job {
  Problem problem;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t first = i * kRowsPerItem;
      const int64_t last = std::min(first + kRowsPerItem, problem.n);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (problem.xq != nullptr) {
        const int64_t row_bytes = problem.k * problem.bits / 8;
        if (kRows * row_bytes <= kInt8TileBytes) {
          run_rows_int8<kRows>(problem, first, last);
        } else if (problem.t > 1 && 2 * row_bytes <= kInt8TileBytes) {
          run_rows_int8<2>(problem, first, last);
        } else {
          run_rows_int8<1>(problem, first, last);
        }
      } else {
        run_rows(problem, first, last);
      }
#else
      run_rows(problem, first, last);
#endif
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Whether a scale array is [L, N, K / 32] for these x and qs.
bool scales_fit(ffi::Span<const int64_t> s, int64_t stack, int64_t n, int64_t k) {
  return s.size() == 3 && s[0] == stack && s[1] == n && s[2] == k / kBlock;
}

ffi::Error BlockQuantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> qs,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F16> d, ffi::RemainingArgs rest,
                            ffi::Result<ffi::Buffer<ffi::F32>> y, int32_t bits, int32_t offset,
                            int32_t int8_activations) {
  const auto xd = x.dimensions();
  const auto qd = qs.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || layer.dimensions().size() != 0 || rest.size() > 1)
    return ffi::Error::InvalidArgument("expected x [T, K], qs [L, N, K*bits/8], layer [], d and maybe m [L, N, K/32]");
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("bits must be 4 or 8");
  const int64_t t = xd[0], k = xd[1], stack = qd[0], n = qd[1];
  const uint16_t* mins = nullptr;
  if (rest.size() == 1) {
    auto m = rest.get<ffi::Buffer<ffi::F16>>(0);
    if (m.has_error()) return m.error();
    if (!scales_fit(m->dimensions(), stack, n, k))
      return ffi::Error::InvalidArgument("m must be [L, N, K/32] like d");
    mins = m->typed_data();
  }
  if (k % kBlock != 0 || qd[2] != k * bits / 8 || !scales_fit(d.dimensions(), stack, n, k))
    return ffi::Error::InvalidArgument("shapes of x, qs and d do not agree (K must be a multiple of 32)");
  const int64_t l = *layer.typed_data();
  if (l < 0 || l >= stack) return ffi::Error::InvalidArgument("layer index outside the stack");
  const int64_t nb = k / kBlock;
  auto job = std::make_shared<Job>();
  job->problem = Problem{x.typed_data(), qs.typed_data() + l * n * (k * bits / 8), d.typed_data() + l * n * nb,
                         mins == nullptr ? nullptr : mins + l * n * nb, y->typed_data(), t, k, n, bits, offset};
  // the int8 path's activations: quantized once here, read by every thread
  std::vector<int8_t> xq;
  std::vector<float> dx, xs;
  if (int8_activations != 0 && kInt8Dots) {
    Problem& p = job->problem;
    p.kp = (k + 2 * kBlock - 1) / (2 * kBlock) * (2 * kBlock);
    xq.resize(size_t(t * p.kp));
    dx.resize(size_t(t * p.kp / kBlock));
    xs.resize(size_t(t * p.kp / kBlock));
    quantize_activations(p, xq.data(), dx.data(), xs.data());
    p.xq = xq.data();
    p.dx = dx.data();
    p.xs = xs.data();
  }
  job->items = (n + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveBlockQuantMatmulCpu, BlockQuantMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("offset")
                                  .Attr<int32_t>("int8_activations"));
