// The vector layer on x86-64 AVX-512 (F, BW, VL, DQ; + VNNI in the avx512_vnni build): 16 float lanes.
// The operations every ISA header provides are listed in simd/vec.h; this file implements them, with
// simd/x86.h (what AVX2 spells alike) and simd/common.h (what every ISA does).
#pragma once
#include <immintrin.h>

// the float register and the intrinsics' naming pattern that simd/common.h and simd/x86.h wrap
namespace wb {
using F32Reg = __m512;
}  // namespace wb
#define WB_F32_OP(op) _mm512_##op##_ps
#include "x86.h"

namespace wb {

WB_INLINE __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
WB_INLINE Vec vload_part(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(tail_mask(n), p)}; }
WB_INLINE void vstore_part(float* p, Vec a, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), a.v); }
WB_INLINE Vec vabs(Vec a) { return {_mm512_abs_ps(a.v)}; }
WB_INLINE float vsum(Vec a) { return _mm512_reduce_add_ps(a.v); }
WB_INLINE float vmaxall(Vec a) { return _mm512_reduce_max_ps(a.v); }
WB_INLINE Vec vround(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
WB_INLINE Vec vmul_pow2(Vec a, Vec n) { return {_mm512_scalef_ps(a.v, n.v)}; }  // a * 2^n, n integral
WB_INLINE Vec vselect_neg(Vec x, Vec if_neg, Vec otherwise) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, _mm512_setzero_ps(), _CMP_LT_OQ), otherwise.v, if_neg.v)};
}
WB_INLINE Vec vload_half(const fp16* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
WB_INLINE Vec vload_half_part(const fp16* p, int64_t n) {
  return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(n), p))};
}

// lane i = the sum of a[i]'s lanes, for 16 vectors: a transpose-add tree (unpack pairs, then 64-bit
// pairs, then 128-bit blocks) of 45 shuffles and adds instead of 16 horizontal sums.
WB_INLINE Vec vtranspose_sum(const Vec* a) {
  __m512 l1[8], l2[4];
  for (int i = 0; i < 8; ++i)
    l1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].v, a[2 * i + 1].v), _mm512_unpackhi_ps(a[2 * i].v, a[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(l1[2 * i]), y = _mm512_castps_pd(l1[2 * i + 1]);
    l2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(l2[0], l2[1], 0x44), _mm512_shuffle_f32x4(l2[0], l2[1], 0xEE));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(l2[2], l2[3], 0x44), _mm512_shuffle_f32x4(l2[2], l2[3], 0xEE));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD))};
}

// The 32 codes of a Q4 block (16 bytes: byte j = weight j | weight j+16 << 4) as floats, in weight order.
WB_INLINE void q4_block(const uint8_t* p, Vec* out) {
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  out[0].v = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
  out[1].v = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
}

// The 32 codes of a Q8 block (32 signed bytes) as floats.
WB_INLINE void q8_block(const int8_t* p, Vec* out) {
  out[0].v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  out[1].v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}

// x[32] -> q[32] = round(x / d) (nearest even), d = max|x| / 127; returns d, and sum(q) in qsum
WB_INLINE float quantize_block(const float* x, int8_t* q, int32_t& qsum) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
  qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  return amax / 127.f;
}

}  // namespace wb

#undef WB_F32_OP  // the spelling macro stays inside the SIMD headers
