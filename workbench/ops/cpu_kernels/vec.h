// The one vector layer the CPU kernels are written against, and the math built on it.
//
// The kernels (linear_kernel.h, linear_a8_kernel.h, attention_kernel.h, elementwise_kernel.h) use
// only what this file and one ISA header give; the build picks the header by a macro, one build per
// variant (workbench/ops/cpu_kernels/isa.py lists them and their compiler flags):
//
//     WB_ISA_AVX512   simd/avx512.h   16 lanes   x86-64 AVX-512 F/BW/VL/DQ (+ VNNI: avx512_vnni build)
//     WB_ISA_AVX2     simd/avx2.h      8 lanes   x86-64 AVX2 + FMA + F16C
//     WB_ISA_NEON     simd/neon.h      4 lanes   ARM64 NEON (+ dotprod: neon_dotprod build)
//
// Every ISA header defines, in namespace wb (the parts all or both x86 ISAs spell alike by way of
// simd/common.h and simd/x86.h):
//   struct Vec { static constexpr int kLanes; <native> v; }       kLanes floats
//   vzero vset1 vload vstore vload_part vstore_part (the first n lanes; the rest read as 0)
//   + - * / vmax vfma(a,b,c)=a*b+c vfnma(a,b,c)=c-a*b vabs vsum vmaxall vround (nearest even)
//   vmul_pow2(a, n) = a * 2^n (n integral, -126..127)   vselect_neg(x, a, b) = x < 0 ? a : b
//   vload_half vload_half_part h2f       fp16 (raw bits) -> fp32
//   vtranspose_sum(a[kLanes])            lane i = the sum of a[i]'s lanes
//   q4_block(16 bytes, Vec[32/kLanes])   a Q4 block's 32 codes as floats, weight order
//   q8_block(32 bytes, Vec[32/kLanes])   a Q8 block's 32 codes as floats
//   ICodes q4_codes, IAcc iacc_zero iacc_dot iacc_add iacc_sum, kInt8Dot, quantize_block:
//                                        the int4 x int8 block dot products of cpu_int4_linear_a8
//
// The kernels use no torch type: WB_STANDALONE builds them without torch (the unit harness,
// harness.cpp, cross-compiled for ARM and run under qemu-user); otherwise parallel_for is ATen's.
#pragma once
#include <algorithm>
#include <cstdint>

#define WB_INLINE inline __attribute__((always_inline))

namespace wb {
using fp16 = uint16_t;  // IEEE half, raw bits (at::Half's storage)
}

#if defined(WB_ISA_AVX512)
#include "simd/avx512.h"
#elif defined(WB_ISA_AVX2)
#include "simd/avx2.h"
#elif defined(WB_ISA_NEON)
#include "simd/neon.h"
#else
#error "build the CPU kernels with one of WB_ISA_AVX512, WB_ISA_AVX2, WB_ISA_NEON (see workbench/ops/cpu_kernels/isa.py)"
#endif

#ifdef WB_STANDALONE
namespace wb {
// without torch (the harness): "threads" run one after another, each on its share of the range, so
// the kernels' split paths (key chunks, row blocks) are exercised as they are under ATen
inline int64_t& standalone_threads() {
  static int64_t n = 1;
  return n;
}
inline int64_t num_threads() { return standalone_threads(); }
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t parts = std::max<int64_t>(1, std::min(num_threads(), (end - begin + grain - 1) / std::max<int64_t>(1, grain)));
  const int64_t step = (end - begin + parts - 1) / parts;
  for (int64_t b = begin; b < end; b += step) f(b, std::min(end, b + step));
}
}  // namespace wb
#else
#include <ATen/Parallel.h>
namespace wb {
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}
inline int64_t num_threads() { return at::get_num_threads(); }
}  // namespace wb
#endif

namespace wb {

constexpr int kL = Vec::kLanes;
constexpr int kBlockVecs = 32 / kL;  // vectors per block of 32 weights

// the variant this file was built as (named by the loader and the summary)
#if defined(WB_ISA_AVX512) && defined(__AVX512VNNI__)
constexpr const char* kIsa = "avx512_vnni";
#elif defined(WB_ISA_AVX512)
constexpr const char* kIsa = "avx512";
#elif defined(WB_ISA_AVX2)
constexpr const char* kIsa = "avx2";
#elif defined(__ARM_FEATURE_DOTPROD)
constexpr const char* kIsa = "neon_dotprod";
#else
constexpr const char* kIsa = "neon";
#endif

WB_INLINE void prefetch_t0(const void* p) { __builtin_prefetch(p, 0, 3); }
WB_INLINE void prefetch_t1(const void* p) { __builtin_prefetch(p, 0, 2); }
WB_INLINE void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 1); }  // x86: prefetcht2

// exp(x) for x <= 0 (softmax after subtracting the maximum): x = n ln2 + r, |r| <= ln2/2, exp(r) by
// a degree-6 polynomial (relative error ~2e-7, below fp32 rounding of the sum), times 2^n.
WB_INLINE Vec exp_nonpositive(Vec x) {
  x = vmax(x, vset1(-87.3f));  // below: exp underflows to 0 either way (and 2^n stays a normal number)
  const Vec n = vround(x * vset1(1.44269504088896341f));
  Vec r = vfnma(n, vset1(0.693359375f), x);
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  Vec p = vset1(1.0f / 720);
  p = vfma(p, r, vset1(1.0f / 120));
  p = vfma(p, r, vset1(1.0f / 24));
  p = vfma(p, r, vset1(1.0f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
  return vmul_pow2(p, n);
}

// x * sigmoid(x): with e = exp(-|x|), sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below.
WB_INLINE Vec silu(Vec x) {
  const Vec e = exp_nonpositive(vzero() - vabs(x));
  const Vec inv = vset1(1.f) / (vset1(1.f) + e);
  return x * vselect_neg(x, inv * e, inv);
}

// kLanes floats (or the first n, the rest 0) from fp32 or fp16 storage: one name for both, so that a
// loop reading either is written once
WB_INLINE Vec vload_as_f32(const float* p) { return vload(p); }
WB_INLINE Vec vload_as_f32(const fp16* p) { return vload_half(p); }
WB_INLINE Vec vload_as_f32_part(const float* p, int64_t n) { return vload_part(p, n); }
WB_INLINE Vec vload_as_f32_part(const fp16* p, int64_t n) { return vload_half_part(p, n); }

// sum_i a[i] * b[i], a fp32 (attention's q . k) or fp16 (linear_a8_kernel.h: a row's offsets . sx)
template <class T>
WB_INLINE float dot(const T* a, const float* b, int64_t n) {
  Vec acc = vzero();
  int64_t i = 0;
  for (; i + kL <= n; i += kL) acc = vfma(vload_as_f32(a + i), vload(b + i), acc);
  if (i < n) acc = vfma(vload_as_f32_part(a + i, n - i), vload_part(b + i, n - i), acc);
  return vsum(acc);
}

// out[i] += p * v[i]
WB_INLINE void axpy(float* out, float p, const float* v, int64_t n) {
  const Vec vp = vset1(p);
  int64_t i = 0;
  for (; i + kL <= n; i += kL) vstore(out + i, vfma(vp, vload(v + i), vload(out + i)));
  for (; i < n; ++i) out[i] += p * v[i];
}

// fp16 [n] -> float [n]
WB_INLINE void widen(const fp16* h, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kL <= n; i += kL) vstore(out + i, vload_half(h + i));
  if (i < n) vstore_part(out + i, vload_half_part(h + i, n - i), n - i);
}

}  // namespace wb
