// The vector layer on ARM64 NEON (every AArch64 CPU; + dotprod in the neon_dotprod build): 4 float lanes.
// The operations every ISA header provides are listed in simd/vec.h; this file implements them, with
// simd/common.h (what every ISA does).
#pragma once
#include <arm_neon.h>

// the float register and the intrinsics' naming pattern that simd/common.h wraps
namespace wb {
using F32Reg = float32x4_t;
}  // namespace wb
#define WB_F32_OP(op) v##op##q_f32
#include "common.h"

namespace wb {

WB_INLINE Vec vzero() { return {vdupq_n_f32(0.f)}; }
WB_INLINE Vec vset1(float x) { return {vdupq_n_f32(x)}; }
WB_INLINE Vec vload(const float* p) { return {vld1q_f32(p)}; }
WB_INLINE void vstore(float* p, Vec a) { vst1q_f32(p, a.v); }
WB_INLINE Vec vload_part(const float* p, int64_t n) {
  float tmp[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t i = 0; i < n && i < 4; ++i) tmp[i] = p[i];
  return {vld1q_f32(tmp)};
}
WB_INLINE void vstore_part(float* p, Vec a, int64_t n) {
  float tmp[4];
  vst1q_f32(tmp, a.v);
  for (int64_t i = 0; i < n && i < 4; ++i) p[i] = tmp[i];
}
WB_INLINE Vec vfma(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
WB_INLINE Vec vfnma(Vec a, Vec b, Vec c) { return {vfmsq_f32(c.v, a.v, b.v)}; }
WB_INLINE Vec vabs(Vec a) { return {vabsq_f32(a.v)}; }
WB_INLINE float vsum(Vec a) { return vaddvq_f32(a.v); }
WB_INLINE float vmaxall(Vec a) { return vmaxvq_f32(a.v); }
WB_INLINE Vec vround(Vec a) { return {vrndnq_f32(a.v)}; }
// a * 2^n for integral n in [-126, 127]: 2^n built in the exponent field
WB_INLINE Vec vmul_pow2(Vec a, Vec n) {
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.v), vdupq_n_s32(127)), 23);
  return {vmulq_f32(a.v, vreinterpretq_f32_s32(e))};
}
WB_INLINE Vec vselect_neg(Vec x, Vec if_neg, Vec otherwise) {
  return {vbslq_f32(vcltq_f32(x.v, vdupq_n_f32(0.f)), if_neg.v, otherwise.v)};
}
WB_INLINE Vec vload_half(const fp16* p) {
  return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))))};
}
WB_INLINE Vec vload_half_part(const fp16* p, int64_t n) {
  uint16_t tmp[4] = {0, 0, 0, 0};
  for (int64_t i = 0; i < n && i < 4; ++i) tmp[i] = p[i];
  return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(tmp)))};
}
WB_INLINE float h2f(fp16 h) { return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0); }

// lane i = the sum of a[i]'s lanes, for 4 vectors: two rounds of pairwise adds
WB_INLINE Vec vtranspose_sum(const Vec* a) {
  return {vpaddq_f32(vpaddq_f32(a[0].v, a[1].v), vpaddq_f32(a[2].v, a[3].v))};
}

// 16 bytes -> 16 floats (4 vectors)
WB_INLINE void widen_u8(uint8x16_t b, Vec* out) {
  const uint16x8_t l = vmovl_u8(vget_low_u8(b)), h = vmovl_u8(vget_high_u8(b));
  out[0].v = vcvtq_f32_u32(vmovl_u16(vget_low_u16(l)));
  out[1].v = vcvtq_f32_u32(vmovl_u16(vget_high_u16(l)));
  out[2].v = vcvtq_f32_u32(vmovl_u16(vget_low_u16(h)));
  out[3].v = vcvtq_f32_u32(vmovl_u16(vget_high_u16(h)));
}

// The 32 codes of a Q4 block (16 bytes: byte j = weight j | weight j+16 << 4) as floats, in weight order.
WB_INLINE void q4_block(const uint8_t* p, Vec* out) {
  const uint8x16_t b = vld1q_u8(p);
  widen_u8(vandq_u8(b, vdupq_n_u8(0x0f)), out);
  widen_u8(vshrq_n_u8(b, 4), out + 4);
}

