/* The engine's fused AVX2 kernels (cpu_kernels.py documents each and builds this file at
   first use with -mavx2 -mfma -mf16c -fopenmp; callers fall back to torch without AVX2). A
   kernel with an AVX-512 variant builds it with a target attribute and picks it at run time
   (__builtin_cpu_supports, unless the loader's TOKENSERVE_CPU_ISA cap forbids it), so this one
   build serves both kinds of CPU. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Work items are handed out dynamically everywhere: on a shared 2-core machine, when one
   thread is preempted the other takes over the items it has not started, instead of
   waiting for a static half of the work (measured: a 16-row decode step with another
   process waking every 2 ms went from 1.6x to 1.2x its quiet time). Row-wise kernels hand
   out runs of ROW_RUN rows: rows one by one had the two cores alternate rows, each pulling
   in the lines the other writes (a 64 x 64-token prefill on the 2-core AMX Xeon: add_rmsnorm
   ~70 -> ~40 ms, rope_write_kv ~36 -> ~15 ms). Element-wise kernels stay on one thread below
   PARALLEL_MIN_ELEMS (a parallel region costs more than the work): a 64-row decode step's
   norms and RoPE are above it (in paired rounds that step took 0.95-0.97x the time with them
   on both threads), a 16-row step's below. */
#define PARALLEL_MIN_ELEMS (1 << 14)
#define ROW_RUN 16

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* bfloat16 rows (a bfloat16 prefill's activations): widened exactly, and rounded to nearest
   even as torch's .to(torch.bfloat16) rounds (a NaN stays a NaN: 0x7FC0). */
static inline __m256 load8_bf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

static inline void store8_bf16(uint16_t *p, __m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  /* lanes 0-3, 4-7 */
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } c = {f};
    if (f != f) return 0x7FC0;
    return (uint16_t)((c.u + 0x7FFF + ((c.u >> 16) & 1)) >> 16);
}

/* Element i of a row of float32 (bf16 == 0) or bfloat16 values, read and written as float. */
static inline __m256 load8(const void *row, int64_t i, int bf16) {
    return bf16 ? load8_bf16((const uint16_t *)row + i) : _mm256_loadu_ps((const float *)row + i);
}

static inline void store8(void *row, int64_t i, __m256 v, int bf16) {
    if (bf16) store8_bf16((uint16_t *)row + i, v);
    else _mm256_storeu_ps((float *)row + i, v);
}

static inline float load1(const void *row, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline void store1(void *row, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)row)[i] = float_to_bf16(v);
    else ((float *)row)[i] = v;
}

/* Weight-only int8 GEMM over weights packed in blocks of 8 output channels:
   p[(b * K + k) * 8 + i] = q[b * 8 + i, k]. A block's 8 weights at one k are one 8-byte load
   converted to a float vector (lanes = output channels), multiplied by x[m, k] broadcast for
   MR rows at once. y[m, n] is one FMA chain over k = 0..K-1 in order, then times scale[n], in
   every tile shape: a row's result is bit-identical whatever M is and whatever tile computed
   it (a sequence's logits do not depend on the rest of the batch). Tiles of NB blocks x MR
   rows keep NB * MR = 12 accumulators in registers; for a few rows (decodes) converting
   each weight as it is used is cheapest. */
#define UNROLL _Pragma("GCC unroll 12")
#define PTILE(NB, MR)                                                                       \
static inline void ptile_##NB##x##MR(const float *x, const int8_t *p, const float *scale,  \
                                     float *y, int64_t m0, int64_t b0, int64_t N, int64_t K) { \
    __m256 acc[NB][MR];                                                                     \
    UNROLL for (int b = 0; b < NB; b++)                                                     \
        UNROLL for (int j = 0; j < MR; j++) acc[b][j] = _mm256_setzero_ps();                \
    const float *xr = x + m0 * K;                                                           \
    for (int64_t k = 0; k < K; k++) {                                                       \
        UNROLL for (int b = 0; b < NB; b++) {                                               \
            __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(                             \
                _mm_loadl_epi64((const __m128i *)(p + ((b0 + b) * K + k) * 8))));           \
            UNROLL for (int j = 0; j < MR; j++)                                             \
                acc[b][j] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(xr + j * K + k), acc[b][j]); \
        }                                                                                   \
    }                                                                                       \
    UNROLL for (int b = 0; b < NB; b++) {                                                   \
        int64_t n = (b0 + b) * 8;                                                           \
        __m256 sc = _mm256_loadu_ps(scale + n);                                             \
        UNROLL for (int j = 0; j < MR; j++) {                                               \
            float *yr = y + (m0 + j) * N + n;                                               \
            __m256 r = _mm256_mul_ps(acc[b][j], sc);                                        \
            if (n + 8 <= N) {                                                               \
                _mm256_storeu_ps(yr, r);                                                    \
            } else {                                                                        \
                float t[8];                                                                 \
                _mm256_storeu_ps(t, r);                                                     \
                for (int64_t i = 0; n + i < N; i++) yr[i] = t[i];                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}
PTILE(2, 6)
PTILE(3, 4)
PTILE(4, 3)
PTILE(6, 2)
PTILE(12, 1)

/* The same products for many rows: two blocks' weights are converted to a float panel
   [K][16] once (L1/L2-resident) and shared by every 6-row tile, so the inner loop is two
   aligned loads, 6 broadcasts and 12 FMAs per k. Same FMA chain per output as the tiles
   above: the results are bit-identical to them. */
#define FTILE(MR)                                                                           \
static inline void ftile_##MR(const float *x, const float *w, const float *scale, float *y, \
                              int64_t m0, int64_t n0, int64_t N, int64_t K) {               \
    __m256 a0[MR], a1[MR];                                                                  \
    UNROLL for (int j = 0; j < MR; j++) a0[j] = a1[j] = _mm256_setzero_ps();                \
    const float *xr = x + m0 * K;                                                           \
    for (int64_t k = 0; k < K; k++) {                                                       \
        __m256 w0 = _mm256_load_ps(w + k * 16), w1 = _mm256_load_ps(w + k * 16 + 8);        \
        UNROLL for (int j = 0; j < MR; j++) {                                               \
            __m256 xv = _mm256_broadcast_ss(xr + j * K + k);                                \
            a0[j] = _mm256_fmadd_ps(w0, xv, a0[j]);                                         \
            a1[j] = _mm256_fmadd_ps(w1, xv, a1[j]);                                         \
        }                                                                                   \
    }                                                                                       \
    __m256 s0 = _mm256_loadu_ps(scale + n0), s1 = _mm256_loadu_ps(scale + n0 + 8);          \
    UNROLL for (int j = 0; j < MR; j++) {                                                   \
        float *yr = y + (m0 + j) * N + n0;                                                  \
        float t[16];                                                                        \
        _mm256_storeu_ps(t, _mm256_mul_ps(a0[j], s0));                                      \
        _mm256_storeu_ps(t + 8, _mm256_mul_ps(a1[j], s1));                                  \
        for (int64_t i = 0; i < 16 && n0 + i < N; i++) yr[i] = t[i];                        \
    }                                                                                       \
}
FTILE(6)
FTILE(5)
FTILE(4)
FTILE(3)
FTILE(2)
FTILE(1)

static void int8_linear_panels(const float *x, const int8_t *p, const float *scale, float *y,
                               int64_t M, int64_t N, int64_t K) {
    int64_t groups = (N + 95) / 96;
    #pragma omp parallel
    {
        float *w = (float *)aligned_alloc(32, sizeof(float) * 16 * K);
        #pragma omp for schedule(dynamic)
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t b = g * 12; b < g * 12 + 12; b += 2) {
                if (b * 8 >= N) break;
                for (int64_t k = 0; k < K; k++) {
                    _mm256_store_ps(w + k * 16, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i *)(p + (b * K + k) * 8)))));
                    _mm256_store_ps(w + k * 16 + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i *)(p + ((b + 1) * K + k) * 8)))));
                }
                int64_t m = 0;
                for (; m + 6 <= M; m += 6) ftile_6(x, w, scale, y, m, b * 8, N, K);
                switch (M - m) {
                    case 5: ftile_5(x, w, scale, y, m, b * 8, N, K); break;
                    case 4: ftile_4(x, w, scale, y, m, b * 8, N, K); break;
                    case 3: ftile_3(x, w, scale, y, m, b * 8, N, K); break;
                    case 2: ftile_2(x, w, scale, y, m, b * 8, N, K); break;
                    case 1: ftile_1(x, w, scale, y, m, b * 8, N, K); break;
                }
            }
        }
        free(w);
    }
}

