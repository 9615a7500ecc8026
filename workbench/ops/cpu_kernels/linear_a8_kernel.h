// int4 x int8 decode linears: y[M, N] = x[M, K] @ W[N, K]^T with the activations quantized to 8 bits
// (torch-free core; the op is in linear_a8.cpp).
//
// The weights are the canonical int4 layout (qweight uint8 [N, K/2], per run of 32 weights byte j
// = weight j | weight j+16 << 4; fp16 scales d and offsets m per group: w = q * d + m). The
// activations are quantized here, per row and per block of 32, the way llama.cpp's Q8_1 does:
//     dx = max|x_block| / 127,  qx = round(x / dx) in [-127, 127],  sx = dx * sum(qx)
// so that one block's dot product is integer arithmetic plus two scalars:
//     sum_i w_i x_i  ~=  d * dx * sum_i q_i qx_i  +  m * sx
// The integer part is the ISA's byte dot product (iacc_dot: AVX512-VNNI vpdpbusd, AVX2 vpmaddubsw +
// vpmaddwd, NEON sdot or smull); the offset part is a short dot product of the row's offsets with
// the per-block sx. Against the fp32 kernel (codes to fp32, FMA with fp32 x) that is about 3x fewer
// instructions per weight.
//
// Numerics: the only change is the activation rounding (relative error <= 1/254 of the block's
// largest |x| per element, round to nearest even); everything after the integer sums is fp32 and
// the integer sums are exact, so every variant gives the same result up to fp32 summation order.
#pragma once
#include <algorithm>
#include <vector>

#include "linear_kernel.h"  // kPrefetchBytes
#include "vec.h"

namespace wb {

constexpr int kA8Tile = 4;  // rows of x per pass over W

struct QuantizedRows {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d;   // [M, K/32] block scales dx
  std::vector<float> s;   // [M, groups] sum over the group's blocks of dx * sum(qx)
};

// x [M, K] fp32 -> QuantizedRows (K a multiple of 32, group a multiple of 32 dividing K).
inline QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t group) {
  const int64_t blocks = K / 32, groups = K / group;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * groups, 0.f)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t qsum = 0;
      const float d = quantize_block(x + m * K + b * 32, r.q.data() + m * K + b * 32, qsum);
      r.d[m * blocks + b] = d;
      r.s[m * groups + (b * 32) / group] += d * static_cast<float>(qsum);
    }
  return r;
}

// ds[t * blocks + b] = d_w(row, b) * d_x(t, b): one multiply per block, outside the dot loop
WB_INLINE void block_scales(const fp16* srow, const float* xd, float* ds, int T, int64_t blocks, int64_t per_group) {
  for (int t = 0; t < T; ++t) {
    if (per_group == 1) {
      int64_t b = 0;
      for (; b + kL <= blocks; b += kL) vstore(ds + t * blocks + b, vload_half(srow + b) * vload(xd + t * blocks + b));
      for (; b < blocks; ++b) ds[t * blocks + b] = h2f(srow[b]) * xd[t * blocks + b];
    } else {
      for (int64_t b = 0; b < blocks; ++b) ds[t * blocks + b] = h2f(srow[b / per_group]) * xd[t * blocks + b];
    }
  }
}

// Block b of two rows of W (codes w0, w1) into their accumulators for the T rows of x: each x block
// is read once for both rows.
template <int T>
WB_INLINE void pair_block(IAcc (&a0)[T], IAcc (&a1)[T], ICodes w0, ICodes w1, const int8_t* xq, const float* ds0,
                          const float* ds1, int64_t K, int64_t blocks, int64_t b) {
  for (int t = 0; t < T; ++t) {
    a0[t] = iacc_dot(w0, xq + t * K + b * 32, ds0[t * blocks + b], a0[t]);
    a1[t] = iacc_dot(w1, xq + t * K + b * 32, ds1[t * blocks + b], a1[t]);
  }
}

// y[m0:m0+T, n] for rows n in [n0, n1): one pass over those rows of W, two rows at a time.
template <int T>
void a8_tile(const uint8_t* qw, const fp16* sc, const fp16* of, const QuantizedRows& xq, float* y, int64_t K,
             int64_t N, int64_t group, int64_t m0, int64_t n0, int64_t n1) {
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
    // the rows about kPrefetchBytes ahead, into L2 (as linear_kernel.h's rows_pass): two rows read
    // interleaved are followed worse by the hardware prefetchers than one row after another
    const int64_t ahead = std::max<int64_t>(2, kPrefetchBytes / K) & ~int64_t{1};
    for (int64_t o = 0; o < K; o += 64) prefetch_l2(qw + (n + ahead) * (K / 2) + o);
    block_scales(sc + n * groups, xd0, ds0, T, blocks, per_group);
    block_scales(sc + r1 * groups, xd0, ds1, T, blocks, per_group);
    // even / odd block accumulators per row: four independent FMA chains at T = 1
    IAcc e0[T], o0[T], e1[T], o1[T];
    for (int t = 0; t < T; ++t) e0[t] = o0[t] = e1[t] = o1[t] = iacc_zero();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      pair_block<T>(e0, e1, q4_codes(row0 + b * 16), q4_codes(row1 + b * 16), xq0, ds0, ds1, K, blocks, b);
      pair_block<T>(o0, o1, q4_codes(row0 + (b + 1) * 16), q4_codes(row1 + (b + 1) * 16), xq0, ds0, ds1, K, blocks,
                    b + 1);
    }
    if (b < blocks) pair_block<T>(e0, e1, q4_codes(row0 + b * 16), q4_codes(row1 + b * 16), xq0, ds0, ds1, K, blocks, b);
    // y = the integer part (the accumulators) + the offset part, sum_g offsets[row, g] * sx[m, g]
    for (int t = 0; t < T; ++t) {
      const int64_t m = m0 + t;
      const float* sx = xq.s.data() + m * groups;
      y[m * N + n] = iacc_sum(iacc_add(e0[t], o0[t])) + dot(of + n * groups, sx, groups);
      if (r1 != n) y[m * N + r1] = iacc_sum(iacc_add(e1[t], o1[t])) + dot(of + r1 * groups, sx, groups);
    }
  }
}

// y [M, N] for x [M, K] (M <= 16: decode steps), rows of W split over the threads
inline void linear_a8_rows(const uint8_t* qw, const fp16* sc, const fp16* of, const float* x, float* y, int64_t M,
                           int64_t K, int64_t N, int64_t group) {
  const QuantizedRows xq = quantize_rows(x, M, K, group);
  const int64_t grain = std::max<int64_t>(16, 8192 / std::max<int64_t>(1, K / 32));
  parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t b0 = n0; b0 < n1; b0 += 64) {
      const int64_t b1 = std::min(n1, b0 + 64);
      for (int64_t m0 = 0; m0 < M; m0 += kA8Tile) {
        switch (std::min<int64_t>(kA8Tile, M - m0)) {
          case 1: a8_tile<1>(qw, sc, of, xq, y, K, N, group, m0, b0, b1); break;
          case 2: a8_tile<2>(qw, sc, of, xq, y, K, N, group, m0, b0, b1); break;
          case 3: a8_tile<3>(qw, sc, of, xq, y, K, N, group, m0, b0, b1); break;
          default: a8_tile<4>(qw, sc, of, xq, y, K, N, group, m0, b0, b1); break;
        }
      }
    }
  });
}

}  // namespace wb
