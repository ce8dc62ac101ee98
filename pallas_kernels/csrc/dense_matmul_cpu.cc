// y = x @ W for a few rows of x and a float weight (float32, bfloat16 or float16), called by XLA
// through its FFI: the CPU path of jaxserve's float projections at decode and verify batch sizes.
//
// Why C++: XLA:CPU's float dot with 2-16 rows packs the weight before its GEMM, so it costs about
// twice the 1-row dot, and a speculative step verifying 4 tokens cost two plain steps. Here the
// weight is streamed once per call: a tile of output columns (or of weight rows, transposed) is
// read once, and every activation row's accumulators stay in registers over it.
//
// Layout, for a stack of L weights (a lone weight is a stack of one):
//   x     f32 [M, K]                        activations
//   w     f32|bf16|f16 [L, K, N]            transposed = 0: jaxserve's Linear kernel, [in, out]
//                      [L, N, K]            transposed = 1: a tied embedding used as the LM head
//   layer s32 []                            which weight of the stack: a scanned model's layer reads
//                                           its own weight in place (a slice would copy the stack)
//   y     f32 [M, N]
// Invariant: y[m, n] is summed in one fixed order that depends only on K (not on M, on how rows
// are grouped nor on the thread that computes it), so a row's result is bitwise the same whatever
// the row count: a speculative step's verified tokens equal the plain engine's.
//   transposed = 0: one FMA chain over k = 0 .. K-1 per output.
//   transposed = 1: 32 lane chains over k (chain j sums k = j mod 32), then one fixed reduction tree.
// Work items are column tiles (weight-row runs, transposed); the calling thread and helpers on
// XLA's intra-op pool claim them from an atomic counter and each writes only its own columns of y.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kVec = 16;             // floats in an AVX-512 register
constexpr int64_t kColVecs = 4;          // a column tile: 64 outputs, 4 accumulators per row
constexpr int64_t kRowGroup = 6;         // rows at once: 6 x 4 accumulators + 4 weight registers
constexpr int64_t kRowsPerItemT = 64;    // transposed: weight rows a work item claims
constexpr int64_t kChunkK = 8;           // weight rows swept together along the columns

enum class WType { kF32, kBF16, kF16 };

// One weight element as a float (the scalar path; exact for every type).
template <WType T>
inline float widen1(const void* w, int64_t i) {
  if constexpr (T == WType::kF32) {
    return static_cast<const float*>(w)[i];
  } else if constexpr (T == WType::kBF16) {
    const uint32_t bits = uint32_t(static_cast<const uint16_t*>(w)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
#if defined(__F16C__)
    return _cvtsh_ss(static_cast<const uint16_t*>(w)[i]);
#else
    const uint16_t h = static_cast<const uint16_t*>(w)[i];
    const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) {  // zero or subnormal: man * 2^-24
      float mag = float(man) * 5.9604644775390625e-8f;
      std::memcpy(&bits, &mag, sizeof bits);
    } else if (exp == 31) {
      bits = 0x7F800000u | (man << 13);
    } else {
      bits = ((exp + 112u) << 23) | (man << 13);
    }
    bits |= uint32_t(h & 0x8000) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
#endif
  }
}