/* x: float32 [M, K]; p: packed int8, ceil(N / 96) * 12 blocks (zero-padded); scale: float32,
   padded like p; y: float32 [M, N]. Groups of 12 blocks (96 channels) are split across the
   OpenMP team. From 12 rows on, the float panels above; below that, the int8 tiles straight
   from the packed weights (6, 4, 3, 2 or 1 rows at a time, 12 accumulators each). */
void int8_linear(const float *x, const int8_t *p, const float *scale, float *y,
                 int64_t M, int64_t N, int64_t K) {
    if (M >= 12) {
        int8_linear_panels(x, p, scale, y, M, N, K);
        return;
    }
    int64_t groups = (N + 95) / 96;
    #pragma omp parallel for schedule(dynamic)
    for (int64_t g = 0; g < groups; g++) {
        int64_t b0 = g * 12, m = 0;
        if (M - m >= 6) {
            for (int64_t b = 0; b < 12; b += 2) ptile_2x6(x, p, scale, y, m, b0 + b, N, K);
            m += 6;
        }
        if (M - m >= 4) {
            for (int64_t b = 0; b < 12; b += 3) ptile_3x4(x, p, scale, y, m, b0 + b, N, K);
            m += 4;
        }
        if (M - m == 3) {
            for (int64_t b = 0; b < 12; b += 4) ptile_4x3(x, p, scale, y, m, b0 + b, N, K);
        } else if (M - m == 2) {
            for (int64_t b = 0; b < 12; b += 6) ptile_6x2(x, p, scale, y, m, b0 + b, N, K);
        } else if (M - m == 1) {
            ptile_12x1(x, p, scale, y, m, b0, N, K);
        }
    }
}

/* exp for lanes in [-88, 88] (Cephes polynomial, ~1 ulp); inputs are clamped to that range. */
static inline __m256 exp256(__m256 x) {
    const __m256 lim = _mm256_set1_ps(88.3762626647949f);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* A thread's scratch buffer, kept between calls and grown when a longer context needs more
   (a malloc and free per task cost more than a short context's work). */
static __thread void *scratch_buf;
static __thread size_t scratch_bytes;
static inline void *scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch_buf);
        scratch_bytes = 2 * bytes;
        scratch_buf = malloc(scratch_bytes);
    }
    return scratch_buf;
}

/* Both cache lines of a 64-value float16 row (the first of a float32 one). */
static inline void prefetch_row(const void *p) {
    _mm_prefetch((const char *)p, _MM_HINT_T0);
    _mm_prefetch((const char *)p + 64, _MM_HINT_T0);
}

/* The same two lines into L2 only (V rows, fetched during the K pass for the V pass after it). */
static inline void prefetch_row_l2(const void *p) {
    _mm_prefetch((const char *)p, _MM_HINT_T1);
    _mm_prefetch((const char *)p + 64, _MM_HINT_T1);
}

/* off[l]: where key l's row of KV head hk (head_off = hk * D) lies, walked block by block
   through the sequence's table (no division per row); rows L .. Lp - 1 repeat row 0. */
static inline void decode_offsets(const int64_t *table, int64_t L, int64_t Lp, int64_t bs, int64_t row,
                                  int64_t head_off, int64_t *off) {
    for (int64_t l = 0, blk = 0; l < L; blk++)
        for (int64_t i = 0; i < bs && l < L; i++, l++) off[l] = (table[blk] * bs + i) * row + head_off;
    for (int64_t l = L; l < Lp; l++) off[l] = off[0];
}

/* Each of the G rows of scores p (Lp apart, L of them real) to exp(s - max), the padding to 0,
   and inv[g] = 1 / their sum. */
static inline void decode_softmax(float *p, int64_t G, int64_t L, int64_t Lp, float *inv) {
    for (int64_t g = 0; g < G; g++) {
        float *pg = p + g * Lp;
        for (int64_t l = L; l < Lp; l++) pg[l] = pg[0];  /* no effect on the maximum */
        __m256 mxv = _mm256_loadu_ps(pg);
        for (int64_t l = 8; l < Lp; l += 8) mxv = _mm256_max_ps(mxv, _mm256_loadu_ps(pg + l));
        mxv = _mm256_max_ps(mxv, _mm256_permute2f128_ps(mxv, mxv, 1));
        mxv = _mm256_max_ps(mxv, _mm256_shuffle_ps(mxv, mxv, 0x4E));
        mxv = _mm256_max_ps(mxv, _mm256_shuffle_ps(mxv, mxv, 0xB1));
        for (int64_t l = 0; l < Lp; l += 8)
            _mm256_storeu_ps(pg + l, exp256(_mm256_sub_ps(_mm256_loadu_ps(pg + l), mxv)));
        for (int64_t l = L; l < Lp; l++) pg[l] = 0.0f;  /* padding weighs nothing */
        __m256 sv = _mm256_setzero_ps();
        for (int64_t l = 0; l < Lp; l += 8) sv = _mm256_add_ps(sv, _mm256_loadu_ps(pg + l));
        inv[g] = 1.0f / hsum(sv);
    }
}

/* The tasks of paged_decode_attention's kernels (one per sequence and KV head), around their
   NAME##_scores and NAME##_values_all (ATTR: the kernel's target attribute, or nothing). */
