// CPU kernels for decode-shaped linears: y[M, N] = x[M, K] @ W[N, K]^T with W kept as stored.
//
// Three weight formats, one loop: the kernel walks W once per tile of up to 8 rows of x (and up to
// four rows of W at a time), turning 32 codes at a time into two 16-lane float vectors, multiplying
// them by x and scaling each block's sum once (see rows_pass). Memory traffic is the weight bytes (4.5-5 bits per weight for int4),
// so a batch-1 decode step streams the 4-bit model instead of a 32-bit copy of it.
//
//   int4 (q4):  qweight uint8 [N, K/2], scales/offsets fp16 [N, K/group]; per run of 32 weights
//               byte j holds weight j (low nibble) and weight j+16 (high nibble) -- ggml's Q4_1
//               order; w = q * scale + offset.
//   int8 (q8):  qweight int8 [N, K], scales fp16 [N, K/group]; w = q * scale (ggml's Q8_0).
//   fp32:       W float [N, K].
//
// Rows of W are split over torch's intra-op threads (at::parallel_for). AVX-512F is required
// (checked by the Python loader before it builds this file: without it the backend is unavailable).
// Schemas are declared in Python (workbench/ops/cpu_kernels/__init__.py); this file only implements them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <optional>
#include <vector>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>

#include "vec_math.h"

namespace {

constexpr int kMaxTile = 8;  // rows of x per pass over W (accumulators live in registers)

inline float h2f(const at::Half h) { return static_cast<float>(h); }

// A weight format gives, per row n and block b of 32 weights, the 32 codes as two 16-lane float
// vectors (codes(): q for the packed formats, the weights themselves for fp32) and, for the packed
// formats, the block's scale. The tile multiplies codes by x, scales the block's sum once and adds
// the offsets' share at the end:
//     sum_k w_k x_k = sum_b d_b * (sum_{k in b} q_k x_k) + sum_g m_g * (sum_{k in g} x_k)
// so per 32 weights a pass issues two conversions and three FMAs, where decoding each weight
// (q * d + m) first cost four FMAs.
struct Q4 {
  static constexpr bool kScaled = true, kOffsets = true;
  static constexpr int kRowsPerPass = 4;  // at one row of x (see tile)
  const uint8_t* q; const at::Half* s; const at::Half* o; int64_t K, groups, group;
  inline void codes(int64_t n, int64_t b, __m512& lo, __m512& hi) const {
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + b * 16)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
  }
  const at::Half* scales(int64_t n) const { return s + n * groups; }
  const at::Half* offsets(int64_t n) const { return o + n * groups; }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(q + n * (K / 2)); }
  int64_t row_bytes() const { return K / 2; }
};

struct Q8 {
  static constexpr bool kScaled = true, kOffsets = false;
  static constexpr int kRowsPerPass = 4;
  const int8_t* q; const at::Half* s; int64_t K, groups, group;
  inline void codes(int64_t n, int64_t b, __m512& lo, __m512& hi) const {
    const int8_t* p = q + n * K + b * 32;
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
  const at::Half* scales(int64_t n) const { return s + n * groups; }
  const at::Half* offsets(int64_t) const { return nullptr; }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(q + n * K); }
  int64_t row_bytes() const { return K; }
};

struct F32 {
  static constexpr bool kScaled = false, kOffsets = false;
  // one row at a time: fp32 rows are memory-bound streams (2.3 KB at K = 576), which interleaving
  // four of them made 33 % slower (smollm2's fp32 layers at bs 1: 10.7 -> 14.2 ms)
  static constexpr int kRowsPerPass = 1;
  const float* w; int64_t K, groups, group;  // one group of K: no scales
  inline void codes(int64_t n, int64_t b, __m512& lo, __m512& hi) const {
    const float* p = w + n * K + b * 32;
    lo = _mm512_loadu_ps(p);
    hi = _mm512_loadu_ps(p + 16);
  }
  const at::Half* scales(int64_t) const { return nullptr; }
  const at::Half* offsets(int64_t) const { return nullptr; }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(w + n * K); }
  int64_t row_bytes() const { return K * 4; }
};

