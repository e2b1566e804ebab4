/* SiLU's arithmetic on 16 float32 lanes, shared by fused_avx2.c (silu_mul, prompt attention's
   softmax) and gguf_interleaved.c (the gate/up GEMM's fused SwiGLU), so both give the same bits.
   fused_avx2.c's exp256 on 16 lanes, operation for operation (the same bits per lane). */
#ifndef TOKENSERVE_SILU512_H
#define TOKENSERVE_SILU512_H
#include <immintrin.h>

#define SILU512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

SILU512_TARGET static inline __m512 exp512(__m512 x) {
    const __m512 lim = _mm512_set1_ps(88.3762626647949f);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* silu(g) * u: g / (1 + exp(-g)) * u, as silu_mul computes a lane */
SILU512_TARGET static inline __m512 silu_mul16(__m512 g, __m512 u) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
#endif
