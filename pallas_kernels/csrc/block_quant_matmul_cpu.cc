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
//   d     f32 [L, N, K / 32]       block scales;  m f32 [L, N, K / 32] block minimums (0 without one)
//   layer s32 []                   which weight of the stack to multiply by
//   w[n, k] = d[l, n, k/32] * (q[l, n, k] - offset) + m[l, n, k/32]   (offset 8 for Q4_0, else 0)
// The stack and the index: a scanned model's layer reads its own blocks in place, where slicing
// them out first would copy every layer's blocks each step (a lone weight is a stack of one).
// Work items are tiles of kRows output rows; the calling thread and helpers scheduled on XLA's
// intra-op pool claim them from an atomic counter, and each writes only its own columns of y.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 4;         // output rows expanded at once: each activation row read once per tile
constexpr int64_t kRowsPerItem = 64;  // rows a work item claims

struct Problem {
  const float* x;
  const uint8_t* qs;
  const float* d;
  const float* m;
  float* y;
  int64_t t, k, n, bits, offset;
};

// Row n's weights as floats into w[0, k).
void expand_row(const Problem& p, int64_t n, float* w) {
  const int64_t nb = p.k / kBlock;
  const int64_t row_bytes = p.k * p.bits / 8;
  const uint8_t* q = p.qs + n * row_bytes;
  const float* d = p.d + n * nb;
  const float* m = p.m + n * nb;
  for (int64_t b = 0; b < nb; ++b) {
    const float scale = d[b], low = m[b] - d[b] * float(p.offset);
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

void run_rows(const Problem& p, int64_t first, int64_t last) {
  thread_local std::vector<float> scratch;  // kRows expanded rows; pool threads have small stacks
  scratch.assign(size_t(kRows * p.k), 0.f);
  for (int64_t n0 = first; n0 < last; n0 += kRows) {
    const int64_t rows = std::min(kRows, last - n0);
    for (int64_t r = 0; r < rows; ++r) expand_row(p, n0 + r, scratch.data() + r * p.k);
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

struct Job {
  Problem problem;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t first = i * kRowsPerItem;
      run_rows(problem, first, std::min(first + kRowsPerItem, problem.n));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error BlockQuantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> qs,
                            ffi::Buffer<ffi::F32> d, ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::S32> layer,
                            ffi::Result<ffi::Buffer<ffi::F32>> y, int32_t bits, int32_t offset) {
  const auto xd = x.dimensions();
  const auto qd = qs.dimensions();
  const auto dd = d.dimensions();
  const auto md = m.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || dd.size() != 3 || md.size() != 3 || layer.dimensions().size() != 0)
    return ffi::Error::InvalidArgument("expected x [T, K], qs [L, N, K*bits/8], d and m [L, N, K/32], layer []");
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("bits must be 4 or 8");
  const int64_t t = xd[0], k = xd[1], stack = qd[0], n = qd[1];
  if (k % kBlock != 0 || qd[2] != k * bits / 8 || dd[0] != stack || dd[1] != n || dd[2] != k / kBlock ||
      md[0] != stack || md[1] != n || md[2] != k / kBlock)
    return ffi::Error::InvalidArgument("shapes of x, qs, d and m do not agree (K must be a multiple of 32)");
  const int64_t l = *layer.typed_data();
  if (l < 0 || l >= stack) return ffi::Error::InvalidArgument("layer index outside the stack");
  const int64_t nb = k / kBlock;
  auto job = std::make_shared<Job>();
  job->problem = Problem{x.typed_data(), qs.typed_data() + l * n * (k * bits / 8), d.typed_data() + l * n * nb,
                         m.typed_data() + l * n * nb, y->typed_data(), t, k, n, bits, offset};
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("offset"));
