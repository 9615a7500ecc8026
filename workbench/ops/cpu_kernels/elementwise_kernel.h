// The small per-token ops of a decode step, fp32 (torch-free core; the ops are in elementwise.cpp):
// RMSNorm, RoPE with explicit cos/sin, SiLU * mul.
#pragma once
#include <cmath>

#include "vec.h"

namespace wb {

// out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) for rows [r0, r1) of h values (h a multiple of kLanes)
inline void rmsnorm_rows(const float* x, const float* w, float* out, int64_t h, float eps, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * h;
    Vec acc = vzero();
    for (int64_t i = 0; i < h; i += kL) {
      const Vec v = vload(xr + i);
      acc = vfma(v, v, acc);
    }
    const Vec inv = vset1(1.f / std::sqrt(vsum(acc) / static_cast<float>(h) + eps));
    for (int64_t i = 0; i < h; i += kL) vstore(out + r * h + i, vload(w + i) * (vload(xr + i) * inv));
  }
}

// x * cos + rotate_half(x) * sin for one head vector of d values (rotate_half(x) = [-x2, x1])
inline void rotate(const float* x, const float* c, const float* s, float* o, int64_t d) {
  const int64_t half = d / 2;
  int64_t i = 0;
  for (; i + kL <= half; i += kL) {
    const Vec a = vload(x + i), b = vload(x + i + half);
    vstore(o + i, vfnma(b, vload(s + i), a * vload(c + i)));
    vstore(o + i + half, vfma(a, vload(s + i + half), b * vload(c + i + half)));
  }
  for (; i < half; ++i) {
    o[i] = x[i] * c[i] - x[i + half] * s[i];
    o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
  }
}

// out[r] = silu(x[r, :inner]) * x[r, inner:] for rows [r0, r1) (inner a multiple of kLanes)
inline void silu_and_mul_rows(const float* x, float* out, int64_t inner, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t i = 0; i < inner; i += kL)
      vstore(out + r * inner + i, silu(vload(x + r * 2 * inner + i)) * vload(x + r * 2 * inner + inner + i));
}

}  // namespace wb