#if defined(__AVX512F__)
// 16 weights from element i on (the lanes of `keep`; zeros elsewhere, nothing read there) as floats.
template <WType T>
inline __m512 load16(const void* w, int64_t i, __mmask16 keep) {
  if constexpr (T == WType::kF32) {
    return _mm512_maskz_loadu_ps(keep, static_cast<const float*>(w) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(keep, static_cast<const uint16_t*>(w) + i);
    if constexpr (T == WType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

inline __mmask16 lanes(int64_t left) { return left >= kVec ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }
#endif

struct Problem {
  const float* x;
  const void* w;  // this layer's weight
  float* y;
  int64_t m, k, n;
  int elem;       // bytes per weight element
  int64_t width;  // transposed = 0: columns a work item claims (a multiple of 16)
};

// transposed = 0: columns [c0, c1) of rows [r0, r0 + R) of y, for k in [k0, k0 + kc): XLA's own
// matrix-vector order. A chunk of kc weight rows is swept along the columns, so the weight is read
// as kc sequential streams (a 64-column tile down all K rows would jump a page per k); y holds
// the running sums between chunks (a float stored and reloaded is exact: the order is kept).
template <WType T, int R>
void column_chunk(const Problem& p, int64_t c0, int64_t c1, int64_t r0, int64_t k0, int64_t kc) {
#if defined(__AVX512F__)
  const float* x = p.x + r0 * p.k;
  for (int64_t n0 = c0; n0 < c1; n0 += kColVecs * kVec) {
    __mmask16 keep[kColVecs];
    for (int c = 0; c < kColVecs; ++c) keep[c] = n0 + c * kVec < c1 ? lanes(c1 - n0 - c * kVec) : __mmask16(0);
    __m512 acc[R][kColVecs];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kColVecs; ++c)
        acc[r][c] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep[c], p.y + (r0 + r) * p.n + n0 + c * kVec);
    for (int64_t k = k0; k < k0 + kc; ++k) {
      __m512 w[kColVecs];
      for (int c = 0; c < kColVecs; ++c) w[c] = load16<T>(p.w, k * p.n + n0 + c * kVec, keep[c]);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * p.k + k]);
        for (int c = 0; c < kColVecs; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kColVecs; ++c)
        _mm512_mask_storeu_ps(p.y + (r0 + r) * p.n + n0 + c * kVec, keep[c], acc[r][c]);
  }
#else
  for (int r = 0; r < R; ++r) {
    float* out = p.y + (r0 + r) * p.n;
    if (k0 == 0)
      for (int64_t j = c0; j < c1; ++j) out[j] = 0.f;
    for (int64_t k = k0; k < k0 + kc; ++k) {
      const float xv = p.x[(r0 + r) * p.k + k];
      for (int64_t j = c0; j < c1; ++j) out[j] += xv * widen1<T>(p.w, k * p.n + j);
    }
  }
#endif
}

// transposed = 1: output n of rows [r0, r0 + R) of y. The weight row is read once, in order (the
// rows of a work item follow each other: one sequential stream); each x row keeps two lane sets,
// the even and the odd 16-wide steps of k (two FMA chains), added and reduced at the end.
template <WType T, int R>
void weight_row(const Problem& p, int64_t n, int64_t r0) {
#if defined(__AVX512F__)
  const void* w = static_cast<const char*>(p.w) + n * p.k * p.elem;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const float* x = p.x + r0 * p.k;
  for (int64_t k = 0; k < p.k; k += 2 * kVec) {  // a step past K reads nothing and adds zeros
    const __mmask16 keep0 = lanes(p.k - k), keep1 = k + kVec < p.k ? lanes(p.k - k - kVec) : __mmask16(0);
    const __m512 w0 = load16<T>(w, k, keep0), w1 = load16<T>(w, k + kVec, keep1);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(keep0, x + r * p.k + k), w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(keep1, x + r * p.k + k + kVec), w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) p.y[(r0 + r) * p.n + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#else
  for (int r = 0; r < R; ++r) {
    const float* xr = p.x + (r0 + r) * p.k;
    float s = 0.f;
    for (int64_t k = 0; k < p.k; ++k) s += xr[k] * widen1<T>(p.w, n * p.k + k);
    p.y[(r0 + r) * p.n + n] = s;
  }
#endif
}

// All rows, in groups of kRowGroup (then one smaller group): the same per-row sums whatever the grouping.
template <WType T, typename F>
void by_row_groups(const Problem& p, F&& tile) {
  int64_t r0 = 0;
  for (; r0 + kRowGroup <= p.m; r0 += kRowGroup) tile(std::integral_constant<int, kRowGroup>{}, r0);
  switch (p.m - r0) {
    case 1: tile(std::integral_constant<int, 1>{}, r0); break;
    case 2: tile(std::integral_constant<int, 2>{}, r0); break;
    case 3: tile(std::integral_constant<int, 3>{}, r0); break;
    case 4: tile(std::integral_constant<int, 4>{}, r0); break;
    case 5: tile(std::integral_constant<int, 5>{}, r0); break;
    default: break;
  }
}

template <WType T>
void run_item(const Problem& p, bool transposed, int64_t item) {
  if (!transposed) {
    const int64_t c0 = item * p.width, c1 = std::min(c0 + p.width, p.n);
    for (int64_t k0 = 0; k0 < p.k; k0 += kChunkK) {
      const int64_t kc = std::min(kChunkK, p.k - k0);
      by_row_groups<T>(p, [&](auto r, int64_t r0) { column_chunk<T, decltype(r)::value>(p, c0, c1, r0, k0, kc); });
    }
    return;
  }
  const int64_t first = item * kRowsPerItemT, last = std::min(first + kRowsPerItemT, p.n);
  for (int64_t n = first; n < last; ++n)
    by_row_groups<T>(p, [&](auto r, int64_t r0) { weight_row<T, decltype(r)::value>(p, n, r0); });
}

struct Job {
  Problem problem;
  WType type = WType::kF32;
  bool transposed = false;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      switch (type) {
        case WType::kF32: run_item<WType::kF32>(problem, transposed, i); break;
        case WType::kBF16: run_item<WType::kBF16>(problem, transposed, i); break;
        case WType::kF16: run_item<WType::kF16>(problem, transposed, i); break;
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error DenseMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                       ffi::Result<ffi::Buffer<ffi::F32>> y, int32_t transposed) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || layer.dimensions().size() != 0)
    return ffi::Error::InvalidArgument("expected x [M, K], w [L, K, N] (or [L, N, K] transposed), layer []");
  const int64_t m = xd[0], k = xd[1], stack = wd[0];
  const int64_t n = transposed ? wd[1] : wd[2];
  if ((transposed ? wd[2] : wd[1]) != k) return ffi::Error::InvalidArgument("x and w disagree on K");
  Job proto;
  switch (w.element_type()) {
    case ffi::DataType::F32: proto.type = WType::kF32; break;
    case ffi::DataType::BF16: proto.type = WType::kBF16; break;
    case ffi::DataType::F16: proto.type = WType::kF16; break;
    default: return ffi::Error::InvalidArgument("w must be float32, bfloat16 or float16");
  }
  const int64_t l = *layer.typed_data();
  if (l < 0 || l >= stack) return ffi::Error::InvalidArgument("layer index outside the stack");
  if (m == 0 || n == 0) return ffi::Error::Success();
  const int elem = proto.type == WType::kF32 ? 4 : 2;
  auto job = std::make_shared<Job>();
  job->type = proto.type;
  job->transposed = transposed != 0;
  job->problem = Problem{x.typed_data(), static_cast<const char*>(w.untyped_data()) + l * n * k * elem,
                         y->typed_data(), m, k, n, elem, 0};
  // two column ranges a thread: long sequential sweeps, and a late thread still finds work
  const int64_t ranges = 2 * std::max<int64_t>(1, pool.num_threads());
  job->problem.width = std::max<int64_t>(kVec, (n + ranges * kVec - 1) / (ranges * kVec) * kVec);
  const int64_t per_item = job->transposed ? kRowsPerItemT : job->problem.width;
  job->items = (n + per_item - 1) / per_item;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDenseMatmulCpu, DenseMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("transposed"));