constexpr int64_t kPrefetchPasses = 2;  // how far ahead (in passes of R rows) weights are prefetched
constexpr int64_t kChunk = 64;  // groups whose scales and offsets are widened to fp32 at a time

// fp16 [G] -> float [G], 16 at a time (the tail masked)
WB_INLINE void widen(const at::Half* h, float* out, int64_t G) {
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 k = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
    _mm512_mask_storeu_ps(out + g, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, h + g)));
  }
}

// sum_g a[g] * b[g] over G values, as a 16-lane partial sum added into acc
WB_INLINE __m512 dot_into(const float* a, const float* b, int64_t G, __m512 acc) {
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 k = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + g), _mm512_maskz_loadu_ps(k, b + g), acc);
  }
  return acc;
}

// y[m0:m0+T, n..n+R) for R rows of W from n: one pass over those rows. Several rows at once keep
// independent FMA chains in flight (one chain waits on the FMA's 4-cycle latency every block) and
// share each load of x; a row of K = 576 is only 18 blocks, so the per-row work around the loop
// (widening scales, reductions) is kept to a few vector instructions per 16 groups.
// xsum: sum of x over each group, [M, groups] (the offsets' share).
template <int T, int R, class W>
WB_INLINE void rows_pass(const W& wt, const float* x, const float* xsum, float* y, int64_t K, int64_t N, int64_t m0,
                         int64_t n) {
  const int64_t blocks = K / 32, per_group = wt.group / 32;
  __m512 acc[R][T][2], off[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t][0] = acc[r][t][1] = off[r][t] = _mm512_setzero_ps();
  // The R rows are read interleaved, which the hardware prefetchers follow worse than one row after
  // another (a 28 MB int8 LM head streamed at half the speed): the rows kPrefetchPasses passes ahead
  // are prefetched explicitly, a few cache lines per block.
  const char* ahead = wt.row(n + kPrefetchPasses * R);
  const int64_t span = R * wt.row_bytes(), step = ((span / blocks + 63) / 64) * 64;
  // one block of 32 weights of every row, its scale (packed formats) from d(r)
  auto block = [&](int64_t b, auto d) __attribute__((always_inline)) {
    if constexpr (R > 1)
      for (int64_t o = b * step, e = std::min(span, o + step); o < e; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) wt.codes(n + r, b, lo[r], hi[r]);
    for (int t = 0; t < T; ++t) {
      const float* xr = x + (m0 + t) * K + b * 32;
      const __m512 xl = _mm512_loadu_ps(xr), xh = _mm512_loadu_ps(xr + 16);
      for (int r = 0; r < R; ++r) {
        if constexpr (W::kScaled) {
          const __m512 part = _mm512_fmadd_ps(lo[r], xl, _mm512_mul_ps(hi[r], xh));
          acc[r][t][0] = _mm512_fmadd_ps(part, _mm512_set1_ps(d(r)), acc[r][t][0]);
        } else {
          acc[r][t][0] = _mm512_fmadd_ps(lo[r], xl, acc[r][t][0]);
          acc[r][t][1] = _mm512_fmadd_ps(hi[r], xh, acc[r][t][1]);
        }
      }
    }
  };
  if constexpr (!W::kScaled) {
    for (int64_t b = 0; b < blocks; ++b) block(b, [](int) { return 1.f; });
  } else {
    for (int64_t g0 = 0; g0 < wt.groups; g0 += kChunk) {
      const int64_t G = std::min(kChunk, wt.groups - g0);
      alignas(64) float d[R][kChunk];
      for (int r = 0; r < R; ++r) widen(wt.scales(n + r) + g0, d[r], G);
      if constexpr (W::kOffsets) {
        alignas(64) float m[kChunk];
        for (int r = 0; r < R; ++r) {
          widen(wt.offsets(n + r) + g0, m, G);
          for (int t = 0; t < T; ++t) off[r][t] = dot_into(m, xsum + (m0 + t) * wt.groups + g0, G, off[r][t]);
        }
      }
      if (per_group == 1) {  // group = 32 (Q4_1, Q8_0): a scale per block, no index arithmetic
        for (int64_t j = 0; j < G; ++j) block(g0 + j, [&](int r) { return d[r][j]; });
      } else {
        for (int64_t j = 0; j < G; ++j)
          for (int64_t b = (g0 + j) * per_group, e = b + per_group; b < e; ++b) block(b, [&](int r) { return d[r][j]; });
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      y[(m0 + t) * N + n + r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][t][0], acc[r][t][1]), off[r][t]));
}