#define PAGED_DECODE_TASKS(NAME, T, ATTR)                                                                 \
ATTR void NAME(const float *q, const T *kc, const T *vc, const int64_t *tables,                           \
          const int64_t *ctx, float *out, int64_t B, int64_t H, int64_t Hkv,                              \
          int64_t D, int64_t bs, int64_t max_nb, float scale, int64_t q_stride) {                         \
    int64_t G = H / Hkv, row = Hkv * D;                                                                   \
    _Pragma("omp parallel for schedule(dynamic)")                                                         \
    for (int64_t task = 0; task < B * Hkv; task++) {                                                      \
        int64_t b = task / Hkv, hk = task % Hkv, L = ctx[b];                                              \
        int64_t Lp = (L + 7) & ~(int64_t)7;                                                               \
        float *p = scratch(sizeof(float) * G * Lp + sizeof(int64_t) * Lp);                                \
        int64_t *off = (int64_t *)(p + G * Lp);                                                           \
        decode_offsets(tables + b * max_nb, L, Lp, bs, row, hk * D, off);                                 \
        const float *qb = q + b * q_stride + hk * G * D;                                                  \
        for (int64_t l = 0; l < 16 && l < L; l++) {                                                       \
            prefetch_row(kc + off[l]);                                                                    \
            prefetch_row_l2(vc + off[l]);                                                                 \
        }                                                                                                 \
        for (int64_t l0 = 0; l0 < L; l0 += 4) {                                                           \
            const T *kr[4];                                                                               \
            for (int i = 0; i < 4; i++) kr[i] = kc + off[l0 + i];                                         \
            if (l0 + 20 <= Lp)  /* 16 keys ahead (Lp is a multiple of 8: within off[]) */                 \
                for (int i = 0; i < 4; i++) {                                                             \
                    prefetch_row(kc + off[l0 + 16 + i]);                                                  \
                    prefetch_row_l2(vc + off[l0 + 16 + i]);                                               \
                }                                                                                         \
            for (int64_t g0 = 0; g0 < G; g0 += 3) {                                                       \
                const float *qg = qb + g0 * D;                                                            \
                float *pg = p + g0 * Lp + l0;                                                             \
                switch (G - g0 < 3 ? G - g0 : 3) {                                                        \
                case 1: NAME##_scores(qg, 1, kr, D, scale, pg, Lp); break;                                \
                case 2: NAME##_scores(qg, 2, kr, D, scale, pg, Lp); break;                                \
                default: NAME##_scores(qg, 3, kr, D, scale, pg, Lp); break;                               \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        float inv[G];                                                                                     \
        decode_softmax(p, G, L, Lp, inv);                                                                 \
        float *ob = out + (b * H + hk * G) * D;                                                           \
        for (int64_t g0 = 0; g0 < G; g0 += 3) {                                                           \
            int gb = G - g0 < 3 ? (int)(G - g0) : 3;                                                      \
            const float *pg = p + g0 * Lp;                                                                \
            float *o = ob + g0 * D;                                                                       \
            NAME##_values_all(vc, off, L, gb, pg, Lp, inv + g0, o, D);                                    \
        }                                                                                                 \
    }                                                                                                     \
}

/* One query token per sequence over its paged K/V, read in place through its block table
   (paged_decode_attention[_f16] below take this AVX2 kernel, or its AVX-512 twin where the CPU
   has AVX512F and D % 16 == 0).
   q: B rows of [H, D], q_stride floats apart (H * D: contiguous; a step's Q/K/V rows: their Q
   heads in place); out: [B, H, D]; kc, vc: [num_blocks, bs, Hkv, D] of float32 (paged_decode_attention) or
   float16 (paged_decode_attention_f16, converted as loaded); tables: [B, max_nb]; ctx: [B].
   Query head h uses KV head h / (H / Hkv). D % 8 == 0. Each (sequence, KV head) is one task:
   the offsets of its L cached rows (walked block by block, no division per row), scores for
   its G query heads, softmax, then the probability-weighted sum of V rows. Query heads go
   three at a time through both passes, so each K or V value is loaded and converted once for
   the three: scores for two key rows at a time (6 FMA chains; 4 keys' sums of a head in two
   levels of horizontal adds), V 16 lanes at a time (6 accumulators). Every accumulator stays
   in one of AVX2's 16 registers: with 12 (4 keys, 32 lanes) one was spilled to the stack
   and its store-load chain took a fifth of the time. 2-core Zen 4, float16 cache, 30 layers
   against the kernel that converted K and V once per query head: 16 rows at context 100 in
   L3 1.72 -> 1.35 ms, from memory 3.1 -> 3.0 ms; one row at 400 in L2 0.66 -> 0.51 ms; in
   16-stream decoding, K/V from memory, ~3% (A/B in one process). K rows are prefetched 16
   keys ahead and V rows 8 ahead: a head's row is 128 bytes every 384 (float16, 3 KV heads)
   scattered over the sequence's blocks, which the hardware prefetcher does not run ahead of
   (16 decode rows at context 100: 7.1 -> 5.8 ms; one row at 1,000: 4.6 -> 3.3 ms). The K pass
   also fetches the same keys' V rows into L2, 16 ahead, so the V pass after the softmax finds
   them there (2-core AMX Xeon, float16 cache, 30 layers' caches in turn: 64 rows at context
   64-128 16.0 -> 13.7 ms, 16 rows at 200-400 9.3 -> 8.3, one row at 1,000 2.43 -> 2.18). */
#define PAGED_DECODE_ATTENTION(NAME, T, LOAD)                                                             \
static inline __attribute__((always_inline)) void NAME##_pair(                                            \
        const float *qg, int gb, const T *k0, const T *k1, int64_t D, __m256 *h) {                        \
    __m256 a[3][2];                                                                                       \
    for (int j = 0; j < 3; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();                                  \
    for (int64_t d = 0; d < D; d += 8) {                                                                  \
        __m256 x0 = LOAD(k0 + d), x1 = LOAD(k1 + d);                                                      \
        for (int j = 0; j < gb; j++) {                                                                    \
            __m256 qv = _mm256_loadu_ps(qg + j * D + d);                                                  \
            a[j][0] = _mm256_fmadd_ps(qv, x0, a[j][0]);                                                   \
            a[j][1] = _mm256_fmadd_ps(qv, x1, a[j][1]);                                                   \
        }                                                                                                 \
    }                                                                                                     \
    for (int j = 0; j < gb; j++) h[j] = _mm256_hadd_ps(a[j][0], a[j][1]);                                 \
}                                                                                                         \
                                                                                                          \
/* scores of gb query heads (rows qg) against 4 key rows, scaled, into p[j * Lp + 0..3] */               \
static inline __attribute__((always_inline)) void NAME##_scores(                                          \
        const float *qg, int gb, const T *const *kr, int64_t D, float scale, float *p, int64_t Lp) {      \
    __m256 h01[3], h23[3];                                                                                \
    NAME##_pair(qg, gb, kr[0], kr[1], D, h01);                                                            \
    NAME##_pair(qg, gb, kr[2], kr[3], D, h23);                                                            \
    for (int j = 0; j < gb; j++) {                                                                        \
        __m256 h = _mm256_hadd_ps(h01[j], h23[j]);                                                        \
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));                    \
        _mm_storeu_ps(p + j * Lp, _mm_mul_ps(s, _mm_set1_ps(scale)));                                     \
    }                                                                                                     \
}                                                                                                         \
                                                                                                          \
