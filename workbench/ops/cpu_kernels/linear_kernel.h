// Decode-shaped linears: y[M, N] = x[M, K] @ W[N, K]^T with W kept as stored (torch-free core;
// the ops and their checks are in linear.cpp).
//
// Three weight formats, one loop: the kernel walks W once per tile of up to 8 rows of x (and up to
// four rows of W at a time), turning each block of 32 codes into 32 / kLanes float vectors,
// multiplying them by x and scaling each block's sum once (rows_pass). Memory traffic is the weight
// bytes (4.5-5 bits per weight for int4), so a batch-1 decode step streams the 4-bit model instead
// of a 32-bit copy of it.
//
//   int4 (Q4):  qweight uint8 [N, K/2], scales/offsets fp16 [N, K/group]; per run of 32 weights
//               byte j holds weight j (low nibble) and weight j+16 (high nibble) -- ggml's Q4_1
//               order; w = q * scale + offset.
//   int8 (Q8):  qweight int8 [N, K], scales fp16 [N, K/group]; w = q * scale (ggml's Q8_0).
//   fp32 (F32): W float [N, K].
#pragma once
#include <algorithm>
#include <vector>

#include "vec.h"

namespace wb {

constexpr int kMaxTile = 8;  // rows of x per pass over W (accumulators live in registers)

// A weight format gives, per row n and block b of 32 weights, the 32 codes as floats (codes(): q
// for the packed formats, the weights themselves for fp32) and, for the packed formats, the block's
// scale. The tile multiplies codes by x, scales the block's sum once and adds the offsets' share at
// the end:
//     sum_k w_k x_k = sum_b d_b * (sum_{k in b} q_k x_k) + sum_g m_g * (sum_{k in g} x_k)
// so per 32 weights a pass issues the conversions and one FMA per vector plus one for the scale,
// where decoding each weight (q * d + m) first cost two per vector.
// Rows of W interleaved per pass at one row of x: independent FMA chains, and more rows per load of
// x. Measured (an ad-hoc loop over SmolLM2's 120 int4 linear shapes, one thread, the Xeon of
// docs/benchmarks.md, best of 5): AVX2 2 -> 4 -> 8 rows 9.28 -> 8.97 -> 8.43 ms; AVX-512 4 -> 8
// rows 6.40 -> 6.46 ms.
constexpr int kPackedRowsPerPass = kL >= 16 ? 4 : 8;

struct Q4 {
  static constexpr bool kScaled = true, kOffsets = true;
  static constexpr int kRowsPerPass = kPackedRowsPerPass;
  const uint8_t* q; const fp16* s; const fp16* o; int64_t K, groups, group;
  WB_INLINE void codes(int64_t n, int64_t b, Vec* out) const { q4_block(q + n * (K / 2) + b * 16, out); }
  const fp16* scales(int64_t n) const { return s + n * groups; }
  const fp16* offsets(int64_t n) const { return o + n * groups; }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(q + n * (K / 2)); }
  int64_t row_bytes() const { return K / 2; }
};

struct Q8 {
  static constexpr bool kScaled = true, kOffsets = false;
  static constexpr int kRowsPerPass = kPackedRowsPerPass;
  const int8_t* q; const fp16* s; int64_t K, groups, group;
  WB_INLINE void codes(int64_t n, int64_t b, Vec* out) const { q8_block(q + n * K + b * 32, out); }
  const fp16* scales(int64_t n) const { return s + n * groups; }
  const fp16* offsets(int64_t) const { return nullptr; }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(q + n * K); }
  int64_t row_bytes() const { return K; }
};

struct F32 {
  static constexpr bool kScaled = false, kOffsets = false;
  // one row at a time: fp32 rows are memory-bound streams (2.3 KB at K = 576), which interleaving
  // four of them made 33 % slower (smollm2's fp32 layers at bs 1, AVX-512: 10.7 -> 14.2 ms)
  static constexpr int kRowsPerPass = 1;
  const float* w; int64_t K, groups, group;  // one group of K: no scales
  WB_INLINE void codes(int64_t n, int64_t b, Vec* out) const {
    for (int v = 0; v < kBlockVecs; ++v) out[v] = vload(w + n * K + b * 32 + v * kL);
  }
  const fp16* scales(int64_t) const { return nullptr; }
  const fp16* offsets(int64_t) const { return nullptr; }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(w + n * K); }
  int64_t row_bytes() const { return K * 4; }
};

// How far ahead weights are prefetched, into L2: far enough that DRAM's latency is covered while a
// compute-bound pass runs (A/B in one machine's alternated runs, SmolLM2 Q4_1 decode, AVX2 build:
// 4.6 KB ahead into L1 -> 18 KB into L2 +2 to +10 %, 37 KB no better than 18).
constexpr int64_t kPrefetchBytes = 16384;
constexpr int64_t kChunk = 64;          // groups whose scales and offsets are widened to fp32 at a time