// y[m0:m0+T, n] for rows n in [n0, n1): four rows of W per pass at T = 1, two at T <= 3, one above
// (the accumulators, 2*R*T, must stay in registers).
template <int T, class W>
void tile(const W& wt, const float* x, const float* xsum, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
          int64_t n1) {
  int64_t n = n0;
  if constexpr (T == 1 && W::kRowsPerPass >= 4)
    for (; n + 4 <= n1; n += 4) rows_pass<T, 4>(wt, x, xsum, y, K, N, m0, n);
  if constexpr (T <= 3 && W::kRowsPerPass >= 2)
    for (; n + 2 <= n1; n += 2) rows_pass<T, 2>(wt, x, xsum, y, K, N, m0, n);
  for (; n < n1; ++n) rows_pass<T, 1>(wt, x, xsum, y, K, N, m0, n);
}

template <class W>
void run_rows(const W& wt, const float* x, const float* xsum, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
              int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
    switch (std::min<int64_t>(kMaxTile, M - m0)) {
      case 1: tile<1>(wt, x, xsum, y, K, N, m0, n0, n1); break;
      case 2: tile<2>(wt, x, xsum, y, K, N, m0, n0, n1); break;
      case 3: tile<3>(wt, x, xsum, y, K, N, m0, n0, n1); break;
      case 4: tile<4>(wt, x, xsum, y, K, N, m0, n0, n1); break;
      case 5: tile<5>(wt, x, xsum, y, K, N, m0, n0, n1); break;
      case 6: tile<6>(wt, x, xsum, y, K, N, m0, n0, n1); break;
      case 7: tile<7>(wt, x, xsum, y, K, N, m0, n0, n1); break;
      default: tile<8>(wt, x, xsum, y, K, N, m0, n0, n1); break;
    }
  }
}

// Rows of W per task: enough work to amortise a thread hand-off (~a few us), and row blocks of
// 64 so that for M > 8 a block's weights stay in L2 across the passes over x's row tiles.
template <class W>
at::Tensor launch(const W& wt, const at::Tensor& x2, int64_t N) {
  const int64_t M = x2.size(0), K = x2.size(1);
  at::Tensor y = at::empty({M, N}, x2.options());
  const float* x = x2.data_ptr<float>();
  float* out = y.data_ptr<float>();
  std::vector<float> xsum;  // [M, groups]: sum of x over each group (the offsets' share)
  if constexpr (W::kOffsets) {
    xsum.assign(M * wt.groups, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < wt.groups; ++g)
        for (int64_t k = g * wt.group; k < (g + 1) * wt.group; ++k) xsum[m * wt.groups + g] += x[m * K + k];
  }
  const int64_t grain = std::max<int64_t>(16, 8192 / std::max<int64_t>(1, K / 32));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t b = n0; b < n1; b += 64) run_rows(wt, x, xsum.data(), out, M, K, N, b, std::min(n1, b + 64));
  });
  return y;
}

at::Tensor flat(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "workbench CPU kernels take float32 activations, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) % 32 == 0, "in_features must be a multiple of 32, got ", x.size(-1));
  return x.reshape({-1, x.size(-1)}).contiguous();
}

at::Tensor finish(at::Tensor y, const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias) {
  if (bias.has_value()) y.add_(*bias);
  auto s = x.sizes().vec();
  s.back() = N;
  return y.view(s);
}

// Prefill-sized inputs (many rows of x): the weights are decoded 256 rows at a time into a float
// tile and multiplied by BLAS, which beats re-walking the packed rows once per 8 rows of x -- for
// fp32 weights above 16 rows, for the packed formats only above 96: decoding int4/int8 into a tile
// and the per-tile GEMM calls cost more than re-decoding per 8 rows until then (int4 1536x576,
// single thread: 32 rows 676 us dense vs ~400 us by tiles; 128 rows 1559 vs ~1590).
constexpr int64_t kKernelRows = 16;
constexpr int64_t kQuantKernelRows = 96;