/* out[j][d0 + 8i] for the gb heads from p (their probabilities, unnormalized), dn chunks of 8 */        \
static inline __attribute__((always_inline)) void NAME##_values(                                          \
        const T *vc, const int64_t *off, int64_t L, int64_t d0, int gb, int dn, const float *p,           \
        int64_t Lp, const float *inv, float *o, int64_t D) {                                              \
    __m256 acc[3][2];                                                                                     \
    for (int j = 0; j < 3; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();                              \
    for (int64_t l = 0; l < L; l++) {                                                                     \
        const T *vr = vc + off[l] + d0;                                                                   \
        if (d0 * sizeof(T) % 128 == 0)  /* prefetch_row covers 128 bytes */                               \
            prefetch_row(vc + off[l + 8 < L ? l + 8 : l] + d0);                                           \
        __m256 v[2];                                                                                      \
        for (int i = 0; i < dn; i++) v[i] = LOAD(vr + 8 * i);                                             \
        for (int j = 0; j < gb; j++) {                                                                    \
            __m256 w = _mm256_broadcast_ss(p + j * Lp + l);                                               \
            for (int i = 0; i < dn; i++) acc[j][i] = _mm256_fmadd_ps(w, v[i], acc[j][i]);                 \
        }                                                                                                 \
    }                                                                                                     \
    for (int j = 0; j < gb; j++)                                                                          \
        for (int i = 0; i < dn; i++)                                                                      \
            _mm256_storeu_ps(o + j * D + d0 + 8 * i, _mm256_mul_ps(acc[j][i], _mm256_set1_ps(inv[j])));   \
}                                                                                                         \
                                                                                                          \
/* the gb heads' outputs: V 16 dimensions a pass over the keys (then 8) */                                \
static inline __attribute__((always_inline)) void NAME##_values_all(                                      \
        const T *vc, const int64_t *off, int64_t L, int gb, const float *p, int64_t Lp,                   \
        const float *inv, float *o, int64_t D) {                                                          \
    int64_t d0 = 0;                                                                                       \
    for (; d0 + 16 <= D; d0 += 16)                                                                        \
        switch (gb) {                                                                                     \
        case 1: NAME##_values(vc, off, L, d0, 1, 2, p, Lp, inv, o, D); break;                             \
        case 2: NAME##_values(vc, off, L, d0, 2, 2, p, Lp, inv, o, D); break;                             \
        default: NAME##_values(vc, off, L, d0, 3, 2, p, Lp, inv, o, D); break;                            \
        }                                                                                                 \
    for (; d0 < D; d0 += 8)                                                                               \
        switch (gb) {                                                                                     \
        case 1: NAME##_values(vc, off, L, d0, 1, 1, p, Lp, inv, o, D); break;                             \
        case 2: NAME##_values(vc, off, L, d0, 2, 1, p, Lp, inv, o, D); break;                             \
        default: NAME##_values(vc, off, L, d0, 3, 1, p, Lp, inv, o, D); break;                            \
        }                                                                                                 \
}                                                                                                         \
                                                                                                          \
PAGED_DECODE_TASKS(NAME, T, )

#define LOAD_F32(ptr) _mm256_loadu_ps(ptr)
#define LOAD_F16(ptr) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ptr)))
PAGED_DECODE_ATTENTION(paged_decode_attention_avx2, float, LOAD_F32)
PAGED_DECODE_ATTENTION(paged_decode_attention_f16_avx2, uint16_t, LOAD_F16)

/* gu: [M, 2I] (gate columns, then up columns) -> out: [M, I] = silu(gate) * up; both float32,
   or both bfloat16 (bf16: computed in float32 from the widened values, then rounded).
   silu_mul takes silu_mul_avx512 where the CPU has AVX512-BF16 (and no cap forbids it): the same operations on 16
   lanes (the same bits; a NaN stays a NaN), rounding to bfloat16 in one instruction instead of
   ten; 1,024 x 1,536 on a 2-core Zen 4: 0.67 -> 0.33 ms in bfloat16, 0.47 -> 0.35 in float32. */
void silu_mul_avx2(const void *gu, void *out, int64_t M, int64_t I, int bf16) {
    #pragma omp parallel for schedule(dynamic, ROW_RUN) if (M * I >= PARALLEL_MIN_ELEMS)
    for (int64_t m = 0; m < M; m++) {
        int64_t g = m * 2 * I, u = g + I, o = m * I;
        int64_t k = 0;
        for (; k + 8 <= I; k += 8) {
            __m256 gv = load8(gu, g + k, bf16);
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            store8(out, o + k, _mm256_mul_ps(s, load8(gu, u + k, bf16)), bf16);
        }
        for (; k < I; k++) {
            float gk = load1(gu, g + k, bf16);
            store1(out, o + k, gk / (1.0f + expf(-gk)) * load1(gu, u + k, bf16), bf16);
        }
    }
}

#define TARGET_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

#include "silu512.h"

TARGET_AVX512BF16 static inline __m512 load16(const void *row, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)row + i);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

TARGET_AVX512BF16 void silu_mul_avx512(const void *gu, void *out, int64_t M, int64_t I, int bf16) {
    #pragma omp parallel for schedule(dynamic, ROW_RUN) if (M * I >= PARALLEL_MIN_ELEMS)
    for (int64_t m = 0; m < M; m++) {
        int64_t g = m * 2 * I, u = g + I, o = m * I;
        int64_t k = 0;
        for (; k + 16 <= I; k += 16) {
            __m512 r = silu_mul16(load16(gu, g + k, bf16), load16(gu, u + k, bf16));
            if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + o + k), (__m256i)_mm512_cvtneps_pbh(r));
            else _mm512_storeu_ps((float *)out + o + k, r);
        }
        for (; k + 8 <= I; k += 8) {  /* as silu_mul_avx2 computes these lanes */
            __m256 gv = load8(gu, g + k, bf16);
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            store8(out, o + k, _mm256_mul_ps(sg, load8(gu, u + k, bf16)), bf16);
        }
        for (; k < I; k++) {
            float gk = load1(gu, g + k, bf16);
            store1(out, o + k, gk / (1.0f + expf(-gk)) * load1(gu, u + k, bf16), bf16);
        }
    }
}

/* Whether silu_mul may take the AVX512-BF16 path: set by the loader from the flags the kernels
   may use (TOKENSERVE_CPU_ISA caps them below the CPU's), and the CPU must have it too. */
static int allow_avx512bf16 = 1;
void fused_allow_avx512bf16(int allow) { allow_avx512bf16 = allow; }

void silu_mul(const void *gu, void *out, int64_t M, int64_t I, int bf16) {
    if (allow_avx512bf16 && __builtin_cpu_supports("avx512bf16")) silu_mul_avx512(gu, out, M, I, bf16);
    else silu_mul_avx2(gu, out, M, I, bf16);
}

/* paged_decode_attention on AVX-512 (D % 16 == 0; paged_decode_attention picks it where the
   CPU has AVX512F and no cap forbids it): the same passes on 16 lanes. Scores: four keys x
   three query heads a pass over d (12 FMA chains), each chain's lanes summed by unpack-adds;
   values: up to 64 dimensions (4 x 16 lanes) of the three heads' outputs a pass over the keys,
   so each V row is loaded and converted once (the AVX2 kernel passes over the keys once per 16
   dimensions). K rows are prefetched 16 keys ahead into L1 with their V rows into L2, V rows
   8 ahead into L1, as there. Each row's result is one fixed order of operations whatever the
   batch; it differs from the AVX2 kernel's in the last bits (lane sums in another order).
   2-core AMX Xeon, float16 cache, 30 layers' caches in turn, against the AVX2 kernel: 64 rows
   at context 64-128 7.4 -> 6.2 ms (~22 GB/s of K/V: the memory's pace), 16 rows at 200-400
   5.3 -> 4.3, one row at 1,000 1.27 -> 1.03; head_dim 128: 19.9 -> 15.6. */
