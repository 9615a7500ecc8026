// The vector layer on x86-64 AVX2 + FMA + F16C (every x86-64 CPU since Haswell / Zen 1): 8 float lanes.
// The operations every ISA header provides are listed in simd/vec.h; this file implements them, with
// simd/x86.h (what AVX-512 spells alike) and simd/common.h (what every ISA does).
#pragma once
#include <immintrin.h>

// the float register and the intrinsics' naming pattern that simd/common.h and simd/x86.h wrap
namespace wb {
using F32Reg = __m256;
}  // namespace wb
#define WB_F32_OP(op) _mm256_##op##_ps
#include "x86.h"

namespace wb {

// lanes [0, n) set: -1 where the lane index is below n (n clamped to 0..8)
WB_INLINE __m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
WB_INLINE Vec vload_part(const float* p, int64_t n) { return {_mm256_maskload_ps(p, tail_mask(n))}; }
WB_INLINE void vstore_part(float* p, Vec a, int64_t n) { _mm256_maskstore_ps(p, tail_mask(n), a.v); }
WB_INLINE Vec vabs(Vec a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.f), a.v)}; }
WB_INLINE float vsum(Vec a) { return hsum256(a.v); }
WB_INLINE float vmaxall(Vec a) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
WB_INLINE Vec vround(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a * 2^n for integral n in [-126, 127]: 2^n built in the exponent field
WB_INLINE Vec vmul_pow2(Vec a, Vec n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(a.v, _mm256_castsi256_ps(e))};
}
WB_INLINE Vec vselect_neg(Vec x, Vec if_neg, Vec otherwise) {
  return {_mm256_blendv_ps(otherwise.v, if_neg.v, _mm256_cmp_ps(x.v, _mm256_setzero_ps(), _CMP_LT_OQ))};
}
WB_INLINE Vec vload_half(const fp16* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
WB_INLINE Vec vload_half_part(const fp16* p, int64_t n) {
  alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n && i < 8; ++i) tmp[i] = p[i];
  return {_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)))};
}

// lane i = the sum of a[i]'s lanes, for 8 vectors: three rounds of horizontal adds, then the two
// 128-bit halves added.
WB_INLINE Vec vtranspose_sum(const Vec* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0].v, a[1].v), t1 = _mm256_hadd_ps(a[2].v, a[3].v);
  const __m256 t2 = _mm256_hadd_ps(a[4].v, a[5].v), t3 = _mm256_hadd_ps(a[6].v, a[7].v);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low / high halves of a[0..3]); u1 likewise for a[4..7]
  return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))};
}

// The 32 codes of a Q4 block (16 bytes: byte j = weight j | weight j+16 << 4) as floats, in weight order.
WB_INLINE void q4_block(const uint8_t* p, Vec* out) {
  const __m256i w0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i w1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i low4 = _mm256_set1_epi32(15);
  out[0].v = _mm256_cvtepi32_ps(_mm256_and_si256(w0, low4));
  out[1].v = _mm256_cvtepi32_ps(_mm256_and_si256(w1, low4));
  out[2].v = _mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4));
  out[3].v = _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4));
}

// The 32 codes of a Q8 block (32 signed bytes) as floats.
WB_INLINE void q8_block(const int8_t* p, Vec* out) {
  for (int i = 0; i < 4; ++i)
    out[i].v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
}

// x[32] -> q[32] = round(x / d) (nearest even), d = max|x| / 127; returns d, and sum(q) in qsum
WB_INLINE float quantize_block(const float* x, int8_t* q, int32_t& qsum) {
  Vec v[4];
  for (int i = 0; i < 4; ++i) v[i] = vload(x + 8 * i);
  const float amax = vmaxall(vmax(vmax(vabs(v[0]), vabs(v[1])), vmax(vabs(v[2]), vabs(v[3]))));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i].v, _mm256_set1_ps(id)));
  // int32 -> int16 -> int8 with saturation; packs interleave 128-bit lanes, the permute restores order
  const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  qsum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
  return amax / 127.f;
}

}  // namespace wb

#undef WB_F32_OP  // the spelling macro stays inside the SIMD headers