// The 32 weights of block b of row n as floats (q * d + m): what the BLAS path multiplies.
template <class W>
inline void decode(const W& wt, int64_t n, int64_t b, __m512& lo, __m512& hi) {
  wt.codes(n, b, lo, hi);
  if constexpr (W::kScaled) {
    const int64_t g = b * 32 / wt.group;
    const __m512 d = _mm512_set1_ps(h2f(wt.scales(n)[g]));
    if constexpr (W::kOffsets) {
      const __m512 m = _mm512_set1_ps(h2f(wt.offsets(n)[g]));
      lo = _mm512_fmadd_ps(lo, d, m);
      hi = _mm512_fmadd_ps(hi, d, m);
    } else {
      lo = _mm512_mul_ps(lo, d);
      hi = _mm512_mul_ps(hi, d);
    }
  }
}

template <class W>
at::Tensor dense(const W& wt, const at::Tensor& x2, int64_t N) {
  const int64_t K = x2.size(1), blocks = K / 32;
  at::Tensor y = at::empty({x2.size(0), N}, x2.options());
  at::Tensor tile_w = at::empty({std::min<int64_t>(256, N), K}, x2.options());
  for (int64_t n0 = 0; n0 < N; n0 += 256) {
    const int64_t rows = std::min<int64_t>(256, N - n0);
    float* t = tile_w.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
          __m512 lo, hi;
          decode(wt, n0 + r, b, lo, hi);
          _mm512_storeu_ps(t + r * K + b * 32, lo);
          _mm512_storeu_ps(t + r * K + b * 32 + 16, hi);
        }
    });
    y.narrow(1, n0, rows).copy_(at::mm(x2, tile_w.narrow(0, 0, rows).t()));
  }
  return y;
}

template <class W>
at::Tensor linear(const W& wt, const at::Tensor& x2, int64_t N) {
  return x2.size(0) > kQuantKernelRows ? dense(wt, x2, N) : launch(wt, x2, N);
}

at::Tensor cpu_int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& offsets, int64_t group_size, const std::optional<at::Tensor>& bias) {
  const at::Tensor x2 = flat(x);
  const int64_t K = x2.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.size(1) * 2 == K && qweight.is_contiguous(),
              "int4 qweight must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && offsets.scalar_type() == at::kHalf && scales.is_contiguous() &&
              offsets.is_contiguous(), "int4 scales/offsets must be contiguous float16 [N, K/group]");
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.dim() == 2 && offsets.sizes() == scales.sizes() && scales.size(0) == N &&
              scales.size(1) == K / group_size, "int4 scales/offsets must be [N, K/group] = [", N, ", ",
              K / group_size, "], got ", scales.sizes());
  Q4 wt{qweight.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(), K, K / group_size,
        group_size};
  return finish(linear(wt, x2, N), x, N, bias);
}

at::Tensor cpu_int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           int64_t group_size, const std::optional<at::Tensor>& bias) {
  const at::Tensor x2 = flat(x);
  const int64_t K = x2.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.size(1) == K && qweight.is_contiguous(),
              "int8 qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "int8 scales must be contiguous float16");
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group_size,
              "int8 scales must be [N, K/group] = [", N, ", ", K / group_size, "], got ", scales.sizes());
  Q8 wt{qweight.data_ptr<int8_t>(), scales.data_ptr<at::Half>(), K, K / group_size, group_size};
  return finish(linear(wt, x2, N), x, N, bias);
}

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const bool ok = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  x.size(-1) % 32 == 0;
  if (!ok || x.numel() / x.size(-1) > kKernelRows) return at::linear(x, weight, bias);
  const at::Tensor x2 = flat(x);
  const int64_t N = weight.size(0);
  F32 wt{weight.data_ptr<float>(), x2.size(1), 1, x2.size(1)};
  return finish(launch(wt, x2, N), x, N, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(workbench, CPU, m) {
  m.impl("cpu_int4_linear", &cpu_int4_linear);
  m.impl("cpu_int8_linear", &cpu_int8_linear);
  m.impl("cpu_linear", &cpu_linear);
}