#define PAGED_DECODE_ATTENTION_512(NAME, T, LOAD)                                                         \
TARGET_AVX512 static inline __attribute__((always_inline)) void NAME##_scores(                            \
        const float *qg, int gb, const T *const *kr, int64_t D, float scale, float *p, int64_t Lp) {      \
    __m512 a[3][4];                                                                                       \
    for (int j = 0; j < 3; j++) for (int i = 0; i < 4; i++) a[j][i] = _mm512_setzero_ps();                \
    for (int64_t d = 0; d < D; d += 16) {                                                                 \
        __m512 k0 = LOAD(kr[0] + d), k1 = LOAD(kr[1] + d), k2 = LOAD(kr[2] + d), k3 = LOAD(kr[3] + d);    \
        for (int j = 0; j < gb; j++) {                                                                    \
            __m512 qv = _mm512_loadu_ps(qg + j * D + d);                                                  \
            a[j][0] = _mm512_fmadd_ps(qv, k0, a[j][0]);                                                   \
            a[j][1] = _mm512_fmadd_ps(qv, k1, a[j][1]);                                                   \
            a[j][2] = _mm512_fmadd_ps(qv, k2, a[j][2]);                                                   \
            a[j][3] = _mm512_fmadd_ps(qv, k3, a[j][3]);                                                   \
        }                                                                                                 \
    }                                                                                                     \
    for (int j = 0; j < gb; j++) {  /* each chain's lanes summed: 4 vectors -> 4 sums */                              \
        __m512 u01 = _mm512_add_ps(_mm512_unpacklo_ps(a[j][0], a[j][1]), _mm512_unpackhi_ps(a[j][0], a[j][1])); \
        __m512 u23 = _mm512_add_ps(_mm512_unpacklo_ps(a[j][2], a[j][3]), _mm512_unpackhi_ps(a[j][2], a[j][3])); \
        __m512 w = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u01), _mm512_castps_pd(u23))), \
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u01), _mm512_castps_pd(u23)))); \
        __m256 h = _mm256_add_ps(_mm512_castps512_ps256(w), _mm512_extractf32x8_ps(w, 1));                 \
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));                    \
        _mm_storeu_ps(p + j * Lp, _mm_mul_ps(s, _mm_set1_ps(scale)));                                     \
    }                                                                                                     \
}                                                                                                         \
                                                                                                          \
TARGET_AVX512 static inline __attribute__((always_inline)) void NAME##_values(                            \
        const T *vc, const int64_t *off, int64_t L, int64_t d0, int gb, int nv, const float *p,           \
        int64_t Lp, const float *inv, float *o, int64_t D) {                                              \
    __m512 acc[3][4];                                                                                     \
    for (int j = 0; j < 3; j++) for (int i = 0; i < 4; i++) acc[j][i] = _mm512_setzero_ps();              \
    for (int64_t l = 0; l < L; l++) {                                                                     \
        const T *vr = vc + off[l] + d0;                                                                   \
        const char *pf = (const char *)(vc + off[l + 8 < L ? l + 8 : l] + d0);                            \
        for (int b = 0; b < nv * 16 * (int)sizeof(T); b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);         \
        __m512 v[4];                                                                                      \
        for (int i = 0; i < nv; i++) v[i] = LOAD(vr + 16 * i);                                            \
        for (int j = 0; j < gb; j++) {                                                                    \
            __m512 w = _mm512_set1_ps(p[j * Lp + l]);                                                     \
            for (int i = 0; i < nv; i++) acc[j][i] = _mm512_fmadd_ps(w, v[i], acc[j][i]);                 \
        }                                                                                                 \
    }                                                                                                     \
    for (int j = 0; j < gb; j++)                                                                          \
        for (int i = 0; i < nv; i++)                                                                      \
            _mm512_storeu_ps(o + j * D + d0 + 16 * i, _mm512_mul_ps(acc[j][i], _mm512_set1_ps(inv[j])));  \
}                                                                                                         \
                                                                                                          \
/* the gb heads' outputs: V up to 64 dimensions (4 x 16 lanes) a pass over the keys */                    \
TARGET_AVX512 static inline __attribute__((always_inline)) void NAME##_values_all(                        \
        const T *vc, const int64_t *off, int64_t L, int gb, const float *p, int64_t Lp,                   \
        const float *inv, float *o, int64_t D) {                                                          \
    for (int64_t d0 = 0; d0 < D; d0 += 64) {                                                              \
        int nv = D - d0 >= 64 ? 4 : (int)(D - d0) / 16;                                                   \
        switch (gb * 4 + nv) {                                                                            \
        case 5: NAME##_values(vc, off, L, d0, 1, 1, p, Lp, inv, o, D); break;                             \
        case 6: NAME##_values(vc, off, L, d0, 1, 2, p, Lp, inv, o, D); break;                             \
        case 7: NAME##_values(vc, off, L, d0, 1, 3, p, Lp, inv, o, D); break;                             \
        case 8: NAME##_values(vc, off, L, d0, 1, 4, p, Lp, inv, o, D); break;                             \
        case 9: NAME##_values(vc, off, L, d0, 2, 1, p, Lp, inv, o, D); break;                             \
        case 10: NAME##_values(vc, off, L, d0, 2, 2, p, Lp, inv, o, D); break;                            \
        case 11: NAME##_values(vc, off, L, d0, 2, 3, p, Lp, inv, o, D); break;                            \
        case 12: NAME##_values(vc, off, L, d0, 2, 4, p, Lp, inv, o, D); break;                            \
        case 13: NAME##_values(vc, off, L, d0, 3, 1, p, Lp, inv, o, D); break;                            \
        case 14: NAME##_values(vc, off, L, d0, 3, 2, p, Lp, inv, o, D); break;                            \
        case 15: NAME##_values(vc, off, L, d0, 3, 3, p, Lp, inv, o, D); break;                            \
        default: NAME##_values(vc, off, L, d0, 3, 4, p, Lp, inv, o, D); break;                            \
        }                                                                                                 \
    }                                                                                                     \
}                                                                                                         \
                                                                                                          \
PAGED_DECODE_TASKS(NAME, T, TARGET_AVX512)
#define LOAD16_F32(ptr) _mm512_loadu_ps(ptr)
#define LOAD16_F16(ptr) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ptr)))
PAGED_DECODE_ATTENTION_512(paged_decode_attention_avx512, float, LOAD16_F32)
PAGED_DECODE_ATTENTION_512(paged_decode_attention_f16_avx512, uint16_t, LOAD16_F16)

/* Whether paged_decode_attention may take its AVX-512 kernel: set by the loader from the flags
   the kernels may use (TOKENSERVE_CPU_ISA caps them below the CPU's); the CPU must have it too. */
static int allow_avx512 = 1;
void fused_allow_avx512(int allow) { allow_avx512 = allow; }

#define PAGED_DECODE_DISPATCH(NAME, T)                                                                    \
void NAME(const float *q, const T *kc, const T *vc, const int64_t *tables, const int64_t *ctx,            \
          float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t max_nb,           \
          float scale, int64_t q_stride) {                                                                \
    if (allow_avx512 && D % 16 == 0 && __builtin_cpu_supports("avx512f"))                                 \
        NAME##_avx512(q, kc, vc, tables, ctx, out, B, H, Hkv, D, bs, max_nb, scale, q_stride);            \
    else                                                                                                  \
        NAME##_avx2(q, kc, vc, tables, ctx, out, B, H, Hkv, D, bs, max_nb, scale, q_stride);              \
}
PAGED_DECODE_DISPATCH(paged_decode_attention, float)
PAGED_DECODE_DISPATCH(paged_decode_attention_f16, uint16_t)

/* Index of the first largest value of each row of x: [M, V], with torch.argmax's rules: ties
   go to the first index, and a NaN counts as the largest value (the first NaN wins). */
