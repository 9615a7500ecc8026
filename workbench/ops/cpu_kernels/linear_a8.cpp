// int4 x int8 decode linears: y[M, N] = x[M, K] @ W[N, K]^T with the activations quantized to 8 bits.
//
// The weights are the canonical int4 layout (qweight uint8 [N, K/2], per run of 32 weights byte j
// = weight j | weight j+16 << 4; fp16 scales d and offsets m per group: w = q * d + m). The
// activations are quantized here, per row and per block of 32, the way llama.cpp's Q8_1 does:
//     dx = max|x_block| / 127,  qx = round(x / dx) in [-127, 127],  sx = dx * sum(qx)
// so that one block's dot product is integer arithmetic plus two scalars:
//     sum_i w_i x_i  ~=  d * dx * sum_i q_i qx_i  +  m * sx
// The integer part is one VNNI instruction per block (vpdpbusd: unsigned 4-bit codes x signed
// 8-bit activations, 32 products summed into 8 int32 lanes); the offset part is a short dot
// product of the row's offsets with the per-block sx. Against the fp32 kernel (decode each weight
// to fp32, FMA with fp32 x) that is about 3x fewer instructions per weight.
//
// Numerics: the only change is the activation rounding (relative error <= 1/254 of the block's
// largest |x| per element, round to nearest even); everything after the integer sums is fp32.
// This is an explicit choice of the caller (linear_weight_layout's `int4_activations: int8`).
//
// Inputs with more than kRows rows (prefill) are not quantized: they take cpu_int4_linear's exact
// path (weights decoded to fp32 tiles for BLAS), so a prompt is read exactly as the fp32 model would.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <optional>
#include <vector>

#define WB_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

namespace {

constexpr int64_t kRows = 16;  // decode-shaped inputs handled here (as cpu_int4_linear's kernel)
constexpr int kTile = 4;       // rows of x per pass over W

struct QuantizedRows {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K/32] block scales dx
  std::vector<float> s;    // [M, groups] sum over the group's blocks of dx * sum(qx)
};

// x [M, K] fp32 -> QuantizedRows (K multiple of 32, group a multiple of 32 dividing K).
WB_VNNI QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t group) {
  const int64_t blocks = K / 32, groups = K / group;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * groups, 0.f)};
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = x + m * K + b * 32;
      const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign_off), _mm512_and_ps(hi, sign_off)));
      const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
      int8_t* out = r.q.data() + m * K + b * 32;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qhi));
      r.d[m * blocks + b] = d;
      r.s[m * groups + (b * 32) / group] += d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
    }
  return r;
}

// sum_g offsets[g] * s[g] (fp16 offsets, fp32 s), vectorised 16 at a time.
WB_VNNI inline float offset_dot(const at::Half* o, const float* s, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 ov = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + i)));
    acc = _mm512_fmadd_ps(ov, _mm512_loadu_ps(s + i), acc);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 ov = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, o + i));
    acc = _mm512_fmadd_ps(ov, _mm512_maskz_loadu_ps(k, s + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

WB_VNNI __attribute__((always_inline)) inline __m256i codes(const uint8_t* row, int64_t b) {
  // the 32 codes of block b in x's order: weights j (low nibbles) then j + 16 (high nibbles)
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(bytes, low4)),
                                 _mm_and_si128(_mm_srli_epi16(bytes, 4), low4), 1);
}

// Block b of two rows of W (w0, w1) into their accumulators for the T rows of x: each x block is
// loaded once for both rows; ds0/ds1[t * blocks + b] = d_w * d_x, precomputed per row.
template <int T>
WB_VNNI __attribute__((always_inline)) inline void pair_block(__m256 (&a0)[T], __m256 (&a1)[T], __m256i w0, __m256i w1,
                                                               const int8_t* xq, const float* ds0, const float* ds1,
                                                               int64_t K, int64_t blocks, int64_t b) {
  for (int t = 0; t < T; ++t) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * K + b * 32));
    const __m256i i0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w0, xv);
    const __m256i i1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w1, xv);
    a0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(ds0 + t * blocks + b), a0[t]);
    a1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_broadcast_ss(ds1 + t * blocks + b), a1[t]);
  }
}

WB_VNNI inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// ds[t * blocks + b] = d_w(row, b) * d_x(t, b): one multiply per block, vectorised, outside the dot loop.
WB_VNNI inline void block_scales(const at::Half* srow, const float* xd, float* ds, int T, int64_t blocks,
                                 int64_t per_group) {
  if (per_group == 1) {
    for (int t = 0; t < T; ++t) {
      int64_t b = 0;
      for (; b + 16 <= blocks; b += 16)
        _mm512_storeu_ps(ds + t * blocks + b, _mm512_mul_ps(
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(srow + b))),
            _mm512_loadu_ps(xd + t * blocks + b)));
      for (; b < blocks; ++b) ds[t * blocks + b] = _cvtsh_ss(srow[b].x) * xd[t * blocks + b];
    }
    return;
  }
  for (int t = 0; t < T; ++t)
    for (int64_t b = 0; b < blocks; ++b) ds[t * blocks + b] = _cvtsh_ss(srow[b / per_group].x) * xd[t * blocks + b];
}

