// Vector math shared by the CPU kernels (AVX-512, 16 float lanes).
#pragma once
#include <immintrin.h>

// small helpers the compiler must inline into the kernels' inner loops
#define WB_INLINE inline __attribute__((always_inline))

// exp(x) for x <= 0 (softmax after subtracting the maximum), 16 lanes: x = n ln2 + r, |r| <= ln2/2,
// exp(r) by a degree-6 polynomial (relative error ~2e-7, below fp32 rounding of the sum), times 2^n.
static inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));  // below: exp underflows to 0 either way
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// x * sigmoid(x), 16 lanes: with e = exp(-|x|), sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below.
static inline __m512 silu(__m512 x) {
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mul_ps(x, _mm512_mask_mul_ps(inv, neg, inv, e));
}