void argmax_rows(const float *x, int64_t *out, int64_t M, int64_t V) {
    #pragma omp parallel for schedule(dynamic) if (M * V >= PARALLEL_MIN_ELEMS)
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * V;
        int64_t v = 0, best;
        float bv = r[0];
        int nan = r[0] != r[0];
        if (V >= 8) {  /* vector pass for the maximum (and any NaN), then its first index */
            __m256 mx = _mm256_loadu_ps(r);
            __m256 un = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
            for (v = 8; v + 8 <= V; v += 8) {
                __m256 xv = _mm256_loadu_ps(r + v);
                un = _mm256_or_ps(un, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
                mx = _mm256_max_ps(mx, xv);
            }
            nan |= _mm256_movemask_ps(un) != 0;
            float t[8];
            _mm256_storeu_ps(t, mx);
            for (int i = 0; i < 8; i++) bv = t[i] > bv ? t[i] : bv;
        }
        for (; v < V; v++) {
            nan |= r[v] != r[v];
            bv = r[v] > bv ? r[v] : bv;
        }
        if (nan)
            for (best = 0; r[best] == r[best]; best++) {}
        else
            for (best = 0; r[best] != bv; best++) {}
        out[m] = best;
    }
}

/* x: [M, K] float32 (updated in place with delta when delta != 0), w: [K], out: [M, K]. K % 8
   == 0. delta is float32, or bfloat16 with delta_bf16; out float32, or bfloat16 with out_bf16
   (rounded from the float32 result). */
void add_rmsnorm(float *x, const void *delta, int delta_bf16, const float *w, void *out, int out_bf16,
                 int64_t M, int64_t K, float eps) {
    #pragma omp parallel for schedule(dynamic, ROW_RUN) if (M * K >= PARALLEL_MIN_ELEMS)
    for (int64_t m = 0; m < M; m++) {
        float *xr = x + m * K;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            if (delta) {
                v = _mm256_add_ps(v, load8(delta, m * K + k, delta_bf16));
                _mm256_storeu_ps(xr + k, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        float r = 1.0f / sqrtf(hsum(ss) / (float)K + eps);
        __m256 rv = _mm256_set1_ps(r);
        for (int64_t k = 0; k < K; k += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + k), rv);
            store8(out, m * K + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), v), out_bf16);
        }
    }
}

/* RoPE on a step's query and key heads, in place, then its keys and values into their cache
   slots (one pass instead of torch's roll, multiply, addcmul, two conversions and two
   index copies per layer).
   qkv: [T, (H + 2 Hkv) * D] float32, rows contiguous: H query heads, Hkv key heads, Hkv
   value heads. cos, sin: [P, D] (rotate-half layout, sin's first half negated); pos: [T].
   Head x becomes x * cos + roll(x, D / 2) * sin, rounded as torch's addcmul over x * cos
   rounds it (x * cos, then one fused multiply-add). kc, vc: the layer's cache, [slots, Hkv, D] of
   float32, or float16 when f16 (converted to nearest); slots: [T]. D % 16 == 0. */
__attribute__((optimize("fp-contract=off")))
void rope_write_kv(float *qkv, const int64_t *pos, const float *cos, const float *sin,
                   const int64_t *slots, void *kc, void *vc, int f16, int64_t T, int64_t H,
                   int64_t Hkv, int64_t D) {
    int64_t width = (H + 2 * Hkv) * D, half = D / 2, kv = Hkv * D;
    #pragma omp parallel for schedule(dynamic, ROW_RUN) if (T * width >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * width;
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t h = 0; h < H + Hkv; h++) {
            float *x = row + h * D;
            for (int64_t i = 0; i < half; i += 8) {
                __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
                __m256 nlo = _mm256_fmadd_ps(hi, _mm256_loadu_ps(s + i), _mm256_mul_ps(lo, _mm256_loadu_ps(c + i)));
                __m256 nhi = _mm256_fmadd_ps(lo, _mm256_loadu_ps(s + half + i),
                                             _mm256_mul_ps(hi, _mm256_loadu_ps(c + half + i)));
                _mm256_storeu_ps(x + i, nlo);
                _mm256_storeu_ps(x + half + i, nhi);
            }
        }
        const float *k = row + H * D, *v = k + kv;
        int64_t at = slots[t] * kv;
        if (f16) {
            uint16_t *kd = (uint16_t *)kc + at, *vd = (uint16_t *)vc + at;
            for (int64_t i = 0; i < kv; i += 8) {
                _mm_storeu_si128((__m128i *)(kd + i), _mm256_cvtps_ph(_mm256_loadu_ps(k + i), _MM_FROUND_TO_NEAREST_INT));
                _mm_storeu_si128((__m128i *)(vd + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
            }
        } else {
            float *kd = (float *)kc + at, *vd = (float *)vc + at;
            for (int64_t i = 0; i < kv; i += 8) {
                _mm256_storeu_ps(kd + i, _mm256_loadu_ps(k + i));
                _mm256_storeu_ps(vd + i, _mm256_loadu_ps(v + i));
            }
        }
    }
}

/* The layers of a decode step in one call (model.py's forward, from the first layer's input
   norm on): each layer's kernels in the order, and with the arguments, forward's Python calls
   them with, so the results are the same bits; what this saves is the Python between them
   (~270 calls a step of about 12 us each: a 16-row step's 3 ms, a lone stream's third).
   Every linear is a GGUF kernel of gguf_linear.c or gguf_interleaved.c (one signature);
   `fn` is its address. Rows are decode rows only (each its own context, ctx[t]). */
typedef int (*dl_linear_fn)(int fmt, const float *x, const void *w, float *y, int64_t M, int64_t N,
                            int64_t K);
struct dl_linear { dl_linear_fn fn; int64_t fmt; const void *w; int64_t n, k; };
struct dl_layer {
    struct dl_linear qkv, o, gate_up, down;
    const float *attn_norm, *ffn_norm;
    void *cache_k, *cache_v;  /* [num_blocks, block_size, Hkv, D], float16 or float32 */
    /* gate_up's multiply and silu_mul in one call (the same bits), where its kernel has one:
       fn 0 otherwise */
    struct dl_linear swiglu;
};
struct dl_model {
    const struct dl_layer *layers;
    int64_t num_layers, hidden, heads, kv_heads, head_dim, block_size, cache_f16;
    const float *cos, *sin;  /* rope tables, [P, D] */
    double eps, scale;       /* as the float32 the Python calls pass */
    /* gguf_interleaved.c's gguf_il16_prefetch_next where the Q/K/V multiply is that kernel
       (it then prefetches the layer's K/V rows for the attention after it), else 0 */
    void (*prefetch_next)(const char *const *rows, int64_t n, int64_t lines);
};

/* The addresses of the K and V rows (all KV heads of a position) the attention of a layer
   reads: every row's context, each sequence once (a speculative chunk's rows share blocks
   and grow by one position). Returns how many. */
static int64_t dl_kv_rows(const struct dl_model *m, const struct dl_layer *L, int64_t T,
                          const int64_t *tables, const int64_t *ctx, int64_t max_nb, const char **rows) {
    int64_t bs = m->block_size, row = m->kv_heads * m->head_dim * (m->cache_f16 ? 2 : 4), n = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t *table = tables + t * max_nb;
        int64_t from = t > 0 && table[0] == table[-max_nb] ? ctx[t - 1] : 0;
        for (int64_t l = from; l < ctx[t]; l++) {
            int64_t at = (table[l / bs] * bs + l % bs) * row;
            rows[n++] = (const char *)L->cache_k + at;
            rows[n++] = (const char *)L->cache_v + at;
        }
    }
    return n;
}

