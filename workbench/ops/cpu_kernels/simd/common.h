// What every ISA header shares: Vec over the ISA's float register, and the lane-wise arithmetic that
// each ISA spells as one intrinsic whose name differs only by the ISA's naming pattern:
//     WB_F32_OP(add)  ->  _mm512_add_ps (AVX-512), _mm256_add_ps (AVX2), vaddq_f32 (NEON)
// The including ISA header defines WB_F32_OP and F32Reg (its native float register) first.
#pragma once
#ifndef WB_F32_OP
#error "simd/common.h is included by an ISA header (avx2.h, avx512.h, neon.h) through vec.h, which define WB_F32_OP first"
#endif

namespace wb {

// kLanes floats in one native register (__m512: 16, __m256: 8, float32x4_t: 4)
struct Vec {
  static constexpr int kLanes = sizeof(F32Reg) / sizeof(float);
  F32Reg v;
};

WB_INLINE Vec operator+(Vec a, Vec b) { return {WB_F32_OP(add)(a.v, b.v)}; }
WB_INLINE Vec operator-(Vec a, Vec b) { return {WB_F32_OP(sub)(a.v, b.v)}; }
WB_INLINE Vec operator*(Vec a, Vec b) { return {WB_F32_OP(mul)(a.v, b.v)}; }
WB_INLINE Vec operator/(Vec a, Vec b) { return {WB_F32_OP(div)(a.v, b.v)}; }
WB_INLINE Vec vmax(Vec a, Vec b) { return {WB_F32_OP(max)(a.v, b.v)}; }

}  // namespace wb
