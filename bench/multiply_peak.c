/* The machine's multiply-add peaks on AVX2, for bench/machine.py's compute ceiling: register-only
   loops on every OpenMP thread, no loads or stores in the loop, so nothing but the vector ports
   bounds them.

   int16_panel_peak: the inner loop of the engine's 16-bit panel tile (gguf_linear.c i16_ptile):
     two weight vectors x three broadcast input pairs a step, each product VPMADDWD (16
     multiply-adds) plus VPADDD into its own 32-bit sum: 96 multiply-adds a step.
   f32_fma_peak: twelve independent 8-lane FMA chains (enough to cover FMA's latency on two
     ports): 96 multiply-adds a step, the float32 GEMMs' (MKL's, oneDNN's) ceiling.

   int16_vnni_peak (built where the CPU has AVX-VNNI): the same tile with VPDPWSSD, products
     and sum in one instruction, as the engine's AVX-VNNI build runs it; twelve independent
     sums (two weight vectors x six input pairs) cover its latency: 192 multiply-adds a step.

   Each returns the multiply-adds done by all threads in `steps` steps each. Built by
   bench/machine.py with -O3 -mavx2 -mfma -fopenmp (and -mavxvnni where the CPU has it). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

double int16_panel_peak(int64_t steps) {
    double total = 0;
    _Pragma("omp parallel reduction(+:total)")
    {
        __m256i w0 = _mm256_set1_epi16((short)(3 + omp_get_thread_num())), w1 = _mm256_set1_epi16(5);
        __m256i x[3], P0[3], P1[3];
        for (int j = 0; j < 3; j++) {
            x[j] = _mm256_set1_epi32(0x00010002 + j);
            P0[j] = P1[j] = _mm256_setzero_si256();
        }
        for (int64_t i = 0; i < steps; i++) {
            _Pragma("GCC unroll 3") for (int j = 0; j < 3; j++) {
                P0[j] = _mm256_add_epi32(P0[j], _mm256_madd_epi16(w0, x[j]));
                P1[j] = _mm256_add_epi32(P1[j], _mm256_madd_epi16(w1, x[j]));
            }
            __asm__ volatile("" : "+x"(w0), "+x"(w1));  /* no hoisting the products out */
        }
        __m256i s = _mm256_setzero_si256();
        for (int j = 0; j < 3; j++) s = _mm256_add_epi32(s, _mm256_add_epi32(P0[j], P1[j]));
        volatile int32_t sink = _mm256_extract_epi32(s, 0);
        (void)sink;
        total += (double)steps * 96;
    }
    return total;
}

double f32_fma_peak(int64_t steps) {
    double total = 0;
    _Pragma("omp parallel reduction(+:total)")
    {
        __m256 a[12], b = _mm256_set1_ps(1.0001f), c = _mm256_set1_ps(1e-7f);
        for (int j = 0; j < 12; j++) a[j] = _mm256_set1_ps((float)j);
        for (int64_t i = 0; i < steps; i++) {
            _Pragma("GCC unroll 12") for (int j = 0; j < 12; j++) a[j] = _mm256_fmadd_ps(a[j], b, c);
            __asm__ volatile("" : "+x"(b), "+x"(c));
        }
        __m256 s = _mm256_setzero_ps();
        for (int j = 0; j < 12; j++) s = _mm256_add_ps(s, a[j]);
        volatile float sink = _mm256_cvtss_f32(s);
        (void)sink;
        total += (double)steps * 96;
    }
    return total;
}

#if defined(__AVXVNNI__)
double int16_vnni_peak(int64_t steps) {
    double total = 0;
    _Pragma("omp parallel reduction(+:total)")
    {
        __m256i w0 = _mm256_set1_epi16((short)(3 + omp_get_thread_num())), w1 = _mm256_set1_epi16(5);
        __m256i x[6], P0[6], P1[6];
        for (int j = 0; j < 6; j++) {
            x[j] = _mm256_set1_epi32(0x00010002 + j);
            P0[j] = P1[j] = _mm256_setzero_si256();
        }
        for (int64_t i = 0; i < steps; i++) {
            _Pragma("GCC unroll 6") for (int j = 0; j < 6; j++) {
                P0[j] = _mm256_dpwssd_avx_epi32(P0[j], w0, x[j]);
                P1[j] = _mm256_dpwssd_avx_epi32(P1[j], w1, x[j]);
            }
            __asm__ volatile("" : "+x"(w0), "+x"(w1));
        }
        __m256i s = _mm256_setzero_si256();
        for (int j = 0; j < 6; j++) s = _mm256_add_epi32(s, _mm256_add_epi32(P0[j], P1[j]));
        volatile int32_t sink = _mm256_extract_epi32(s, 0);
        (void)sink;
        total += (double)steps * 192;
    }
    return total;
}
#endif
