// What the AVX2 and AVX-512 vector layers spell alike: the float operations whose intrinsics differ
// only in width (_mm256_<op>_ps / _mm512_<op>_ps, named by the including header's WB_F32_OP), and the
// int4 x int8 block dot products, which both run on 256-bit registers (32 bytes: one block's codes).
#pragma once
#ifndef WB_F32_OP
#error "simd/x86.h is included by an ISA header (avx2.h, avx512.h, neon.h) through vec.h, which define WB_F32_OP first"
#endif
#include <immintrin.h>

#include "common.h"

namespace wb {

WB_INLINE Vec vzero() { return {WB_F32_OP(setzero)()}; }
WB_INLINE Vec vset1(float x) { return {WB_F32_OP(set1)(x)}; }
WB_INLINE Vec vload(const float* p) { return {WB_F32_OP(loadu)(p)}; }
WB_INLINE void vstore(float* p, Vec a) { WB_F32_OP(storeu)(p, a.v); }
WB_INLINE Vec vfma(Vec a, Vec b, Vec c) { return {WB_F32_OP(fmadd)(a.v, b.v, c.v)}; }
WB_INLINE Vec vfnma(Vec a, Vec b, Vec c) { return {WB_F32_OP(fnmadd)(a.v, b.v, c.v)}; }
WB_INLINE float h2f(fp16 h) { return _cvtsh_ss(h); }

// the sum of 8 floats: the two 128-bit halves added, then the 4 lanes pairwise
WB_INLINE float hsum256(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// ---- int8 dot products (cpu_int4_linear_a8): 32 unsigned 4-bit codes x 32 signed 8-bit activations.
// IAcc holds fp32 partial sums; iacc_dot adds scale * (the block's integer dot product) into them.
using ICodes = __m256i;
using IAcc = __m256;

// the block's 32 codes as bytes in weight order: low nibbles (weights 0-15), then high (16-31)
WB_INLINE ICodes q4_codes(const uint8_t* p) {
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(bytes, low4)),
                                 _mm_and_si128(_mm_srli_epi16(bytes, 4), low4), 1);
}
WB_INLINE IAcc iacc_zero() { return _mm256_setzero_ps(); }
WB_INLINE IAcc iacc_dot(ICodes w, const int8_t* x, float scale, IAcc acc) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if defined(__AVX512VNNI__)
  const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);  // 4 products per lane, summed
#else
  // u8 x s8 -> pairs summed to s16 (codes <= 15, |x| <= 127: no saturation), then pairs to s32
  const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
#endif
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(scale), acc);
}
WB_INLINE IAcc iacc_add(IAcc a, IAcc b) { return _mm256_add_ps(a, b); }
WB_INLINE float iacc_sum(IAcc v) { return hsum256(v); }
#if defined(__AVX512VNNI__)  // the avx512_vnni build only
constexpr const char* kInt8Dot = "AVX512-VNNI vpdpbusd";
#else
constexpr const char* kInt8Dot = "AVX2 vpmaddubsw";
#endif

}  // namespace wb