// y[m0:m0+T, n] for rows n in [n0, n1): one pass over those rows of W, two rows at a time.
template <int T>
WB_VNNI void tile(const uint8_t* qw, const at::Half* sc, const at::Half* of, const QuantizedRows& xq, float* y,
                  int64_t K, int64_t N, int64_t group, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t blocks = K / 32, groups = K / group, per_group = group / 32;
  const int8_t* xq0 = xq.q.data() + m0 * K;
  const float* xd0 = xq.d.data() + m0 * blocks;
  std::vector<float> scales(2 * T * blocks);
  float* ds0 = scales.data();
  float* ds1 = ds0 + T * blocks;
  for (int64_t n = n0; n < n1; n += 2) {
    const int64_t r1 = std::min(n + 1, n1 - 1);  // an odd last row is computed twice, stored once
    const uint8_t* row0 = qw + n * (K / 2);
    const uint8_t* row1 = qw + r1 * (K / 2);
    block_scales(sc + n * groups, xd0, ds0, T, blocks, per_group);
    block_scales(sc + r1 * groups, xd0, ds1, T, blocks, per_group);
    // even / odd block accumulators per row: four independent FMA chains at T = 1
    __m256 e0[T], o0[T], e1[T], o1[T];
    for (int t = 0; t < T; ++t) e0[t] = o0[t] = e1[t] = o1[t] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      pair_block<T>(e0, e1, codes(row0, b), codes(row1, b), xq0, ds0, ds1, K, blocks, b);
      pair_block<T>(o0, o1, codes(row0, b + 1), codes(row1, b + 1), xq0, ds0, ds1, K, blocks, b + 1);
    }
    if (b < blocks) pair_block<T>(e0, e1, codes(row0, b), codes(row1, b), xq0, ds0, ds1, K, blocks, b);
    for (int t = 0; t < T; ++t) {
      const int64_t m = m0 + t;
      const float* sx = xq.s.data() + m * groups;
      y[m * N + n] = hsum(_mm256_add_ps(e0[t], o0[t])) + offset_dot(of + n * groups, sx, groups);
      if (r1 != n) y[m * N + r1] = hsum(_mm256_add_ps(e1[t], o1[t])) + offset_dot(of + r1 * groups, sx, groups);
    }
  }
}

WB_VNNI void run_rows(const uint8_t* qw, const at::Half* sc, const at::Half* of, const QuantizedRows& xq, float* y,
                      int64_t M, int64_t K, int64_t N, int64_t group, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += kTile) {
    switch (std::min<int64_t>(kTile, M - m0)) {
      case 1: tile<1>(qw, sc, of, xq, y, K, N, group, m0, n0, n1); break;
      case 2: tile<2>(qw, sc, of, xq, y, K, N, group, m0, n0, n1); break;
      case 3: tile<3>(qw, sc, of, xq, y, K, N, group, m0, n0, n1); break;
      default: tile<4>(qw, sc, of, xq, y, K, N, group, m0, n0, n1); break;
    }
  }
}

bool has_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  return ok;
}

at::Tensor cpu_int4_linear_a8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const at::Tensor& offsets, int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "cpu_int4_linear_a8 takes float32 activations, got ", x.scalar_type());
  const int64_t K = x.size(-1), rows = x.numel() / std::max<int64_t>(1, K);
  if (rows > kRows || !has_vnni()) {
    // prefill (exact path) or a CPU without VNNI: the exact int4 kernel, through the dispatcher
    static auto exact = c10::Dispatcher::singleton().findSchemaOrThrow("workbench::cpu_int4_linear", "")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, int64_t, const std::optional<at::Tensor>&)>();
    return exact.call(x, qweight, scales, offsets, group_size, bias);
  }
  const int64_t N = qweight.size(0);
  TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.size(1) * 2 == K &&
              qweight.is_contiguous(), "int4 qweight must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && offsets.scalar_type() == at::kHalf && scales.is_contiguous() &&
              offsets.is_contiguous() && scales.dim() == 2 && offsets.sizes() == scales.sizes() &&
              scales.size(0) == N && scales.size(1) == K / group_size,
              "int4 scales/offsets must be contiguous float16 [N, K/group] = [", N, ", ", K / group_size, "], got ",
              scales.sizes());
  const at::Tensor x2 = x.reshape({rows, K}).contiguous();
  const QuantizedRows xq = quantize_rows(x2.data_ptr<float>(), rows, K, group_size);
  at::Tensor y = at::empty({rows, N}, x2.options());
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  const at::Half* of = offsets.data_ptr<at::Half>();
  float* out = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(16, 8192 / std::max<int64_t>(1, K / 32));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t b = n0; b < n1; b += 64) run_rows(qw, sc, of, xq, out, rows, K, N, group_size, b, std::min(n1, b + 64));
  });
  if (bias.has_value()) y.add_(*bias);
  auto s = x.sizes().vec();
  s.back() = N;
  return y.view(s);
}

}  // namespace

TORCH_LIBRARY_IMPL(workbench, CPU, m) {
  m.impl("cpu_int4_linear_a8", &cpu_int4_linear_a8);
}