static inline int dl_mm(const struct dl_linear *l, const float *x, float *y, int64_t M) {
    return l->fn((int)l->fmt, x, l->w, y, M, l->n, l->k);
}

/* Layers [first, last) on T decode rows. x: [T, hidden] residual stream, updated in place; h:
   [T, hidden], on entry layer `first`'s normed input, on return the next layer's (after the
   last layer x holds the final residual and h is left as it was). pos, slots, ctx: [T];
   tables: [T, max_nb]. Returns 0, or what a linear returned (nonzero: it refused). */
int decode_layers(const struct dl_model *m, int64_t first, int64_t last, float *x, float *h, int64_t T,
                  const int64_t *pos, const int64_t *slots, const int64_t *tables, const int64_t *ctx,
                  int64_t max_nb) {
    int64_t E = m->hidden, H = m->heads, Hkv = m->kv_heads, D = m->head_dim;
    int64_t width = (H + 2 * Hkv) * D, inter = m->layers[first].gate_up.n / 2;
    float eps = (float)m->eps, scale = (float)m->scale;
    float *qkv = malloc(sizeof(float) * T * width);
    float *attn = malloc(sizeof(float) * T * H * D), *delta = malloc(sizeof(float) * T * E);
    float *gu = malloc(sizeof(float) * T * 2 * inter), *act = malloc(sizeof(float) * T * inter);
    int64_t row_bytes = m->kv_heads * D * (m->cache_f16 ? 2 : 4), positions = 0;
    for (int64_t t = 0; t < T; t++) positions += ctx[t];
    const char **rows = m->prefetch_next ? malloc(sizeof(char *) * 2 * positions) : 0;
    int rc = (qkv && attn && delta && gu && act && (rows || !m->prefetch_next)) ? 0 : -2;
    for (int64_t i = first; i < last && !rc; i++) {
        const struct dl_layer *L = m->layers + i;
        if (rows)
            m->prefetch_next(rows, dl_kv_rows(m, L, T, tables, ctx, max_nb, rows), (row_bytes + 63) / 64);
        if ((rc = dl_mm(&L->qkv, h, qkv, T))) break;
        rope_write_kv(qkv, pos, m->cos, m->sin, slots, L->cache_k, L->cache_v, (int)m->cache_f16, T, H, Hkv, D);
        if (m->cache_f16)  /* the query heads read in place, in qkv's rows */
            paged_decode_attention_f16(qkv, L->cache_k, L->cache_v, tables, ctx, attn, T, H, Hkv, D,
                                       m->block_size, max_nb, scale, width);
        else
            paged_decode_attention(qkv, L->cache_k, L->cache_v, tables, ctx, attn, T, H, Hkv, D,
                                   m->block_size, max_nb, scale, width);
        if ((rc = dl_mm(&L->o, attn, delta, T))) break;
        add_rmsnorm(x, delta, 0, L->ffn_norm, h, 0, T, E, eps);
        if (L->swiglu.fn) {
            if ((rc = dl_mm(&L->swiglu, h, act, T))) break;
        } else {
            if ((rc = dl_mm(&L->gate_up, h, gu, T))) break;
            silu_mul(gu, act, T, inter, 0);
        }
        if ((rc = dl_mm(&L->down, act, delta, T))) break;
        if (i + 1 < m->num_layers)
            add_rmsnorm(x, delta, 0, m->layers[i + 1].attn_norm, h, 0, T, E, eps);
        else
            for (int64_t j = 0; j < T * E; j++) x[j] += delta[j];
    }
    free(qkv); free(attn); free(delta); free(gu); free(act); free(rows);
    return rc;
}

/* Prompt rows' attention on AVX-512 (cpu_kernels.prompt_attention; the CPU has AVX512F and no
   cap forbids it): what paged_decode_attention gives each prompt row (its query against the
   cache up to its own position, the row's K/V written first), computed for blocks of a
   chunk's rows at once instead of row by row. groups: [NG, 2] (first row, rows), each a run
   of one chunk's consecutive rows (row i's context is the first's + i), their block tables
   alike. A task is one KV head of up to PA_J / G consecutive rows of a group: its PA_J query
   vectors (rows x the head's G query heads) transposed to qt [D][PA_J], the keys and values
   up to the last row's context widened to float32 once, then
     scores  s[l][j] = scale * q_j . k_l: four keys x 48 queries a pass over d (12 FMA chains,
             a key's value broadcast: no horizontal sums), -inf past row j's context;
     softmax along l for all 48 queries at once (max, exp, sum as 16-lane vectors);
     values  o_j = sum_l p[l][j] v_l / sum_j: QC queries x D lanes of accumulators.
   Each row's result is its own arithmetic in a fixed order (d, then l), whichever block or
   batch it is computed in: keys past a row's context weigh exactly 0. 2-core Xeon (AMX
   machine), 16 prompts of 64 tokens, float16 cache, 30 layers: 49 -> 27 ms (row by row -> this). */
#define PA_J 48

TARGET_AVX512 static inline __m512 pa_load16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
TARGET_AVX512 static inline __m512 pa_load16f(const float *p) { return _mm512_loadu_ps(p); }

/* o_j for queries j0 .. j0 + QC - 1 (DV vectors of 16 lanes each) over keys [0, L) */
#define PA_VALUES(DV, QC)                                                                               \
TARGET_AVX512 static inline __attribute__((always_inline)) void pa_values_##DV(                         \
        const float *vf, const float *p, int64_t L, int64_t j0, int64_t nq, const float *inv,           \
        float *const *o) {                                                                              \
    __m512 acc[QC][DV];                                                                                 \
    for (int j = 0; j < QC; j++)                                                                        \
        for (int v = 0; v < DV; v++) acc[j][v] = _mm512_setzero_ps();                                   \
    for (int64_t l = 0; l < L; l++) {                                                                   \
        __m512 vv[DV];                                                                                  \
        for (int v = 0; v < DV; v++) vv[v] = _mm512_loadu_ps(vf + l * DV * 16 + 16 * v);                \
        for (int j = 0; j < QC; j++) {                                                                  \
            __m512 w = _mm512_set1_ps(p[l * PA_J + j0 + j]);                                            \
            for (int v = 0; v < DV; v++) acc[j][v] = _mm512_fmadd_ps(w, vv[v], acc[j][v]);              \
        }                                                                                               \
    }                                                                                                   \
    for (int j = 0; j < QC && j < nq; j++)                                                              \
        for (int v = 0; v < DV; v++)                                                                    \
            _mm512_storeu_ps(o[j] + 16 * v, _mm512_mul_ps(acc[j][v], _mm512_set1_ps(inv[j0 + j])));     \
}
PA_VALUES(2, 12)
PA_VALUES(4, 6)
PA_VALUES(8, 3)