// y[m0:m0+T, n..n+R) for R rows of W from n: one pass over those rows. Several rows at once keep
// independent FMA chains in flight and share each load of x; a row of K = 576 is only 18 blocks,
// so the per-row work around the loop (widening scales, reductions) is kept small.
// xsum: sum of x over each group, [M, groups] (the offsets' share).
template <int T, int R, class W>
WB_INLINE void rows_pass(const W& wt, const float* x, const float* xsum, float* y, int64_t K, int64_t N, int64_t m0,
                         int64_t n) {
  const int64_t blocks = K / 32, per_group = wt.group / 32;
  // scaled formats: one accumulator per (row, x row); fp32: two, alternating over the block's vectors
  constexpr int kAcc = W::kScaled ? 1 : 2;
  Vec acc[R][T][kAcc], off[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      off[r][t] = vzero();
      for (int a = 0; a < kAcc; ++a) acc[r][t][a] = vzero();
    }
  // The R rows are read interleaved, which the hardware prefetchers follow worse than one row after
  // another (a 28 MB int8 LM head streamed at half the speed): the rows about kPrefetchBytes ahead
  // are prefetched explicitly, a few cache lines per block.
  const int64_t span = R * wt.row_bytes(), step = ((span / blocks + 63) / 64) * 64;
  const char* ahead = wt.row(n + std::max<int64_t>(2, kPrefetchBytes / span) * R);
  // one block of 32 weights of every row, its scale (packed formats) from d(r)
  auto block = [&](int64_t b, auto d) __attribute__((always_inline)) {
    if constexpr (R > 1)
      for (int64_t o = b * step, e = std::min(span, o + step); o < e; o += 64) prefetch_l2(ahead + o);
    Vec xv[T][kBlockVecs];
    for (int t = 0; t < T; ++t)
      for (int v = 0; v < kBlockVecs; ++v) xv[t][v] = vload(x + (m0 + t) * K + b * 32 + v * kL);
    for (int r = 0; r < R; ++r) {
      Vec c[kBlockVecs];
      wt.codes(n + r, b, c);
      for (int t = 0; t < T; ++t) {
        if constexpr (W::kScaled) {
          Vec part = c[0] * xv[t][0];
          for (int v = 1; v < kBlockVecs; ++v) part = vfma(c[v], xv[t][v], part);
          acc[r][t][0] = vfma(part, vset1(d(r)), acc[r][t][0]);
        } else {
          for (int v = 0; v < kBlockVecs; ++v) acc[r][t][v % kAcc] = vfma(c[v], xv[t][v], acc[r][t][v % kAcc]);
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
          for (int t = 0; t < T; ++t) {
            const float* xs = xsum + (m0 + t) * wt.groups + g0;
            int64_t i = 0;
            for (; i + kL <= G; i += kL) off[r][t] = vfma(vload(m + i), vload(xs + i), off[r][t]);
            if (i < G) off[r][t] = vfma(vload_part(m + i, G - i), vload_part(xs + i, G - i), off[r][t]);
          }
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
    for (int t = 0; t < T; ++t) {
      Vec s = acc[r][t][0] + off[r][t];
      for (int a = 1; a < kAcc; ++a) s = s + acc[r][t][a];
      y[(m0 + t) * N + n + r] = vsum(s);
    }
}

// y[m0:m0+T, n] for rows n in [n0, n1): kRowsPerPass rows of W per pass at T = 1 (8, 4, ...), two at
// T <= 3, one above (the accumulators and x's vectors must stay in registers).
template <int T, class W>
void tile(const W& wt, const float* x, const float* xsum, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
          int64_t n1) {
  int64_t n = n0;
  if constexpr (T == 1 && W::kRowsPerPass >= 8)
    for (; n + 8 <= n1; n += 8) rows_pass<T, 8>(wt, x, xsum, y, K, N, m0, n);
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

// y [M, N] = x [M, K] @ W^T: rows of W split over the threads. Rows per task: enough work to
// amortise a thread hand-off (~a few us), in blocks of 64 so that for M > 8 a block's weights stay
// in L2 across the passes over x's row tiles.
template <class W>
void linear_rows(const W& wt, const float* x, float* y, int64_t M, int64_t K, int64_t N) {
  std::vector<float> xsum;  // [M, groups]: sum of x over each group (the offsets' share)
  if constexpr (W::kOffsets) {
    xsum.assign(M * wt.groups, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < wt.groups; ++g)
        for (int64_t k = g * wt.group; k < (g + 1) * wt.group; ++k) xsum[m * wt.groups + g] += x[m * K + k];
  }
  const int64_t grain = std::max<int64_t>(16, 8192 / std::max<int64_t>(1, K / 32));
  parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t b = n0; b < n1; b += 64) run_rows(wt, x, xsum.data(), y, M, K, N, b, std::min(n1, b + 64));
  });
}

// The weights of rows [n0, n0 + rows) as floats (q * d + m) into out [rows, K]: what the BLAS path
// of prefill-sized inputs multiplies.
template <class W>
void decode_rows(const W& wt, int64_t n0, int64_t rows, float* out) {
  const int64_t K = wt.K, blocks = K / 32;
  parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        Vec c[kBlockVecs];
        wt.codes(n0 + r, b, c);
        if constexpr (W::kScaled) {
          const int64_t g = b * 32 / wt.group;
          const Vec d = vset1(h2f(wt.scales(n0 + r)[g]));
          const Vec m = vset1(W::kOffsets ? h2f(wt.offsets(n0 + r)[g]) : 0.f);
          for (int v = 0; v < kBlockVecs; ++v) c[v] = W::kOffsets ? vfma(c[v], d, m) : c[v] * d;
        }
        for (int v = 0; v < kBlockVecs; ++v) vstore(out + r * K + b * 32 + v * kL, c[v]);
      }
  });
}

}  // namespace wb