// The 32 codes of a Q8 block (32 signed bytes) as floats.
WB_INLINE void q8_block(const int8_t* p, Vec* out) {
  for (int half = 0; half < 2; ++half) {
    const int8x16_t b = vld1q_s8(p + 16 * half);
    const int16x8_t l = vmovl_s8(vget_low_s8(b)), h = vmovl_s8(vget_high_s8(b));
    out[4 * half + 0].v = vcvtq_f32_s32(vmovl_s16(vget_low_s16(l)));
    out[4 * half + 1].v = vcvtq_f32_s32(vmovl_s16(vget_high_s16(l)));
    out[4 * half + 2].v = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
    out[4 * half + 3].v = vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)));
  }
}

// ---- int8 dot products (cpu_int4_linear_a8): 32 4-bit codes (0..15, so signed bytes too) x 32 signed bytes.
struct ICodes {
  int8x16_t lo, hi;  // weights 0-15, 16-31
};
using IAcc = float32x4_t;

WB_INLINE ICodes q4_codes(const uint8_t* p) {
  const uint8x16_t b = vld1q_u8(p);
  return {vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0f))), vreinterpretq_s8_u8(vshrq_n_u8(b, 4))};
}
WB_INLINE IAcc iacc_zero() { return vdupq_n_f32(0.f); }
WB_INLINE IAcc iacc_dot(ICodes w, const int8_t* x, float scale, IAcc acc) {
  const int8x16_t x0 = vld1q_s8(x), x1 = vld1q_s8(x + 16);
#if defined(__ARM_FEATURE_DOTPROD)
  const int32x4_t s = vdotq_s32(vdotq_s32(vdupq_n_s32(0), w.lo, x0), w.hi, x1);
#else
  // s8 x s8 -> s16 products (|p| <= 15 * 127), pairs accumulated into s32
  int32x4_t s = vpaddlq_s16(vmull_s8(vget_low_s8(w.lo), vget_low_s8(x0)));
  s = vpadalq_s16(s, vmull_s8(vget_high_s8(w.lo), vget_high_s8(x0)));
  s = vpadalq_s16(s, vmull_s8(vget_low_s8(w.hi), vget_low_s8(x1)));
  s = vpadalq_s16(s, vmull_s8(vget_high_s8(w.hi), vget_high_s8(x1)));
#endif
  return vfmaq_n_f32(acc, vcvtq_f32_s32(s), scale);
}
WB_INLINE IAcc iacc_add(IAcc a, IAcc b) { return vaddq_f32(a, b); }
WB_INLINE float iacc_sum(IAcc v) { return vaddvq_f32(v); }
#if defined(__ARM_FEATURE_DOTPROD)
constexpr const char* kInt8Dot = "NEON sdot";
#else
constexpr const char* kInt8Dot = "NEON smull";
#endif

// x[32] -> q[32] = round(x / d) (nearest even), d = max|x| / 127; returns d, and sum(q) in qsum
WB_INLINE float quantize_block(const float* x, int8_t* q, int32_t& qsum) {
  float32x4_t v[8];
  float32x4_t m = vdupq_n_f32(0.f);
  for (int i = 0; i < 8; ++i) v[i] = vld1q_f32(x + 4 * i), m = vmaxq_f32(m, vabsq_f32(v[i]));
  const float amax = vmaxvq_f32(m);
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int32x4_t sum = vdupq_n_s32(0);
  for (int i = 0; i < 8; i += 2) {
    const int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(v[i], id)), b = vcvtnq_s32_f32(vmulq_n_f32(v[i + 1], id));
    sum = vaddq_s32(sum, vaddq_s32(a, b));
    const int16x8_t h = vcombine_s16(vqmovn_s32(a), vqmovn_s32(b));
    vst1_s8(q + 4 * i, vqmovn_s16(h));
  }
  qsum = vaddvq_s32(sum);
  return amax / 127.f;
}

}  // namespace wb

#undef WB_F32_OP  // the spelling macro stays inside the SIMD headers