#define PROMPT_ATTENTION(NAME, T, LOAD)                                                                 \
TARGET_AVX512 void NAME(const float *q, const T *kc, const T *vc, const int64_t *tables,                \
                        const int64_t *ctx, const int64_t *groups, int64_t NG, float *out, int64_t H,   \
                        int64_t Hkv, int64_t D, int64_t bs, int64_t max_nb, float scale,                \
                        int64_t q_stride) {                                                             \
    int64_t G = H / Hkv, RB = PA_J / G, row = Hkv * D, DV = D / 16, nt = 0;                             \
    for (int64_t g = 0; g < NG; g++) nt += (groups[2 * g + 1] + RB - 1) / RB;                            \
    int64_t *tasks = malloc(sizeof(int64_t) * 2 * (nt ? nt : 1));                                       \
    if (!tasks) return;                                                                                 \
    for (int64_t g = 0, t = 0; g < NG; g++)                                                             \
        for (int64_t r = 0; r < groups[2 * g + 1]; r += RB, t++) {                                      \
            tasks[2 * t] = groups[2 * g] + r;                                                           \
            tasks[2 * t + 1] = groups[2 * g + 1] - r < RB ? groups[2 * g + 1] - r : RB;                 \
        }                                                                                               \
    _Pragma("omp parallel for schedule(dynamic)")                                                       \
    for (int64_t task = 0; task < nt * Hkv; task++) {                                                   \
        int64_t r0 = tasks[2 * (task / Hkv)], nr = tasks[2 * (task / Hkv) + 1], hk = task % Hkv;        \
        int64_t c0 = ctx[r0], L = ctx[r0 + nr - 1], L4 = (L + 3) & ~(int64_t)3, J = nr * G;             \
        const int64_t *table = tables + (r0 + nr - 1) * max_nb;                                         \
        float *qt = scratch(sizeof(float) * (D * PA_J + 2 * L4 * D + L4 * PA_J + PA_J));                \
        float *kf = qt + D * PA_J, *vf = kf + L4 * D, *s = vf + L4 * D, *inv = s + L4 * PA_J;           \
        {   /* qt[d][j] = q_j[d]: lanes gathered from the query rows (past J: zeros) */                \
            __m512i at[3];                                                                              \
            __mmask16 in[3];                                                                            \
            for (int v = 0; v < 3; v++) {                                                               \
                int32_t a[16];                                                                          \
                for (int i = 0, j = 16 * v; i < 16; i++, j++)                                           \
                    a[i] = j < J ? (int32_t)((r0 + j / G) * q_stride + (hk * G + j % G) * D) : 0;        \
                at[v] = _mm512_loadu_si512((const void *)a);                                            \
                in[v] = 16 * v >= J ? 0 : J - 16 * v >= 16 ? 0xFFFF : (__mmask16)((1u << (J - 16 * v)) - 1); \
            }                                                                                           \
            for (int64_t d = 0; d < D; d++)                                                             \
                for (int v = 0; v < 3; v++)                                                             \
                    _mm512_storeu_ps(qt + d * PA_J + 16 * v, _mm512_mask_i32gather_ps(                  \
                        _mm512_setzero_ps(), in[v], at[v], q + d, 4));                                  \
        }                                                                                               \
        for (int64_t l = 0, blk = 0; l < L; blk++)                                                      \
            for (int64_t i = 0; i < bs && l < L; i++, l++) {                                            \
                int64_t off = (table[blk] * bs + i) * row + hk * D;                                     \
                for (int64_t v = 0; v < DV; v++) {                                                      \
                    _mm512_storeu_ps(kf + l * D + 16 * v, LOAD(kc + off + 16 * v));                     \
                    _mm512_storeu_ps(vf + l * D + 16 * v, LOAD(vc + off + 16 * v));                     \
                }                                                                                       \
            }                                                                                           \
        for (int64_t l = L; l < L4; l++)                                                                \
            for (int64_t d = 0; d < D; d++) kf[l * D + d] = 0.0f;                                       \
        /* lane j's row (past J: a row no key is masked for) */                                        \
        __m512i rowj[3];                                                                                \
        for (int v = 0; v < 3; v++) {                                                                   \
            int32_t r[16];                                                                              \
            for (int i = 0; i < 16; i++) r[i] = 16 * v + i < J ? (int32_t)((16 * v + i) / G) : 1 << 30;  \
            rowj[v] = _mm512_loadu_si512((const void *)r);                                              \
        }                                                                                               \
        const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);                      \
        for (int64_t l0 = 0; l0 < L; l0 += 4) {                                                         \
            __m512 a[4][3];                                                                             \
            for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = a[i][2] = _mm512_setzero_ps();              \
            const float *k0 = kf + l0 * D;                                                              \
            for (int64_t d = 0; d < D; d++) {                                                           \
                __m512 q0 = _mm512_loadu_ps(qt + d * PA_J), q1 = _mm512_loadu_ps(qt + d * PA_J + 16);   \
                __m512 q2 = _mm512_loadu_ps(qt + d * PA_J + 32);                                        \
                for (int i = 0; i < 4; i++) {                                                           \
                    __m512 kb = _mm512_set1_ps(k0[i * D + d]);                                          \
                    a[i][0] = _mm512_fmadd_ps(q0, kb, a[i][0]);                                         \
                    a[i][1] = _mm512_fmadd_ps(q1, kb, a[i][1]);                                         \
                    a[i][2] = _mm512_fmadd_ps(q2, kb, a[i][2]);                                         \
                }                                                                                       \
            }                                                                                           \
            for (int i = 0; i < 4 && l0 + i < L; i++) {                                                 \
                __m512i past = _mm512_set1_epi32((int32_t)(l0 + i - c0));  /* key l: row r sees it    \
                                                                              when l - c0 < r */       \
                for (int v = 0; v < 3; v++) {                                                           \
                    __mmask16 seen = _mm512_cmplt_epi32_mask(past, rowj[v]);                            \
                    _mm512_storeu_ps(s + (l0 + i) * PA_J + 16 * v,                                      \
                                     _mm512_mask_blend_ps(seen, ninf, _mm512_mul_ps(a[i][v], sc)));     \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        for (int v = 0; v < 3; v++) {                                                                   \
            __m512 m = ninf, sum = _mm512_setzero_ps();                                                 \
            for (int64_t l = 0; l < L; l++) m = _mm512_max_ps(m, _mm512_loadu_ps(s + l * PA_J + 16 * v)); \
            for (int64_t l = 0; l < L; l++) {                                                           \
                __m512 x = _mm512_loadu_ps(s + l * PA_J + 16 * v);                                      \
                __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ),                \
                                               exp512(_mm512_sub_ps(x, m)));                            \
                _mm512_storeu_ps(s + l * PA_J + 16 * v, e);                                             \
                sum = _mm512_add_ps(sum, e);                                                            \
            }                                                                                           \
            _mm512_storeu_ps(inv + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));                   \
        }                                                                                               \
        int64_t QC = 24 / DV;                                                                           \
        for (int64_t j0 = 0; j0 < J; j0 += QC) {                                                        \
            float *o[12];                                                                               \
            int64_t nq = J - j0 < QC ? J - j0 : QC, last = c0 + (j0 + nq - 1) / G;                      \
            for (int64_t j = 0; j < nq; j++)                                                            \
                o[j] = out + ((r0 + (j0 + j) / G) * H + hk * G + (j0 + j) % G) * D;                     \
            if (DV == 4) pa_values_4(vf, s, last, j0, nq, inv, o);                                      \
            else if (DV == 8) pa_values_8(vf, s, last, j0, nq, inv, o);                                 \
            else pa_values_2(vf, s, last, j0, nq, inv, o);                                              \
        }                                                                                               \
    }                                                                                                   \
    free(tasks);                                                                                        \
}
PROMPT_ATTENTION(prompt_attention_avx512, float, pa_load16f)
PROMPT_ATTENTION(prompt_attention_avx512_f16, uint16_t, pa_load16)
