/* Linear layers over a GGUF file's own quantized blocks: y[m, n] = sum_k x[m, k] * w[n, k].

   Built up to five times from this one source (gguf_kernels.py picks the build the CPU runs):
     -mavx2 -mfma -mf16c                  8 float lanes (the baseline every x86 here has)
     the same plus -mavxvnni              VPDPWSSD in the 16-bit-input kernel (gguf_linear_i16),
                                          VPDPBUSD in the 8-bit-input one (gguf_linear_i8)
     -mavx512f -mavx512bw -mavx512vl ...  16 float lanes (where /proc/cpuinfo lists them), and
                                          64-byte panel tiles in gguf_linear_i16
     the same plus -mavx512vnni          their VPDPWSSD
     the same plus -mavx512bf16          also gguf_linear_bf16: bfloat16 arithmetic (at the end)

   w is read in the file's layout: row n is K / 32 consecutive blocks of the file's type.
     Q8_0 (34 bytes): f16 d, 32 x int8 q                    w = d * q
     Q4_0 (18 bytes): f16 d, 16 bytes of nibbles            w = d * (q - 8)
     Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles     w = d * q + m
     Q4_K (144 bytes per 256): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins of eight
          sub-blocks of 32, 128 bytes of nibbles           w = (d * sc) * q - dmin * mn
     Q6_K (210 bytes per 256): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
          scales (one per 16 weights), f16 d              w = (d * sc) * (q - 32)
   (Q4_0/Q4_1 nibbles: byte i holds element i in its low half and element i + 16 in its high
   half; Q4_K: sub-blocks 2g and 2g + 1 are the low and high halves of bytes 32g .. 32g + 31).
   Every format is walked in units of 32 weights ("blocks"; a Q4_K sub-block is one).
   Each weight is dequantized in registers to exactly the float32 number of the reference
   dequantizer (gguf-py: one multiply, then for Q4_1 one add, each rounded; on 16 lanes a
   4-bit block's 16 possible weights are computed so once and looked up), so the products use
   exactly the numbers the float32-dequantized model uses; only the summation order differs
   from a float32 GEMM over those weights. Where the reference adds after its multiply (Q4_1
   d * q + m, Q4_K (d * sc) * q - dmin * mn) one FMA gives its number: the product is exact in
   float32 (an f16 scale has 11 significant bits, times a 4-bit quant, times Q4_K's 6-bit sub-
   block scale, is at most 21 bits), so rounding it first changes nothing and the add's
   rounding is the only one either way. Nothing else is fused (the build has
   -ffp-contract=off).

   y[m, n] is one FMA chain over k in vector-width chunks, in order, then one horizontal sum
   in a fixed order, in every path: a row's result is bit-identical whatever M is and
   whatever tile computed it (a sequence's logits do not depend on the rest of the batch).
   For a few rows (decodes) the weights are converted as they are used; from PANEL_MIN_ROWS
   rows on, a work item's rows are dequantized once into a float panel (L1/L2-resident) that
   every tile of rows then reads. Work items (GROUP output rows) are handed out guided
   across the OpenMP team (long runs of consecutive items first, then shorter ones), so a
   preempted thread's items are taken over by the other. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define GROUP 16            /* output rows per work item */
/* From this many input rows a work item's weights are dequantized once into a float panel;
   below it they are converted as they are used (one decode row and its drafts: SmolLM2's
   3072x576 Q4_1 matrix x 30 at 4 / 6 / 8 rows 4.26 / 5.74 / 6.83 ms with the panel, 3.63 /
   5.07 / 5.79 ms without; from 12 rows on the panel is as fast or faster) */
#define PANEL_MIN_ROWS 9
/* Input rows per pass over the weights: a prompt's rows in blocks that stay in L2 (128 rows of
   K = 1536 are 768 KiB) while each work item's panel multiplies them, instead of every panel
   streaming all M rows from memory (all linears of a SmolLM2 step over 1,000 prompt rows on a
   2-core Zen 4 capped at AVX2: 2.31 -> 1.84 s; 64 / 128 / 256-row blocks alike) */
#define M_BLOCK 128
/* Rows ahead whose blocks are prefetched: a tile reads 4 rows' blocks at once, which the
   hardware prefetcher does not follow well (one row, SmolLM2's 3072x576 Q4_1 matrix x 30:
   5.1 ms without, 2.0 ms with 8 rows ahead, 3.4 ms with 16: past the work item) */
#define PREFETCH_ROWS 8
/* The same for the bfloat16 path, whose direct tiles convert each block once for up to 5 rows
   (all linears of a SmolLM2 step, 2-core Zen 4: 6 / 7 / 8 rows 13.2 / 14.3 / 16.4 ms direct,
   12.7 / 12.8 / 14.7 ms with the panel; 5 rows 9.7 vs 10.7) */
#define PANEL_MIN_ROWS_BF16 6

enum { FMT_Q8_0 = 8, FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q4_K = 12, FMT_Q6_K = 14 };

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
typedef __m512i vi;
#define vzero() _mm512_setzero_ps()
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vfms(a, b, c) _mm512_fmsub_ps(a, b, c)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vset1(a) _mm512_set1_ps(a)
#define vload(p) _mm512_loadu_ps(p)
#define vloada(p) _mm512_load_ps(p)
#define vstorea(p, v) _mm512_store_ps(p, v)
#define vcvt(i) _mm512_cvtepi32_ps(i)
#if defined(__AVX512BF16__)
#define ISA_NAME "avx512bf16"
#elif defined(__AVX512VNNI__)
#define ISA_NAME "avx512vnni"
#else
#define ISA_NAME "avx512"
#endif
static inline float vhsum(vf v) {
    __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
    return _mm_cvtss_f32(t);
}
/* chunk c (0..1) of a block: 16 signed bytes; 16 nibbles (low halves, then high halves) */
static inline vi load_i8(const uint8_t *q, int c) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + c * VW)));
}
static inline vi load_nib(const uint8_t *q, int c) {
    vi b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    return c == 0 ? _mm512_and_si512(b, _mm512_set1_epi32(15)) : _mm512_srli_epi32(b, 4);
}
#define vsub_i(a, b) _mm512_sub_epi32(a, _mm512_set1_epi32(b))
#define vsub(a, b) _mm512_sub_ps(a, b)
static inline vi load_u8(const uint8_t *q) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)); }
#define vand15(v) _mm512_and_si512(v, _mm512_set1_epi32(15))
#define vsrl4(v) _mm512_srli_epi32(v, 4)
#define vsrl(v, n) _mm512_srli_epi32(v, n)
#define vsll4(v) _mm512_slli_epi32(v, 4)
#define vand3(v) _mm512_and_si512(v, _mm512_set1_epi32(3))
#define vor(a, b) _mm512_or_si512(a, b)
#else
#define VW 8
typedef __m256 vf;
typedef __m256i vi;
#define vzero() _mm256_setzero_ps()
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vfms(a, b, c) _mm256_fmsub_ps(a, b, c)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vset1(a) _mm256_set1_ps(a)
#define vload(p) _mm256_loadu_ps(p)
#define vloada(p) _mm256_load_ps(p)
#define vstorea(p, v) _mm256_store_ps(p, v)
#define vcvt(i) _mm256_cvtepi32_ps(i)
#if defined(__AVXVNNI__)
#define ISA_NAME "avxvnni"
#else
#define ISA_NAME "avx2"
#endif
static inline float vhsum(vf v) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
    return _mm_cvtss_f32(t);
}
/* chunk c (0..3) of a block: 8 signed bytes; 8 nibbles (chunks 0-1 low halves, 2-3 high) */
static inline vi load_i8(const uint8_t *q, int c) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + c * VW)));
}
static inline vi load_nib(const uint8_t *q, int c) {
    vi b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + (c & 1) * 8)));
    return c < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(15)) : _mm256_srli_epi32(b, 4);
}
#define vsub_i(a, b) _mm256_sub_epi32(a, _mm256_set1_epi32(b))
#define vsub(a, b) _mm256_sub_ps(a, b)
static inline vi load_u8(const uint8_t *q) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)); }
#define vand15(v) _mm256_and_si256(v, _mm256_set1_epi32(15))
#define vsrl4(v) _mm256_srli_epi32(v, 4)
#define vsrl(v, n) _mm256_srli_epi32(v, n)
#define vsll4(v) _mm256_slli_epi32(v, 4)
#define vand3(v) _mm256_and_si256(v, _mm256_set1_epi32(3))
#define vor(a, b) _mm256_or_si256(a, b)
#endif

#define NCH (QK / VW)  /* vector chunks per block */
#define UNROLL _Pragma("GCC unroll 16")

const char *gguf_isa(void) { return ISA_NAME; }

static inline int64_t block_bytes(int fmt) {
    switch (fmt) {
        case FMT_Q8_0: return 34;
        case FMT_Q4_0: return 18;
        case FMT_Q4_1: return 20;
        case FMT_Q4_K: return 144;
        case FMT_Q6_K: return 210;
        default: return 0;
    }
}

/* Exported for callers; the kernels use the inlinable block_bytes (a call to an exported
   function from a -fPIC library cannot be inlined: it would cost a PLT call per block). */
int64_t gguf_block_bytes(int fmt) { return block_bytes(fmt); }

/* weights per stored block */
static inline int64_t block_weights(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q6_K ? 256 : QK; }

/* Where in a row the bytes of its 32-weight block b begin (about, for the K formats). */
static inline int64_t block_offset(int fmt, int64_t b) {
    return b * block_bytes(fmt) * QK / block_weights(fmt);
}

/* Bytes of one row of K weights, or 0 where K does not fill whole blocks. */
static inline int64_t row_bytes(int fmt, int64_t K) {
    int64_t bw = block_weights(fmt);
    return K % bw ? 0 : K / bw * block_bytes(fmt);
}

/* Q4_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes s. */
static inline void q4k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Scales of the 32-weight block b of a row: d (and m for Q4_1, Q4_K). */
static inline __attribute__((always_inline)) void scales(int fmt, const uint8_t *row, int64_t b,
                                                         vf *d, vf *m) {
    if (fmt == FMT_Q4_K) {
        const uint8_t *sb = row + (b >> 3) * 144;
        int sc, mn;
        q4k_scale_min(sb + 4, (int)(b & 7), &sc, &mn);
        *d = vset1(f16(sb) * (float)sc);
        *m = vset1(f16(sb + 2) * (float)mn);
        return;
    }
    if (fmt == FMT_Q6_K) {  /* d; each chunk's own scale is applied in dequant */
        *d = vset1(f16(row + (b >> 3) * 210 + 208));
        *m = vzero();
        return;
    }
    const uint8_t *blk = row + b * block_bytes(fmt);
    *d = vset1(f16(blk));
    *m = fmt == FMT_Q4_1 ? vset1(f16(blk + 2)) : vzero();
}

#if VW == 16
/* 4-bit formats on 16 lanes: a block's 16 possible weights, computed once with the
   reference's operations (Q4_0 d * (q - 8); Q4_1 d * q + m; Q4_K d * q - m), are one
   register, and each weight is looked up by its nibble (vpermps reads an index's low 4
   bits): the same numbers as converting and scaling every weight, for one instruction a
   16 weights instead of four. Measured at one row (SmolLM2's 3072x576 Q4_1 matrix x 30, with
   the prefetching below): 4.70 -> 4.42 ms on one thread, 2.14 -> 2.11 ms on two, where the
   memory's pace is already the limit. */
#define LUT4(fmt) ((fmt) == FMT_Q4_0 || (fmt) == FMT_Q4_1 || (fmt) == FMT_Q4_K)
static inline vf lut4(int fmt, vf d, vf m) {
    const vf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (fmt == FMT_Q4_0) return vmul(d, vsub(iota, vset1(8.0f)));
    if (fmt == FMT_Q4_1) return vadd(vmul(d, iota), m);
    return vsub(vmul(d, iota), m);
}
#else
#define LUT4(fmt) 0
static inline vf lut4(int fmt, vf d, vf m) { (void)fmt; (void)m; return d; }
#endif

/* What a tile keeps per block and row: the lookup table (LUT4 formats) or d and m. */
static inline __attribute__((always_inline)) void block_params(int fmt, const uint8_t *row,
                                                               int64_t b, vf *d, vf *m) {
    scales(fmt, row, b, d, m);
    if (LUT4(fmt)) *d = lut4(fmt, *d, *m);
}

/* Weights of chunk c of one block, exactly as the reference dequantizer computes them. */
static inline __attribute__((always_inline)) vf dequant(int fmt, const uint8_t *row, int64_t b,
                                                        int c, vf d, vf m) {
#if VW == 16
    if (LUT4(fmt)) {  /* d is the block's table (block_params) */
        const uint8_t *q = fmt == FMT_Q4_K ? row + (b >> 3) * 144 + 16 + ((b & 7) >> 1) * 32 + c * VW
                                           : row + b * block_bytes(fmt) + (fmt == FMT_Q4_1 ? 4 : 2);
        vi v = load_u8(q);
        int high = fmt == FMT_Q4_K ? (int)(b & 1) : c;
        return _mm512_permutexvar_ps(high ? vsrl4(v) : v, d);
    }
#endif
    if (fmt == FMT_Q4_K) {
        const uint8_t *q = row + (b >> 3) * 144 + 16 + ((b & 7) >> 1) * 32 + c * VW;
        vi v = load_u8(q);
        v = (b & 1) ? vsrl4(v) : vand15(v);
        return vfms(d, vcvt(v), m);  /* exact product: see the header */
    }
    if (fmt == FMT_Q6_K) {
        /* sub-block j of the super-block: its low nibbles are bytes (j / 4) * 64 + (j & 1) * 32
           onward shifted by ((j & 3) >> 1) * 4, its high pairs bytes (j / 4) * 32 onward
           shifted by (j & 3) * 2; weights 16i .. 16i + 15 share int8 scale i */
        const uint8_t *sb = row + (b >> 3) * 210;
        int j = (int)(b & 7);
        vi lo = load_u8(sb + (j >> 2) * 64 + (j & 1) * 32 + c * VW);
        vi hi = load_u8(sb + 128 + (j >> 2) * 32 + c * VW);
        lo = vand15(vsrl(lo, ((j & 3) >> 1) * 4));
        hi = vand3(vsrl(hi, (j & 3) * 2));
        vi q = vsub_i(vor(lo, vsll4(hi)), 32);
        float sc = (float)(int8_t)sb[192 + j * 2 + (c * VW) / 16];
        return vmul(vmul(d, vset1(sc)), vcvt(q));
    }
    const uint8_t *blk = row + b * block_bytes(fmt);
    switch (fmt) {
        case FMT_Q8_0: return vmul(vcvt(load_i8(blk + 2, c)), d);
        case FMT_Q4_0: return vmul(d, vcvt(vsub_i(load_nib(blk + 2, c), 8)));
        default: return vfma(d, vcvt(load_nib(blk + 4, c)), m);  /* exact product: see the header */
    }
}

/* Q8_0, Q4_0 and Q4_1 on 8 lanes: a block's four chunks of weights, exactly as dequant computes
   them, from one load of its quants and one conversion of both its scales (dequant reloads
   and widens the same 8 bytes twice and converts each scale on its own). All linears of a
   SmolLM2 step at 2 / 8 decode rows: 7.2 -> 6.0 / 21.8 -> 17.4 ms on a 2-core Zen 4 capped at
   AVX2; one row is unchanged. */
#define WHOLE_BLOCK(fmt) (VW == 8 && ((fmt) == FMT_Q8_0 || (fmt) == FMT_Q4_0 || (fmt) == FMT_Q4_1))
#if VW == 8
static inline __attribute__((always_inline)) void dequant_block(int fmt, const uint8_t *blk, vf out[NCH]) {
    int32_t dm16;
    memcpy(&dm16, blk, 4);  /* d, and m for Q4_1 */
    __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm16));
    vf d = _mm256_broadcastss_ps(dm), m = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dm), _mm256_set1_epi32(1));
    if (fmt == FMT_Q8_0) {
        vi q[NCH] = {load_i8(blk + 2, 0), load_i8(blk + 2, 1), load_i8(blk + 2, 2), load_i8(blk + 2, 3)};
        UNROLL for (int i = 0; i < NCH; i++) out[i] = vmul(vcvt(q[i]), d);
        return;
    }
    const uint8_t *qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
    vi lo = load_u8(qs), hi = load_u8(qs + 8);  /* each widened straight from memory */
    vi q[NCH] = {vand15(lo), vand15(hi), vsrl4(lo), vsrl4(hi)};  /* chunks 0-1 low halves, 2-3 high */
    if (fmt == FMT_Q4_0) UNROLL for (int i = 0; i < NCH; i++) out[i] = vmul(d, vcvt(vsub_i(q[i], 8)));
    else UNROLL for (int i = 0; i < NCH; i++) out[i] = vfma(d, vcvt(q[i]), m);  /* exact product */
}
#else
static inline void dequant_block(int fmt, const uint8_t *blk, vf out[NCH]) { (void)fmt; (void)blk; (void)out; }
#endif

/* Direct tile: NR output rows x MR input rows, converting each weight chunk as it is used. */
#define DTILE(NR, MR)                                                                      \
static inline __attribute__((always_inline)) void dtile_##NR##x##MR(int fmt, const float *x, const uint8_t *w, float *y, \
                                     int64_t m0, int64_t n0, int64_t N, int64_t K,         \
                                     int64_t rb) {                             \
    vf acc[NR][MR];                                                                        \
    UNROLL for (int r = 0; r < NR; r++)                                                    \
        UNROLL for (int j = 0; j < MR; j++) acc[r][j] = vzero();                           \
    const float *xr = x + m0 * K;                                                          \
    for (int64_t b = 0; b < K / QK; b++) {                                                 \
        vf d[NR], mm[NR];                                                                  \
        vf wb[NR][NCH];                                                                    \
        UNROLL for (int r = 0; r < NR; r++) {                                              \
            if (WHOLE_BLOCK(fmt)) dequant_block(fmt, w + (n0 + r) * rb + b * block_bytes(fmt), wb[r]); \
            else block_params(fmt, w + (n0 + r) * rb, b, &d[r], &mm[r]);                   \
        }                                                                                  \
        UNROLL for (int r = 0; r < NR; r++)                                                \
            _mm_prefetch((const char *)(w + (n0 + r + PREFETCH_ROWS) * rb + block_offset(fmt, b)), \
                         _MM_HINT_T0);                                                     \
        UNROLL for (int c = 0; c < NCH; c++) {                                             \
            UNROLL for (int r = 0; r < NR; r++) {                                          \
                vf wv = WHOLE_BLOCK(fmt) ? wb[r][c] : dequant(fmt, w + (n0 + r) * rb, b, c, d[r], mm[r]); \
                UNROLL for (int j = 0; j < MR; j++)                                        \
                    acc[r][j] = vfma(wv, vload(xr + j * K + b * QK + c * VW), acc[r][j]);  \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    UNROLL for (int r = 0; r < NR; r++)                                                    \
        UNROLL for (int j = 0; j < MR; j++) y[(m0 + j) * N + n0 + r] = vhsum(acc[r][j]);   \
}
DTILE(4, 1)
DTILE(4, 2)
DTILE(4, 3)
DTILE(4, 4)
DTILE(1, 1)
DTILE(1, 2)
DTILE(1, 3)
DTILE(1, 4)

/* Direct tiles over NR (4 or 1) output rows for all M input rows, up to 4 at a time (the
   weights' chunks are converted again for each group of 4: cheap next to a panel's stores). */
static inline __attribute__((always_inline)) void direct_rows(int fmt, int nr, const float *x,
        const uint8_t *w, float *y, int64_t M, int64_t n, int64_t N, int64_t K, int64_t rb) {
    for (int64_t m = 0; m < M; m += 4) {
        int64_t mr = M - m < 4 ? M - m : 4;
        if (nr == 4) {
            if (mr == 4) dtile_4x4(fmt, x, w, y, m, n, N, K, rb);
            else if (mr == 3) dtile_4x3(fmt, x, w, y, m, n, N, K, rb);
            else if (mr == 2) dtile_4x2(fmt, x, w, y, m, n, N, K, rb);
            else dtile_4x1(fmt, x, w, y, m, n, N, K, rb);
        } else {
            if (mr == 4) dtile_1x4(fmt, x, w, y, m, n, N, K, rb);
            else if (mr == 3) dtile_1x3(fmt, x, w, y, m, n, N, K, rb);
            else if (mr == 2) dtile_1x2(fmt, x, w, y, m, n, N, K, rb);
            else dtile_1x1(fmt, x, w, y, m, n, N, K, rb);
        }
    }
}

/* Panel tile: NR rows of the float panel p ([rows][K], aligned) x MR input rows. */
#define PTILE(NR, MR)                                                                      \
static inline void ptile_##NR##x##MR(const float *x, const float *p, float *y, int64_t m0, \
                                     int64_t n0, int64_t N, int64_t K) {                   \
    vf acc[NR][MR];                                                                        \
    UNROLL for (int r = 0; r < NR; r++)                                                    \
        UNROLL for (int j = 0; j < MR; j++) acc[r][j] = vzero();                           \
    const float *xr = x + m0 * K;                                                          \
    for (int64_t k = 0; k < K; k += VW) {                                                  \
        UNROLL for (int r = 0; r < NR; r++) {                                              \
            vf wv = vloada(p + r * K + k);                                                 \
            UNROLL for (int j = 0; j < MR; j++)                                            \
                acc[r][j] = vfma(wv, vload(xr + j * K + k), acc[r][j]);                    \
        }                                                                                  \
    }                                                                                      \
    UNROLL for (int r = 0; r < NR; r++)                                                    \
        UNROLL for (int j = 0; j < MR; j++) y[(m0 + j) * N + n0 + r] = vhsum(acc[r][j]);   \
}
#if VW == 16
#define PNR 4
#define PMR 6
PTILE(4, 6) PTILE(4, 5) PTILE(4, 4) PTILE(4, 3) PTILE(4, 2) PTILE(4, 1)
#else
/* 4 x 3 on 8 lanes: 12 accumulators, 4 panel vectors and the input chunk as FMA's memory
   operand fill the 16 registers, 7 loads per 12 FMAs. All linears of a SmolLM2 step on a 2-core
   Zen 4 capped at AVX2, against the 2 x 5 tile before it (10 accumulators, 7 loads per 10):
   16 / 64 / 256 rows 37.9 / 130 / 582 -> 32.7 / 102 / 442 ms, the last 78 GMAC/s where torch's
   float32 sgemm reaches 84 (same bits: every tile runs the same chain per output) */
#define PNR 4
#define PMR 3
PTILE(4, 3) PTILE(4, 2) PTILE(4, 1)
#endif
PTILE(1, 4) PTILE(1, 3) PTILE(1, 2) PTILE(1, 1)

static inline void panel_rows(const float *x, const float *pan, float *y, int64_t M,
                       int64_t n0, int64_t nr, int64_t N, int64_t K) {
    int64_t r = 0;
    for (; r + PNR <= nr; r += PNR) {
        const float *p = pan + r * K;
        int64_t m = 0;
        for (; m + PMR <= M; m += PMR) {
#if VW == 16
            ptile_4x6(x, p, y, m, n0 + r, N, K);
#else
            ptile_4x3(x, p, y, m, n0 + r, N, K);
#endif
        }
        switch (M - m) {
#if VW == 16
            case 5: ptile_4x5(x, p, y, m, n0 + r, N, K); break;
            case 4: ptile_4x4(x, p, y, m, n0 + r, N, K); break;
            case 3: ptile_4x3(x, p, y, m, n0 + r, N, K); break;
            case 2: ptile_4x2(x, p, y, m, n0 + r, N, K); break;
            case 1: ptile_4x1(x, p, y, m, n0 + r, N, K); break;
#else
            case 2: ptile_4x2(x, p, y, m, n0 + r, N, K); break;
            case 1: ptile_4x1(x, p, y, m, n0 + r, N, K); break;
#endif
        }
    }
    for (; r < nr; r++) {
        const float *p = pan + r * K;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) ptile_1x4(x, p, y, m, n0 + r, N, K);
        switch (M - m) {
            case 3: ptile_1x3(x, p, y, m, n0 + r, N, K); break;
            case 2: ptile_1x2(x, p, y, m, n0 + r, N, K); break;
            case 1: ptile_1x1(x, p, y, m, n0 + r, N, K); break;
        }
    }
}

/* One work item: output rows n0 .. n0 + nr - 1 for all M input rows; pan: a [GROUP][K]
   float scratch panel (used from PANEL_MIN_ROWS rows on). Inlined once per format below, so
   the format is a constant in every inner loop. */
static inline __attribute__((always_inline)) void group_impl(
        const int fmt, const float *x, const uint8_t *w, float *y, float *pan, int64_t M,
        int64_t n0, int64_t nr, int64_t N, int64_t K) {
    int64_t rb = row_bytes(fmt, K), n = n0, end = n0 + nr;
    if (M < PANEL_MIN_ROWS) {
        for (; n + 4 <= end; n += 4) direct_rows(fmt, 4, x, w, y, M, n, N, K, rb);
        for (; n < end; n++) direct_rows(fmt, 1, x, w, y, M, n, N, K, rb);
        return;
    }
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *row = w + (n0 + r) * rb;
        for (int64_t b = 0; b < K / QK; b++) {
            _mm_prefetch((const char *)(row + PREFETCH_ROWS * rb + block_offset(fmt, b)), _MM_HINT_T0);
            if (WHOLE_BLOCK(fmt)) {
                vf wb[NCH];
                dequant_block(fmt, row + b * block_bytes(fmt), wb);
                UNROLL for (int c = 0; c < NCH; c++) vstorea(pan + r * K + b * QK + c * VW, wb[c]);
                continue;
            }
            vf d, mm;
            block_params(fmt, row, b, &d, &mm);
            UNROLL for (int c = 0; c < NCH; c++)
                vstorea(pan + r * K + b * QK + c * VW, dequant(fmt, row, b, c, d, mm));
        }
    }
    panel_rows(x, pan, y, M, n0, nr, N, K);
}

typedef void (*group_fn)(const float *, const uint8_t *, float *, float *, int64_t, int64_t,
                         int64_t, int64_t, int64_t);
#define GROUP_FN(F)                                                                          \
static void group_##F(const float *x, const uint8_t *w, float *y, float *pan, int64_t M,     \
                      int64_t n0, int64_t nr, int64_t N, int64_t K) {                        \
    group_impl(FMT_##F, x, w, y, pan, M, n0, nr, N, K);                                     \
}
GROUP_FN(Q8_0)
GROUP_FN(Q4_0)
GROUP_FN(Q4_1)
GROUP_FN(Q4_K)
GROUP_FN(Q6_K)

/* x: float32 [M, K]; w: N rows of K weights in blocks of format fmt; y: float32 [M, N].
   Returns 0, or -1 for an unknown format or a K that does not fill whole blocks. */
int gguf_linear(int fmt, const float *x, const uint8_t *w, float *y, int64_t M, int64_t N,
                int64_t K) {
    group_fn fn = fmt == FMT_Q8_0 ? group_Q8_0 : fmt == FMT_Q4_0 ? group_Q4_0
                : fmt == FMT_Q4_1 ? group_Q4_1 : fmt == FMT_Q4_K ? group_Q4_K
                : fmt == FMT_Q6_K ? group_Q6_K : 0;
    if (fn == 0 || row_bytes(fmt, K) == 0) return -1;
    if (M == 0) return 0;
    int64_t groups = (N + GROUP - 1) / GROUP;
    #pragma omp parallel
    {
        float *pan = M < PANEL_MIN_ROWS ? 0 : (float *)aligned_alloc(64, sizeof(float) * GROUP * K);
        /* guided: each thread first takes a long run of consecutive rows (a stream the
           prefetchers follow: all linears of a one-row step 5.1 -> 3.1 ms against
           dynamic's interleaved items), then ever smaller runs, so a preempted thread's
           share is still taken over by the other */
        /* input rows in blocks of M_BLOCK, each block across all work items: a block's rows
           stay in the L2 cache while every panel passes over them */
        for (int64_t m0 = 0; m0 < M; m0 += M_BLOCK) {
            int64_t mb = M - m0 < M_BLOCK ? M - m0 : M_BLOCK;
            #pragma omp for schedule(guided)
            for (int64_t g = 0; g < groups; g++) {
                int64_t n0 = g * GROUP;
                fn(x + m0 * K, w, y + m0 * N, pan, mb, n0, n0 + GROUP < N ? GROUP : N - n0, N, K);
            }
        }
        free(pan);
    }
    return 0;
}

/* w as float32 [N, K] (the reference dequantization, for tests and fallbacks). */
int gguf_dequantize(int fmt, const uint8_t *w, float *out, int64_t N, int64_t K) {
    int64_t rb = block_bytes(fmt) ? row_bytes(fmt, K) : 0;
    if (rb == 0) return -1;
    #pragma omp parallel for schedule(dynamic) if (N * K >= (1 << 16))
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < K / QK; b++) {
            vf d, mm;
            block_params(fmt, w + n * rb, b, &d, &mm);
            UNROLL for (int c = 0; c < NCH; c++) {
                vf v = dequant(fmt, w + n * rb, b, c, d, mm);
                float t[VW] __attribute__((aligned(64)));
                vstorea(t, v);
                memcpy(out + n * K + b * QK + c * VW, t, sizeof t);
            }
        }
    }
    return 0;
}

/* ---- Decode rows with 16-bit activations (gguf_linear_i16) ----
   The file's exact weights, the input rounded to fixed point per block of 32: each input block
   x is X * s with X integers (to nearest even) and s a power of two, the smallest that keeps
   |X| below 2^15 (Q8_0: 2^12), so each element keeps 15 (12) bits relative to its block's
   largest (bfloat16, the AVX512-BF16 decode's input, keeps 8 relative to itself). A block of a
   weight row is d * q + m (Q4_1; Q4_0: d * (q - 8); Q8_0: d * q), so its dot product with the
   input block is d * s * sum(q * X) + m * s * sum(X): sum(q * X) is exact (VPMADDWD, two
   products a lane, in 32-bit integers), and only the block's scalings round. Float32 on the
   file's blocks instead converts and dequantizes every weight (a conversion and two FMAs per
   8), which bounds a decode row on CPUs whose vector units are slow at those (Zen 1 splits
   each 256-bit operation in two).

   Layout (gguf_pack_i16, a permutation of the file's numbers, the same size): for each group of
   8 weight rows and each block, the 8 rows' d (float16), their m (Q4_1), then 16 "pair vectors":
   vector p holds, in 32-bit lane L, row L's elements 2p and 2p + 1 as two 16-bit integers, so
   one VPMADDWD with the input's pair (X[2p], X[2p + 1]) broadcast adds both products to each
   row's lane: no per-row horizontal sum, and a block's 8 rows cost 16 multiplies. Q8_0 stores
   the vectors as int8 (widened by VPMOVSXBW); Q4_0/Q4_1 four of them in 32 bytes of nibbles
   (i16_quad: low and high halves, bytes widened by unpacking with zero).

   From I16_PANEL_ROWS input rows on, a pair of groups is widened once per call into a 16-bit
   panel (i16_ipanel; K > 1024 in chunks of blocks, so it stays in L1) that tiles of 3 input rows
   read (i16_ptile): the same integer sums without unpacking nibbles per input row. Where
   VPMADDWD is slow (AMD Zen 1 and 2; gguf_i16_float_rows, set by the caller), from 12 rows the
   weights become float32 panels instead and the same block sums are formed by FMAs
   (i16_ftile): each is an integer below 2^24 in magnitude (Q4: 32 * 15 * 2^15; Q8_0: 32 * 128 *
   2^12), exact in float32 in any order. y[m, n]: per block that exact sum, times d * s (exact:
   s is a power of two) added to the row's float32 sum by one FMA, then m * s * sum(X) by
   another, blocks in order: the same bits for every M, tile and path, so a row's result does
   not depend on the rest of the batch (decode rows and drafts give the same tokens alone or
   together; tested); prompt rows (--prefill-dtype int16) are multiplied as decode rows are.
   Measured on a 2-core AMD EPYC (Zen 1), against gguf_linear (float32) on both threads:
   SmolLM2's 3072x576 Q4_1 matrix, one row 233 -> 84 us, 2 rows 319 -> 151, 8 rows 936 -> 552;
   Q8_0 one row 205 -> 83; 12 to 64 rows on the float32 tiles 1.12-1.3x float32's time. On a
   2-core AMX Xeon (Sapphire Rapids-class) under the AVX2 cap, against float32: one row 2.4x faster, 2 to
   8 rows 1.9-2.1x, 11 to 1,024 rows 1.1-1.5x (the panel tiles; the float32 tiles were
   0.75-0.9x float32 there). */
#if defined(__AVX2__)
#define I16_MR 4  /* input rows per tile */
/* acc + the pairwise products of w and x in each 32-bit lane: one VPDPWSSD where the build has
   AVX-VNNI (256-bit, the AVX2 kind's: Alder Lake on, Sierra Forest) or AVX512-VNNI, else
   VPMADDWD + VPADDD; the same integers either way (VPDPWSSD does not saturate) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define I16_YDOT(acc, w, x) _mm256_dpwssd_epi32(acc, w, x)
#elif defined(__AVXVNNI__)
#define I16_YDOT(acc, w, x) _mm256_dpwssd_avx_epi32(acc, w, x)
#else
#define I16_YDOT(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#endif
/* The direct tiles (below the panel's rows) take VPDPWSSD from this many input rows: one row's
   tile is a single chain of sums per block, and VPDPWSSD's latency (5 cycles where VPADDD's is
   1) made one row's linears 5-8% slower on the AMX Xeon; 2 / 3 / 4 rows with it 1.03x / 1.1-1.15x /
   1.3-1.45x the AVX2 build's GMAC/s there */
#define I16_DOT_ROWS 2

static inline int64_t i16_unit_bytes(int fmt) {
    return fmt == FMT_Q8_0 ? 8 * 34 : fmt == FMT_Q4_0 ? 8 * 18 : fmt == FMT_Q4_1 ? 8 * 20 : 0;
}
/* where a unit's pair vectors begin: after d (and m for Q4_1) */
static inline int64_t i16_pairs_at(int fmt) { return fmt == FMT_Q4_1 ? 32 : 16; }

/* 4-bit formats: the byte of a unit's pair vectors holding 16-bit word w (0..15) of vector p
   (0..15), in its low half for p % 4 < 2: the inverse of i16_quad */
static inline int i16_nibble_byte(int p, int w) {
    int c = p / 4, hi = (p & 1), lane = w / 8;
    return c * 32 + lane * 16 + hi * 8 + w % 8;
}

/* w: N rows of K weights in the file's blocks -> out (same size) in the layout above. Returns
   0, or -1 for another format, N not a multiple of 8 or K of 32. */
int gguf_pack_i16(int fmt, const uint8_t *w, uint8_t *out, int64_t N, int64_t K) {
    int64_t fb = block_bytes(fmt), ub = i16_unit_bytes(fmt);
    if (!ub || N % 8 || K % QK) return -1;
    int64_t nb = K / QK, rb = nb * fb;
    memset(out, 0, (size_t)(N / 8 * nb * ub));
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *u = out + (g * nb + b) * ub, *pairs = u + i16_pairs_at(fmt);
            for (int r = 0; r < 8; r++) {
                const uint8_t *blk = w + (8 * g + r) * rb + b * fb;
                memcpy(u + 2 * r, blk, 2);
                if (fmt == FMT_Q4_1) memcpy(u + 16 + 2 * r, blk + 2, 2);
                for (int e = 0; e < QK; e++) {
                    int p = e / 2, word = 2 * r + e % 2, q;
                    if (fmt == FMT_Q8_0) {
                        pairs[p * 16 + word] = blk[2 + e];
                        continue;
                    }
                    const uint8_t *qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
                    q = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
                    pairs[i16_nibble_byte(p, word)] |= (uint8_t)(q << (p & 2 ? 4 : 0));
                }
            }
        }
    return 0;
}

/* Bits of X (its magnitude below 2^bits) for a format's input: 15, or 12 for Q8_0, whose block
   sums then stay within 32 * 128 * 2^12 = 2^24, exact in float32 too (i16_ftile) */
static inline int i16_bits(int fmt) { return fmt == FMT_Q8_0 ? 12 : 15; }

/* x [M, K] -> xq [M, K] (int16) and per block {s, s * sum(X)} at xs [M * K / 32][2]: blocks
   [b0, b1) of the M * K / 32 (each block on its own) */
static void i16_input(const float *x, int16_t *xq, float *xs, int64_t b0, int64_t b1, int xbits) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lim = _mm256_set1_epi32(32767);
    for (int64_t i = b0 * QK; i < b1 * QK; i += QK) {
        __m256 v[4], mx = _mm256_setzero_ps();
        UNROLL for (int c = 0; c < 4; c++) {
            v[c] = _mm256_loadu_ps(x + i + 8 * c);
            mx = _mm256_max_ps(mx, _mm256_and_ps(v[c], absmask));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        uint32_t bits;
        float top = _mm_cvtss_f32(h);
        memcpy(&bits, &top, 4);
        /* top < 2^(E - 126) with E its biased exponent: s = 2^(E - 126 - bits) (|x / s| <
           2^bits) and 1 / s exact; E from 16 (blocks below 2^-110 keep what fits), NaN/inf as
           the largest */
        int32_t E = (int32_t)(bits >> 23) & 255;
        E = E < 16 ? 16 : E > 254 ? 254 : E;
        uint32_t sb = (uint32_t)(E + 1 - xbits) << 23, ib = (uint32_t)(253 - E + xbits) << 23;
        float s, inv;
        memcpy(&s, &sb, 4);
        memcpy(&inv, &ib, 4);
        __m256 iv = _mm256_set1_ps(inv);
        __m256i q[4], sum = _mm256_setzero_si256();
        UNROLL for (int c = 0; c < 4; c++) {  /* to nearest even; 32768 (a rounding up) kept at 32767 */
            q[c] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[c], iv)), lim);
            sum = _mm256_add_epi32(sum, q[c]);
        }
        _mm256_storeu_si256((__m256i *)(xq + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
        _mm256_storeu_si256((__m256i *)(xq + i + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        xs[(i / QK) * 2] = s;
        xs[(i / QK) * 2 + 1] = s * (float)_mm_cvtsi128_si32(t);  /* |sum| < 2^20: exact */
    }
}

/* Pair vectors 4c .. 4c + 3 of a 4-bit unit from one 32-byte load */
static inline __attribute__((always_inline)) void i16_quad(const uint8_t *pairs, int c, __m256i out[4]) {
    const __m256i m15 = _mm256_set1_epi8(15), z = _mm256_setzero_si256();
    __m256i v = _mm256_loadu_si256((const __m256i *)(pairs + 32 * c));
    __m256i lo = _mm256_and_si256(v, m15), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
    out[0] = _mm256_unpacklo_epi8(lo, z);
    out[1] = _mm256_unpackhi_epi8(lo, z);
    out[2] = _mm256_unpacklo_epi8(hi, z);
    out[3] = _mm256_unpackhi_epi8(hi, z);
}

/* Pair vectors 4c .. 4c + 3 of a unit (pairs: its pair vectors), as 16-bit integers: Q8_0's
   int8 widened, the 4-bit formats' nibbles unpacked (i16_quad) */
static inline __attribute__((always_inline)) void i16_pairs4(int fmt, const uint8_t *pairs, int c, __m256i out[4]) {
    if (fmt == FMT_Q8_0) {
        UNROLL for (int i = 0; i < 4; i++)
            out[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(pairs + 16 * (4 * c + i))));
    } else {
        i16_quad(pairs, c, out);
    }
}

/* A unit's d and m on 8 lanes (m: Q4_1's own; Q4_0: -8 d, for its q - 8; Q8_0: unused) */
static inline __attribute__((always_inline)) void i16_dm(int fmt, const uint8_t *u, __m256 *d, __m256 *m) {
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)u));
    *m = fmt == FMT_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + 16)))
       : _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f));
}

/* acc plus a block's exact sums P (as float32) scaled: P * (d * s) by one FMA, then m * (s *
   sum(X)) by another (sx: the input block's {s, s * sum(X)}) */
static inline __attribute__((always_inline)) __m256 i16_scaled(int fmt, __m256 P, __m256 d, __m256 m,
                                                              const float *sx, __m256 acc) {
    acc = _mm256_fmadd_ps(P, _mm256_mul_ps(d, _mm256_set1_ps(sx[0])), acc);
    return fmt == FMT_Q8_0 ? acc : _mm256_fmadd_ps(m, _mm256_set1_ps(sx[1]), acc);
}

/* Group g (8 weight rows) against input rows j0 .. j0 + MR - 1 */
#define I16_TILE(MR)                                                                                 \
static inline __attribute__((always_inline)) void i16_tile_##MR(int fmt, const int16_t *xq,         \
        const float *xs, const uint8_t *pk, float *y, int64_t j0, int64_t g, int64_t N, int64_t K) { \
    int64_t nb = K / QK, ub = i16_unit_bytes(fmt);                                                   \
    const uint8_t *u = pk + g * nb * ub;                                                             \
    __m256 acc[MR];                                                                                  \
    UNROLL for (int j = 0; j < MR; j++) acc[j] = _mm256_setzero_ps();                                \
    for (int64_t b = 0; b < nb; b++, u += ub) {                                                      \
        for (int64_t o = 0; o < ub; o += 64) _mm_prefetch((const char *)(u + 4 * ub + o), _MM_HINT_T0); \
        const uint8_t *pairs = u + i16_pairs_at(fmt);                                                \
        __m256i P[MR];                                                                               \
        UNROLL for (int j = 0; j < MR; j++) P[j] = _mm256_setzero_si256();                           \
        /* not unrolled: unrolled, GCC computes all 16 x MR products first and spills them to  \
           sum them as a tree (2-11 rows 1.2-1.25x slower on a Xeon under the AVX2 cap) */       \
        _Pragma("GCC unroll 1") for (int c = 0; c < 4; c++) {                                        \
            __m256i pv[4];                                                                           \
            i16_pairs4(fmt, pairs, c, pv);                                                           \
            UNROLL for (int i = 0; i < 4; i++)                                                       \
                UNROLL for (int j = 0; j < MR; j++) {                                                \
                    int32_t xp;                                                                      \
                    memcpy(&xp, xq + (j0 + j) * K + b * QK + 2 * (4 * c + i), 4);                    \
                    P[j] = MR >= I16_DOT_ROWS ? I16_YDOT(P[j], pv[i], _mm256_set1_epi32(xp)) \
                         : _mm256_add_epi32(P[j], _mm256_madd_epi16(pv[i], _mm256_set1_epi32(xp))); \
                }                                                                                    \
        }                                                                                            \
        __m256 d, m;                                                                                 \
        i16_dm(fmt, u, &d, &m);                                                                      \
        UNROLL for (int j = 0; j < MR; j++)                                                          \
            acc[j] = i16_scaled(fmt, _mm256_cvtepi32_ps(P[j]), d, m, xs + ((j0 + j) * nb + b) * 2, acc[j]); \
    }                                                                                                \
    UNROLL for (int j = 0; j < MR; j++) _mm256_storeu_ps(y + (j0 + j) * N + 8 * g, acc[j]);          \
}
I16_TILE(1) I16_TILE(2) I16_TILE(3) I16_TILE(4)

/* From I16_PANEL_ROWS input rows on, a pair of groups (16 weight rows) is widened once per call
   into 16-bit integers, ip [nb][16 pairs][2 groups][16 words] (i16_ipanel), and each tile of up
   to I16_PMR input rows reads its pair vectors from there: no nibble unpacking per input row,
   one broadcast of X's pair serving 16 rows (two VPMADDWD). The same exact block sums: the same
   bits as i16_tile. */
#if defined(__AVX512BW__)
/* the 64-byte tiles below (i16_ztile) pay from 4 rows: SmolLM2's 3072x576 and 576x1536 Q4_1
   matrices at 4 / 5 / 7 rows 1.04-1.11x / 1.2-1.3x / 1.15-1.35x the direct tiles' GMAC/s on the
   AMX Xeon's AVX512-VNNI build; 3 rows 0.94-1.02x */
#define I16_PANEL_ROWS 4
#else
#define I16_PANEL_ROWS 8
#endif
#define I16_PANEL_BLOCKS 32  /* blocks of a panel chunk: 32 KB of 16-bit weights at most */
#define I16_ROW_RUN 256
#define I16_SHARED_INPUT 256  /* input blocks from which all threads round the input */
#define I16_PMR 3

static inline __attribute__((always_inline)) void i16_ipanel(int fmt, const uint8_t *pk, int16_t *ip,
                                                            int64_t g, int64_t K, int64_t b0, int64_t b1) {
    int64_t nb = K / QK, ub = i16_unit_bytes(fmt);
    for (int h = 0; h < 2; h++) {
        const uint8_t *u = pk + ((g + h) * nb + b0) * ub;
        for (int64_t b = 0; b < b1 - b0; b++, u += ub) {
            const uint8_t *pairs = u + i16_pairs_at(fmt);
            UNROLL for (int c = 0; c < 4; c++) {
                __m256i pv[4];
                i16_pairs4(fmt, pairs, c, pv);
                UNROLL for (int i = 0; i < 4; i++)
                    _mm256_store_si256((__m256i *)(ip + ((b * 16 + 4 * c + i) * 2 + h) * 16), pv[i]);
            }
        }
    }
}

/* Groups g and g + 1 (the pair vectors of their blocks [b0, b1) in ip) against input rows j0 ..
   j0 + MR - 1; the rows' float32 sums stay in registers (A0, A1: 2 MR of them beside 2 MR integer
   sums, hence tiles of 3 rows: 5-15% faster than 4 rows with the float32 sums in L1, AVX2-capped
   Xeon), from 0 at block 0, else from what the blocks before b0 left in y (the same additions in
   the same order) */
#define I16_PTILE(MR)                                                                                \
static inline __attribute__((always_inline)) void i16_ptile_##MR(int fmt, const int16_t *xq,        \
        const float *xs, const uint8_t *pk, const int16_t *ip, float *y, int64_t j0, int64_t g,      \
        int64_t N, int64_t K, int64_t b0, int64_t b1) {                                              \
    int64_t nb = K / QK, ub = i16_unit_bytes(fmt);                                                   \
    const uint8_t *u0 = pk + (g * nb + b0) * ub, *u1 = u0 + nb * ub;                                 \
    __m256 A0[MR], A1[MR];                                                                           \
    UNROLL for (int j = 0; j < MR; j++) {                                                            \
        A0[j] = b0 ? _mm256_loadu_ps(y + (j0 + j) * N + 8 * g) : _mm256_setzero_ps();                \
        A1[j] = b0 ? _mm256_loadu_ps(y + (j0 + j) * N + 8 * g + 8) : _mm256_setzero_ps();            \
    }                                                                                                \
    for (int64_t b = b0; b < b1; b++, u0 += ub, u1 += ub) {                                          \
        __m256i P0[MR], P1[MR];                                                                      \
        UNROLL for (int j = 0; j < MR; j++) P0[j] = P1[j] = _mm256_setzero_si256();                  \
        const int16_t *w = ip + (b - b0) * 16 * 32;                                                  \
        /* two pairs per iteration: fully unrolled, GCC would spill all the products (above) */     \
        _Pragma("GCC unroll 2") for (int p = 0; p < 16; p++) {                                       \
            __m256i w0 = _mm256_load_si256((const __m256i *)(w + 32 * p));                            \
            __m256i w1 = _mm256_load_si256((const __m256i *)(w + 32 * p + 16));                       \
            UNROLL for (int j = 0; j < MR; j++) {                                                    \
                int32_t xp;                                                                          \
                memcpy(&xp, xq + (j0 + j) * K + b * QK + 2 * p, 4);                                  \
                __m256i xb = _mm256_set1_epi32(xp);                                                  \
                P0[j] = I16_YDOT(P0[j], w0, xb);                                                   \
                P1[j] = I16_YDOT(P1[j], w1, xb);                                                   \
            }                                                                                        \
        }                                                                                            \
        __m256 d0, m0, d1, m1;                                                                       \
        i16_dm(fmt, u0, &d0, &m0);                                                                   \
        i16_dm(fmt, u1, &d1, &m1);                                                                   \
        UNROLL for (int j = 0; j < MR; j++) {                                                        \
            const float *sx = xs + ((j0 + j) * nb + b) * 2;                                          \
            A0[j] = i16_scaled(fmt, _mm256_cvtepi32_ps(P0[j]), d0, m0, sx, A0[j]);                   \
            A1[j] = i16_scaled(fmt, _mm256_cvtepi32_ps(P1[j]), d1, m1, sx, A1[j]);                   \
        }                                                                                            \
    }                                                                                                \
    UNROLL for (int j = 0; j < MR; j++) {                                                            \
        _mm256_storeu_ps(y + (j0 + j) * N + 8 * g, A0[j]);                                           \
        _mm256_storeu_ps(y + (j0 + j) * N + 8 * g + 8, A1[j]);                                       \
    }                                                                                                \
}
I16_PTILE(1) I16_PTILE(2) I16_PTILE(3)

#if defined(__AVX512BW__)
/* The AVX-512 builds' panel tile: a pair vector of the two groups' panel (16 rows, 2 words
   each) is one 64-byte vector, so each broadcast of X's pair meets 16 rows in one instruction:
   VPDPWSSD where the build has AVX512-VNNI (both products and the 32-bit sum in one
   instruction: the same integers, no saturation), else VPMADDWD + VPADDD. Lanes 0-7 are group
   g's rows, 8-15 group g + 1's, and each lane goes through i16_ptile's operations in its
   order: the same bits. 32 vector registers hold I16_ZMR rows' integer and float32 sums. */
#if defined(__AVX512VNNI__)
#define I16_ZDOT(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#else
#define I16_ZDOT(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#endif
#define I16_ZMR 8
#define I16_TILE_ROWS I16_ZMR

/* The two groups' d and m on 16 lanes (i16_dm's for each group, side by side) */
static inline __attribute__((always_inline)) void i16_dm2(int fmt, const uint8_t *u0, const uint8_t *u1,
                                                         __m512 *d, __m512 *m) {
    __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)u0)),
                                        _mm_loadu_si128((const __m128i *)u1), 1);
    *d = _mm512_cvtph_ps(h);
    if (fmt == FMT_Q4_1) {
        h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(u0 + 16))),
                                    _mm_loadu_si128((const __m128i *)(u1 + 16)), 1);
        *m = _mm512_cvtph_ps(h);
    } else {
        *m = _mm512_mul_ps(*d, _mm512_set1_ps(-8.0f));
    }
}

/* i16_scaled on 16 lanes (the two groups' d and m from i16_dm2): the same operations per lane */
static inline __attribute__((always_inline)) __m512 i16_zscaled(int fmt, __m512 P, __m512 d, __m512 m,
                                                               const float *sx, __m512 acc) {
    acc = _mm512_fmadd_ps(P, _mm512_mul_ps(d, _mm512_set1_ps(sx[0])), acc);
    return fmt == FMT_Q8_0 ? acc : _mm512_fmadd_ps(m, _mm512_set1_ps(sx[1]), acc);
}

#define I16_ZTILE(MR)                                                                                \
static inline __attribute__((always_inline)) void i16_ztile_##MR(int fmt, const int16_t *xq,        \
        const float *xs, const uint8_t *pk, const int16_t *ip, float *y, int64_t j0, int64_t g,      \
        int64_t N, int64_t K, int64_t b0, int64_t b1) {                                              \
    int64_t nb = K / QK, ub = i16_unit_bytes(fmt);                                                   \
    const uint8_t *u0 = pk + (g * nb + b0) * ub, *u1 = u0 + nb * ub;                                 \
    __m512 A[MR];                                                                                    \
    UNROLL for (int j = 0; j < MR; j++)                                                              \
        A[j] = b0 ? _mm512_loadu_ps(y + (j0 + j) * N + 8 * g) : _mm512_setzero_ps();                 \
    for (int64_t b = b0; b < b1; b++, u0 += ub, u1 += ub) {                                          \
        __m512i P[MR];                                                                               \
        UNROLL for (int j = 0; j < MR; j++) P[j] = _mm512_setzero_si512();                           \
        const int16_t *w = ip + (b - b0) * 16 * 32;                                                  \
        const int16_t *x = xq + j0 * K + b * QK;                                                     \
        _Pragma("GCC unroll 2") for (int p = 0; p < 16; p++) {                                       \
            __m512i wv = _mm512_load_si512((const void *)(w + 32 * p));                              \
            UNROLL for (int j = 0; j < MR; j++) {                                                    \
                int32_t xp;                                                                          \
                memcpy(&xp, x + j * K + 2 * p, 4);                                                   \
                P[j] = I16_ZDOT(P[j], wv, _mm512_set1_epi32(xp));                                    \
            }                                                                                        \
        }                                                                                            \
        __m512 d, m;                                                                                 \
        i16_dm2(fmt, u0, u1, &d, &m);                                                                \
        UNROLL for (int j = 0; j < MR; j++)                                                          \
            A[j] = i16_zscaled(fmt, _mm512_cvtepi32_ps(P[j]), d, m, xs + ((j0 + j) * nb + b) * 2, A[j]); \
    }                                                                                                \
    UNROLL for (int j = 0; j < MR; j++) _mm512_storeu_ps(y + (j0 + j) * N + 8 * g, A[j]);            \
}
I16_ZTILE(1) I16_ZTILE(2) I16_ZTILE(3) I16_ZTILE(4) I16_ZTILE(5) I16_ZTILE(6) I16_ZTILE(7) I16_ZTILE(8)

#define I16_TILE(R) i16_ztile_##R
#else
#define I16_TILE_ROWS I16_PMR
#define I16_TILE(R) i16_ptile_##R
#endif

static inline __attribute__((always_inline)) void i16_panel_tile(int fmt, const int16_t *xq, const float *xs,
        const uint8_t *pk, const int16_t *ip, float *y, int64_t rows, int64_t j0, int64_t g, int64_t N,
        int64_t K, int64_t b0, int64_t b1) {
    switch (rows) {
        case 1: I16_TILE(1)(fmt, xq, xs, pk, ip, y, j0, g, N, K, b0, b1); break;
        case 2: I16_TILE(2)(fmt, xq, xs, pk, ip, y, j0, g, N, K, b0, b1); break;
#if I16_TILE_ROWS > 3
        case 3: I16_TILE(3)(fmt, xq, xs, pk, ip, y, j0, g, N, K, b0, b1); break;
        case 4: I16_TILE(4)(fmt, xq, xs, pk, ip, y, j0, g, N, K, b0, b1); break;
        case 5: I16_TILE(5)(fmt, xq, xs, pk, ip, y, j0, g, N, K, b0, b1); break;
        case 6: I16_TILE(6)(fmt, xq, xs, pk, ip, y, j0, g, N, K, b0, b1); break;
        case 7: I16_TILE(7)(fmt, xq, xs, pk, ip, y, j0, g, N, K, b0, b1); break;
        default: I16_TILE(8)(fmt, xq, xs, pk, ip, y, j0, g, N, K, b0, b1); break;
#else
        default: I16_TILE(3)(fmt, xq, xs, pk, ip, y, j0, g, N, K, b0, b1); break;
#endif
    }
}

/* Where VPMADDWD is slow (Zen 1 and 2: one 256-bit VPMADDWD a cycle at most, no faster than
   two FMAs), from this many input rows on the float32 panel path instead (i16_ftile): the same
   block sums, exact in float32 too; 0 (the default): never. Set by gguf_i16_float_rows. */
static int64_t i16_float_rows = 0;
#define I16_FMR 4  /* input rows per float32 tile */
/* blocks of a float32 panel chunk: 16 KB for the pair, within a Zen 1's 32 KB L1 (whole panels
   were 36 KB at K = 576, 96 KB at 1,536); on the AVX2-capped Xeon 576x1536 at 12-64 rows 3-14%
   faster, 3072x576 the same */
#define I16_FPANEL_BLOCKS 8

/* Sets the row count from which gguf_linear_i16 takes its float32 tiles (0: never; below 0: no
   change) and returns the previous one. Either way the same bits. */
int64_t gguf_i16_float_rows(int64_t rows) {
    int64_t old = i16_float_rows;
    if (rows >= 0) i16_float_rows = rows;
    return old;
}

/* Group g's q as float32 for its blocks [b0, b1), fq [b1 - b0][32][8]: element k of the block for
   the 8 rows (lanes) */
static inline __attribute__((always_inline)) void i16_fpanel(int fmt, const uint8_t *pk, float *fq,
                                                            int64_t g, int64_t K, int64_t b0, int64_t b1) {
    int64_t nb = K / QK, ub = i16_unit_bytes(fmt);
    const uint8_t *u = pk + (g * nb + b0) * ub;
    for (int64_t b = 0; b < b1 - b0; b++, u += ub) {
        const uint8_t *pairs = u + i16_pairs_at(fmt);
        float *f = fq + b * QK * 8;
        UNROLL for (int c = 0; c < 4; c++) {
            __m256i pv[4];
            i16_pairs4(fmt, pairs, c, pv);
            UNROLL for (int i = 0; i < 4; i++) {  /* lane L: words 2L (element 2p), 2L + 1 (2p + 1) */
                int p = 4 * c + i;
                __m256i even = _mm256_srai_epi32(_mm256_slli_epi32(pv[i], 16), 16), odd = _mm256_srai_epi32(pv[i], 16);
                _mm256_store_ps(f + (2 * p) * 8, _mm256_cvtepi32_ps(even));
                _mm256_store_ps(f + (2 * p + 1) * 8, _mm256_cvtepi32_ps(odd));
            }
        }
    }
}

/* Groups g and g + 1 (16 weight rows, their q in fq: two panels) against input rows j0 ..
   j0 + MR - 1 (X as float32 in xf): each block's sum of 32 exact products is an integer below
   2^24 in magnitude, exact in float32 whatever the order, so y is the integer path's bits.
   Each broadcast of X serves 16 rows (two FMAs); the rows' float32 sums wait in acc, from 0 at
   block 0, else from what the blocks before b0 left in y (the same additions in the same order). */
#define I16_FTILE(MR)                                                                                \
static inline __attribute__((always_inline)) void i16_ftile_##MR(int fmt, const float *xf,          \
        const float *xs, const uint8_t *pk, const float *fq, float *y, int64_t j0, int64_t g,        \
        int64_t N, int64_t K, int64_t b0, int64_t b1) {                                              \
    int64_t nb = K / QK, ub = i16_unit_bytes(fmt);                                                   \
    const uint8_t *u0 = pk + (g * nb + b0) * ub, *u1 = u0 + nb * ub;                                 \
    float acc[MR][16] __attribute__((aligned(32)));                                                  \
    UNROLL for (int j = 0; j < MR; j++)                                                              \
        for (int i = 0; i < 16; i++) acc[j][i] = b0 ? y[(j0 + j) * N + 8 * g + i] : 0.0f;            \
    for (int64_t b = b0; b < b1; b++, u0 += ub, u1 += ub) {                                          \
        __m256 P0[MR], P1[MR];                                                                       \
        UNROLL for (int j = 0; j < MR; j++) P0[j] = P1[j] = _mm256_setzero_ps();                     \
        const float *f0 = fq + (b - b0) * QK * 8, *f1 = f0 + (b1 - b0) * QK * 8;                     \
        for (int k = 0; k < QK; k++) {                                                               \
            __m256 q0 = _mm256_load_ps(f0 + 8 * k), q1 = _mm256_load_ps(f1 + 8 * k);                 \
            UNROLL for (int j = 0; j < MR; j++) {                                                    \
                __m256 xv = _mm256_broadcast_ss(xf + (j0 + j) * K + b * QK + k);                     \
                P0[j] = _mm256_fmadd_ps(q0, xv, P0[j]);                                              \
                P1[j] = _mm256_fmadd_ps(q1, xv, P1[j]);                                              \
            }                                                                                        \
        }                                                                                            \
        __m256 d0, m0, d1, m1;                                                                       \
        i16_dm(fmt, u0, &d0, &m0);                                                                   \
        i16_dm(fmt, u1, &d1, &m1);                                                                   \
        UNROLL for (int j = 0; j < MR; j++) {                                                        \
            const float *sx = xs + ((j0 + j) * nb + b) * 2;                                          \
            _mm256_store_ps(acc[j], i16_scaled(fmt, P0[j], d0, m0, sx, _mm256_load_ps(acc[j])));     \
            _mm256_store_ps(acc[j] + 8, i16_scaled(fmt, P1[j], d1, m1, sx, _mm256_load_ps(acc[j] + 8))); \
        }                                                                                            \
    }                                                                                                \
    UNROLL for (int j = 0; j < MR; j++) {                                                            \
        _mm256_storeu_ps(y + (j0 + j) * N + 8 * g, _mm256_load_ps(acc[j]));                          \
        _mm256_storeu_ps(y + (j0 + j) * N + 8 * g + 8, _mm256_load_ps(acc[j] + 8));                  \
    }                                                                                                \
}
I16_FTILE(1) I16_FTILE(2) I16_FTILE(3) I16_FTILE(4)

/* Blocks per panel chunk: nb blocks in equal chunks of at most `most` */
static inline int64_t i16_chunk(int64_t nb, int64_t most) {
    int64_t chunks = (nb + most - 1) / most;
    return (nb + chunks - 1) / chunks;
}

/* Groups g and g + 1 of 8 weight rows (g alone where it is the last) against all M input rows.
   xf: X as float32 [M, K] (where the float32 tiles run); scratch: 16 * K floats (the pair's
   float32 panels, or its 16-bit panel in the first half). A lone group takes the unpanelled
   integer tiles. */
static inline __attribute__((always_inline)) void i16_group_impl(int fmt, const int16_t *xq,
        const float *xs, const float *xf, float *scratch, const uint8_t *pk, float *y, int64_t M,
        int64_t g, int64_t N, int64_t K) {
    int pair = g + 1 < N / 8;
    if (pair && xf) {
        /* float32 panels in chunks of at most I16_FPANEL_BLOCKS blocks (as the 16-bit ones below) */
        int64_t nb = K / QK, chunk = i16_chunk(nb, I16_FPANEL_BLOCKS);
        float *fq = scratch;
        for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
            int64_t b1 = b0 + chunk < nb ? b0 + chunk : nb;
            i16_fpanel(fmt, pk, fq, g, K, b0, b1);
            i16_fpanel(fmt, pk, fq + (b1 - b0) * QK * 8, g + 1, K, b0, b1);
            for (int64_t j0 = 0; j0 < M; j0 += I16_FMR) {
                switch (M - j0 < I16_FMR ? M - j0 : I16_FMR) {
                    case 1: i16_ftile_1(fmt, xf, xs, pk, fq, y, j0, g, N, K, b0, b1); break;
                    case 2: i16_ftile_2(fmt, xf, xs, pk, fq, y, j0, g, N, K, b0, b1); break;
                    case 3: i16_ftile_3(fmt, xf, xs, pk, fq, y, j0, g, N, K, b0, b1); break;
                    default: i16_ftile_4(fmt, xf, xs, pk, fq, y, j0, g, N, K, b0, b1); break;
                }
            }
        }
        return;
    }
    if (pair && M >= I16_PANEL_ROWS) {
        /* the panel in chunks of at most I16_PANEL_BLOCKS blocks (equal ones), so it stays in
           L1 beside the tiles' input rows: each chunk is widened, then every tile runs its
           blocks (K > 1024, two chunks: 576x1536 at 16 rows 1.2x as fast as one panel in L2) */
        int64_t nb = K / QK, chunk = i16_chunk(nb, I16_PANEL_BLOCKS), chunks = (nb + chunk - 1) / chunk;
        int16_t *ip = (int16_t *)scratch;
        /* the next pair's packed blocks (the next a thread takes, but at the end of its run),
           prefetched a share per tile: its panel then builds from L2 (weights read the first
           time in a step: 16 rows 3-12% faster on the AVX2-capped Xeon, 64 rows 2-3%) */
        int64_t pair_bytes = 2 * nb * i16_unit_bytes(fmt), tiles = (M + I16_TILE_ROWS - 1) / I16_TILE_ROWS * chunks;
        int64_t lines = g + 3 < N / 8 ? pair_bytes / 64 : 0, per = (lines + tiles - 1) / tiles;
        const char *next = (const char *)(pk + (g + 2) * nb * i16_unit_bytes(fmt));
        for (int64_t b0 = 0, t = 0; b0 < nb; b0 += chunk) {
            int64_t b1 = b0 + chunk < nb ? b0 + chunk : nb;
            i16_ipanel(fmt, pk, ip, g, K, b0, b1);
            for (int64_t j0 = 0; j0 < M; j0 += I16_TILE_ROWS, t++) {
                for (int64_t l = t * per; l < (t + 1) * per && l < lines; l++) _mm_prefetch(next + 64 * l, _MM_HINT_T1);
                i16_panel_tile(fmt, xq, xs, pk, ip, y, M - j0 < I16_TILE_ROWS ? M - j0 : I16_TILE_ROWS, j0, g, N, K, b0, b1);
            }
        }
        return;
    }
    for (int64_t gg = g; gg < g + 1 + pair; gg++)
        for (int64_t j0 = 0; j0 < M; j0 += I16_MR) {
            switch (M - j0 < I16_MR ? M - j0 : I16_MR) {
                case 1: i16_tile_1(fmt, xq, xs, pk, y, j0, gg, N, K); break;
                case 2: i16_tile_2(fmt, xq, xs, pk, y, j0, gg, N, K); break;
                case 3: i16_tile_3(fmt, xq, xs, pk, y, j0, gg, N, K); break;
                default: i16_tile_4(fmt, xq, xs, pk, y, j0, gg, N, K); break;
            }
        }
}

typedef void (*i16_group_fn)(const int16_t *, const float *, const float *, float *, const uint8_t *,
                             float *, int64_t, int64_t, int64_t, int64_t);
#define I16_GROUP_FN(F)                                                                              \
static void i16_group_##F(const int16_t *xq, const float *xs, const float *xf, float *sc,           \
                          const uint8_t *pk, float *y, int64_t M, int64_t g, int64_t N, int64_t K) { \
    i16_group_impl(FMT_##F, xq, xs, xf, sc, pk, y, M, g, N, K);                                     \
}
I16_GROUP_FN(Q8_0)
I16_GROUP_FN(Q4_0)
I16_GROUP_FN(Q4_1)

/* x: float32 [M, K]; pk: gguf_pack_i16's layout of N rows; y: float32 [M, N]. Returns 0, or -1
   for another format, N not a multiple of 8 or K of 32, -2 where memory ran out. */
int gguf_linear_i16(int fmt, const float *x, const uint8_t *pk, float *y, int64_t M, int64_t N,
                    int64_t K) {
    i16_group_fn fn = fmt == FMT_Q8_0 ? i16_group_Q8_0 : fmt == FMT_Q4_0 ? i16_group_Q4_0
                    : fmt == FMT_Q4_1 ? i16_group_Q4_1 : 0;
    if (fn == 0 || N % 8 || K % QK) return -1;
    if (M == 0) return 0;
    int floats = i16_float_rows > 0 && M >= i16_float_rows, scratch = floats || M >= I16_PANEL_ROWS;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * M * K);
    float *xs = (float *)malloc(sizeof(float) * 2 * M * (K / QK));
    float *xf = floats ? (float *)malloc(sizeof(float) * M * K) : 0;
    if (!xq || !xs || (floats && !xf)) {
        free(xq);
        free(xs);
        free(xf);
        return -2;
    }
    /* the input rounded by all the threads (runs of 64 blocks) where it is large enough to pay
       for the barrier after it (a decode row's input: well under a microsecond), else first */
    int failed = 0, xbits = i16_bits(fmt);
    int64_t blocks = M * K / QK;
    int shared_input = blocks >= I16_SHARED_INPUT;
    if (!shared_input) {
        i16_input(x, xq, xs, 0, blocks, xbits);
        if (floats)
            for (int64_t i = 0; i < M * K; i++) xf[i] = (float)xq[i];
    }
    #pragma omp parallel
    {
        if (shared_input) {
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b += 64) {
                int64_t e = b + 64 < blocks ? b + 64 : blocks;
                i16_input(x, xq, xs, b, e, xbits);
                if (floats)
                    for (int64_t i = b * QK; i < e * QK; i++) xf[i] = (float)xq[i];
            }
        }
        float *sc = scratch ? (float *)aligned_alloc(64, sizeof(float) * 16 * K) : 0;
        if (scratch && !sc) {
            #pragma omp atomic write
            failed = 1;
        }
        /* guided: long runs of consecutive groups first (a stream the prefetchers follow),
           then shorter ones, so a preempted thread's share is taken over by the other */
        /* runs of I16_ROW_RUN input rows, so a run's X stays in L2 while the weights pass */
        for (int64_t m0 = 0; m0 < M; m0 += I16_ROW_RUN) {
            int64_t rows = M - m0 < I16_ROW_RUN ? M - m0 : I16_ROW_RUN;
            #pragma omp for schedule(guided)
            for (int64_t g = 0; g < N / 8; g += 2)  /* pairs of groups: 16 rows */
                if (!scratch || sc)
                    fn(xq + m0 * K, xs + m0 * (K / QK) * 2, xf ? xf + m0 * K : 0, sc, pk, y + m0 * N, rows, g, N, K);
        }
        free(sc);
    }
    free(xq);
    free(xs);
    free(xf);
    return failed ? -2 : 0;
}

/* The input as gguf_linear_i16 rounds it for format fmt: float32 [M, K] (X * s per block; tests). */
int gguf_input_i16(int fmt, const float *x, float *out, int64_t M, int64_t K) {
    if (K % QK || !i16_unit_bytes(fmt)) return -1;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * M * K + 2);
    float *xs = (float *)malloc(sizeof(float) * 2 * M * (K / QK) + 4);
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -2;
    }
    i16_input(x, xq, xs, 0, M * K / QK, i16_bits(fmt));
    for (int64_t i = 0; i < M * K; i++) out[i] = (float)xq[i] * xs[(i / QK) * 2];
    free(xq);
    free(xs);
    return 0;
}

/* ---- 8-bit input: gguf_linear_i8 (prompt rows, --prefill-dtype int8) ----
   The 4-bit formats' exact weights (gguf_pack_i16's layout: no copy of its own) against the
   input rounded per block of 32 to int8 as llama.cpp rounds its Q8_0 activations, X =
   round(x * 127 / max|x|), s = max|x| / 127 (7 bits of the block's largest, where bfloat16
   keeps 8 of each number and the 16-bit kernel 15). Each block's 32 products are summed
   exactly (|sum| <= 32 * 15 * 127 < 2^16) and then scaled as i16_scaled does: P * (d * s),
   then m * (s * sum(X)), blocks in order. The same bits in every build, tile and M.
   A weight quad holds a row's 4 consecutive nibbles as bytes (0..15: unsigned, as VPMADDUBSW
   and VPDPBUSD take their first operand), so one instruction multiplies 4 weights of 8 (ymm)
   or 16 (zmm) rows by a broadcast of 4 input bytes: twice the products of VPMADDWD /
   VPDPWSSD. Without VNNI, VPMADDUBSW's 16-bit pair sums (|.| <= 2 * 15 * 127) are added in 16
   bits over a block's 8 quads (<= 30,480: no saturation) and widened once by VPMADDWD with
   ones; with AVX-VNNI / AVX512-VNNI, VPDPBUSD sums into 32 bits directly.
   Panel (i8_ipanel, once per call for a pair of groups, from the packed nibbles): ip [nb][8
   quads][2 groups][32 bytes], 32-bit lane L of a group's quad q holding row L's elements 4q ..
   4q + 3. */
#define I8_PANEL_BLOCKS 64  /* 32 KB of quads at most */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define I8_YDOT(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#define I8_YSUM(P) (P)
#elif defined(__AVXVNNI__)
#define I8_YDOT(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define I8_YSUM(P) (P)
#else
#define I8_YDOT(acc, w, x) _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))
#define I8_YSUM(P) _mm256_madd_epi16(P, _mm256_set1_epi16(1))
#endif

/* x [M, K] -> xq [M, K] (int8) and per block {s, s * sum(X)} at xs: blocks [b0, b1) */
static void i8_input(const float *x, int8_t *xq, float *xs, int64_t b0, int64_t b1) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = b0 * QK; i < b1 * QK; i += QK) {
        __m256 v[4], mx = _mm256_setzero_ps();
        UNROLL for (int c = 0; c < 4; c++) {
            v[c] = _mm256_loadu_ps(x + i + 8 * c);
            mx = _mm256_max_ps(mx, _mm256_and_ps(v[c], absmask));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        float top = _mm_cvtss_f32(h);
        /* blocks below 2^-100 (and NaN's, which compare false) round to zero */
        int zero = !(top >= 0x1p-100f);
        float s = zero ? 0.0f : top / 127.0f;
        __m256 iv = _mm256_set1_ps(zero ? 0.0f : 127.0f / top);
        __m256i q[4], sum = _mm256_setzero_si256();
        UNROLL for (int c = 0; c < 4; c++) {  /* to nearest even, within +-127 */
            q[c] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[c], iv)), hi), lo);
            sum = _mm256_add_epi32(sum, q[c]);
        }
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + i), _mm256_permutevar8x32_epi32(b, order));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        xs[(i / QK) * 2] = s;
        xs[(i / QK) * 2 + 1] = s * (float)_mm_cvtsi128_si32(t);
    }
}

/* Groups g and g + 1 (g alone: `two` 0, the second half zero) of a 4-bit matrix's packed
   blocks [b0, b1) -> ip (the quads above) */
static inline __attribute__((always_inline)) void i8_ipanel(int fmt, const uint8_t *pk, uint8_t *ip,
        int64_t g, int two, int64_t K, int64_t b0, int64_t b1) {
    int64_t nb = K / QK, ub = i16_unit_bytes(fmt);
    /* per 128-bit half of packus(pair 2c, pair 2c + 1): lane L's words of the two pairs */
    const __m256i ctl = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                         0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    for (int h = 0; h < 2; h++) {
        const uint8_t *u = pk + ((g + h) * nb + b0) * ub;
        for (int64_t b = 0; b < b1 - b0; b++, u += ub) {
            uint8_t *o = ip + b * 512 + h * 32;
            if (h && !two) {
                for (int q = 0; q < 8; q++) _mm256_store_si256((__m256i *)(o + 64 * q), _mm256_setzero_si256());
                continue;
            }
            UNROLL for (int c = 0; c < 4; c++) {
                __m256i pv[4];
                i16_quad(u + i16_pairs_at(fmt), c, pv);
                _mm256_store_si256((__m256i *)(o + 64 * (2 * c)), _mm256_shuffle_epi8(_mm256_packus_epi16(pv[0], pv[1]), ctl));
                _mm256_store_si256((__m256i *)(o + 64 * (2 * c + 1)), _mm256_shuffle_epi8(_mm256_packus_epi16(pv[2], pv[3]), ctl));
            }
        }
    }
}

/* Groups g (and g + 1 where `two`) against input rows j0 .. j0 + MR - 1 over blocks [b0, b1)
   (their quads in ip): the rows' float32 sums in registers, from 0 at block 0, else from what
   the blocks before b0 left in y */
#define I8_PTILE(MR)                                                                                 \
static inline __attribute__((always_inline)) void i8_ptile_##MR(int fmt, const int8_t *xq,          \
        const float *xs, const uint8_t *pk, const uint8_t *ip, float *y, int64_t j0, int64_t g,      \
        int two, int64_t N, int64_t K, int64_t b0, int64_t b1) {                                     \
    int64_t nb = K / QK, ub = i16_unit_bytes(fmt);                                                   \
    const uint8_t *u0 = pk + (g * nb + b0) * ub, *u1 = two ? u0 + nb * ub : u0;                      \
    __m256 A0[MR], A1[MR];                                                                           \
    UNROLL for (int j = 0; j < MR; j++) {                                                            \
        A0[j] = b0 ? _mm256_loadu_ps(y + (j0 + j) * N + 8 * g) : _mm256_setzero_ps();                \
        A1[j] = b0 && two ? _mm256_loadu_ps(y + (j0 + j) * N + 8 * g + 8) : _mm256_setzero_ps();     \
    }                                                                                                \
    for (int64_t b = b0; b < b1; b++, u0 += ub, u1 += ub) {                                          \
        __m256i P0[MR], P1[MR];                                                                      \
        UNROLL for (int j = 0; j < MR; j++) P0[j] = P1[j] = _mm256_setzero_si256();                  \
        const uint8_t *w = ip + (b - b0) * 512;                                                      \
        const int8_t *x = xq + j0 * K + b * QK;                                                      \
        _Pragma("GCC unroll 2") for (int q = 0; q < 8; q++) {                                        \
            __m256i w0 = _mm256_load_si256((const __m256i *)(w + 64 * q));                           \
            __m256i w1 = _mm256_load_si256((const __m256i *)(w + 64 * q + 32));                      \
            UNROLL for (int j = 0; j < MR; j++) {                                                    \
                int32_t xp;                                                                          \
                memcpy(&xp, x + j * K + 4 * q, 4);                                                   \
                __m256i xb = _mm256_set1_epi32(xp);                                                  \
                P0[j] = I8_YDOT(P0[j], w0, xb);                                                      \
                P1[j] = I8_YDOT(P1[j], w1, xb);                                                      \
            }                                                                                        \
        }                                                                                            \
        __m256 d0, m0, d1, m1;                                                                       \
        i16_dm(fmt, u0, &d0, &m0);                                                                   \
        i16_dm(fmt, u1, &d1, &m1);                                                                   \
        UNROLL for (int j = 0; j < MR; j++) {                                                        \
            const float *sx = xs + ((j0 + j) * nb + b) * 2;                                          \
            A0[j] = i16_scaled(fmt, _mm256_cvtepi32_ps(I8_YSUM(P0[j])), d0, m0, sx, A0[j]);          \
            A1[j] = i16_scaled(fmt, _mm256_cvtepi32_ps(I8_YSUM(P1[j])), d1, m1, sx, A1[j]);          \
        }                                                                                            \
    }                                                                                                \
    UNROLL for (int j = 0; j < MR; j++) {                                                            \
        _mm256_storeu_ps(y + (j0 + j) * N + 8 * g, A0[j]);                                           \
        if (two) _mm256_storeu_ps(y + (j0 + j) * N + 8 * g + 8, A1[j]);                              \
    }                                                                                                \
}
I8_PTILE(1) I8_PTILE(2) I8_PTILE(3)

#if defined(__AVX512BW__)
/* 64-byte tiles: a quad of both groups is one zmm (lanes 0-7 group g, 8-15 group g + 1, each
   through i8_ptile's operations in its order: the same bits) */
#if defined(__AVX512VNNI__)
#define I8_ZDOT(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define I8_ZSUM(P) (P)
#else
#define I8_ZDOT(acc, w, x) _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x))
#define I8_ZSUM(P) _mm512_madd_epi16(P, _mm512_set1_epi16(1))
#endif
#define I8_TILE_ROWS 8
#define I8_ZTILE(MR)                                                                                 \
static inline __attribute__((always_inline)) void i8_ztile_##MR(int fmt, const int8_t *xq,          \
        const float *xs, const uint8_t *pk, const uint8_t *ip, float *y, int64_t j0, int64_t g,      \
        int two, int64_t N, int64_t K, int64_t b0, int64_t b1) {                                     \
    int64_t nb = K / QK, ub = i16_unit_bytes(fmt);                                                   \
    const uint8_t *u0 = pk + (g * nb + b0) * ub, *u1 = two ? u0 + nb * ub : u0;                      \
    __mmask16 lanes = two ? 0xFFFF : 0x00FF;                                                         \
    __m512 A[MR];                                                                                    \
    UNROLL for (int j = 0; j < MR; j++)                                                              \
        A[j] = b0 ? _mm512_maskz_loadu_ps(lanes, y + (j0 + j) * N + 8 * g) : _mm512_setzero_ps();    \
    for (int64_t b = b0; b < b1; b++, u0 += ub, u1 += ub) {                                          \
        __m512i P[MR];                                                                               \
        UNROLL for (int j = 0; j < MR; j++) P[j] = _mm512_setzero_si512();                           \
        const uint8_t *w = ip + (b - b0) * 512;                                                      \
        const int8_t *x = xq + j0 * K + b * QK;                                                      \
        _Pragma("GCC unroll 2") for (int q = 0; q < 8; q++) {                                        \
            __m512i wv = _mm512_load_si512((const void *)(w + 64 * q));                              \
            UNROLL for (int j = 0; j < MR; j++) {                                                    \
                int32_t xp;                                                                          \
                memcpy(&xp, x + j * K + 4 * q, 4);                                                   \
                P[j] = I8_ZDOT(P[j], wv, _mm512_set1_epi32(xp));                                     \
            }                                                                                        \
        }                                                                                            \
        __m512 d, m;                                                                                 \
        i16_dm2(fmt, u0, u1, &d, &m);                                                                \
        UNROLL for (int j = 0; j < MR; j++)                                                          \
            A[j] = i16_zscaled(fmt, _mm512_cvtepi32_ps(I8_ZSUM(P[j])), d, m, xs + ((j0 + j) * nb + b) * 2, A[j]); \
    }                                                                                                \
    UNROLL for (int j = 0; j < MR; j++) _mm512_mask_storeu_ps(y + (j0 + j) * N + 8 * g, lanes, A[j]); \
}
I8_ZTILE(1) I8_ZTILE(2) I8_ZTILE(3) I8_ZTILE(4) I8_ZTILE(5) I8_ZTILE(6) I8_ZTILE(7) I8_ZTILE(8)
#define I8_TILE(R) i8_ztile_##R
#else
#define I8_TILE_ROWS 3
#define I8_TILE(R) i8_ptile_##R
#endif

static inline __attribute__((always_inline)) void i8_panel_tile(int fmt, const int8_t *xq, const float *xs,
        const uint8_t *pk, const uint8_t *ip, float *y, int64_t rows, int64_t j0, int64_t g, int two,
        int64_t N, int64_t K, int64_t b0, int64_t b1) {
    switch (rows) {
        case 1: I8_TILE(1)(fmt, xq, xs, pk, ip, y, j0, g, two, N, K, b0, b1); break;
        case 2: I8_TILE(2)(fmt, xq, xs, pk, ip, y, j0, g, two, N, K, b0, b1); break;
#if I8_TILE_ROWS > 3
        case 3: I8_TILE(3)(fmt, xq, xs, pk, ip, y, j0, g, two, N, K, b0, b1); break;
        case 4: I8_TILE(4)(fmt, xq, xs, pk, ip, y, j0, g, two, N, K, b0, b1); break;
        case 5: I8_TILE(5)(fmt, xq, xs, pk, ip, y, j0, g, two, N, K, b0, b1); break;
        case 6: I8_TILE(6)(fmt, xq, xs, pk, ip, y, j0, g, two, N, K, b0, b1); break;
        case 7: I8_TILE(7)(fmt, xq, xs, pk, ip, y, j0, g, two, N, K, b0, b1); break;
        default: I8_TILE(8)(fmt, xq, xs, pk, ip, y, j0, g, two, N, K, b0, b1); break;
#else
        default: I8_TILE(3)(fmt, xq, xs, pk, ip, y, j0, g, two, N, K, b0, b1); break;
#endif
    }
}

/* Groups g and g + 1 (g alone where it is the last) against all M input rows, the quads in
   chunks of at most I8_PANEL_BLOCKS blocks (ip: 512 bytes a block) */
static inline __attribute__((always_inline)) void i8_group_impl(int fmt, const int8_t *xq, const float *xs,
        uint8_t *ip, const uint8_t *pk, float *y, int64_t M, int64_t g, int64_t N, int64_t K) {
    int two = g + 1 < N / 8;
    int64_t nb = K / QK, chunk = i16_chunk(nb, I8_PANEL_BLOCKS);
    for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
        int64_t b1 = b0 + chunk < nb ? b0 + chunk : nb;
        i8_ipanel(fmt, pk, ip, g, two, K, b0, b1);
        for (int64_t j0 = 0; j0 < M; j0 += I8_TILE_ROWS)
            i8_panel_tile(fmt, xq, xs, pk, ip, y, M - j0 < I8_TILE_ROWS ? M - j0 : I8_TILE_ROWS, j0, g, two, N, K, b0, b1);
    }
}
typedef void (*i8_group_fn)(const int8_t *, const float *, uint8_t *, const uint8_t *, float *, int64_t,
                            int64_t, int64_t, int64_t);
#define I8_GROUP_FN(F)                                                                               \
static void i8_group_##F(const int8_t *xq, const float *xs, uint8_t *ip, const uint8_t *pk, float *y, \
                         int64_t M, int64_t g, int64_t N, int64_t K) {                               \
    i8_group_impl(FMT_##F, xq, xs, ip, pk, y, M, g, N, K);                                          \
}
I8_GROUP_FN(Q4_0)
I8_GROUP_FN(Q4_1)

/* x: float32 [M, K]; pk: gguf_pack_i16's layout of N rows of a Q4_0 / Q4_1 matrix; y: float32
   [M, N]. Returns 0, or -1 for another format, N not a multiple of 8 or K of 32, -2 where
   memory ran out. */
int gguf_linear_i8(int fmt, const float *x, const uint8_t *pk, float *y, int64_t M, int64_t N, int64_t K) {
    i8_group_fn fn = fmt == FMT_Q4_0 ? i8_group_Q4_0 : fmt == FMT_Q4_1 ? i8_group_Q4_1 : 0;
    if (fn == 0 || N % 8 || K % QK) return -1;
    if (M == 0) return 0;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *xs = (float *)malloc(sizeof(float) * 2 * M * (K / QK));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -2;
    }
    int failed = 0;
    int64_t blocks = M * K / QK, chunk = i16_chunk(K / QK, I8_PANEL_BLOCKS);
    int shared_input = blocks >= I16_SHARED_INPUT;
    if (!shared_input) i8_input(x, xq, xs, 0, blocks);
    #pragma omp parallel
    {
        if (shared_input) {
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b += 64) i8_input(x, xq, xs, b, b + 64 < blocks ? b + 64 : blocks);
        }
        uint8_t *ip = (uint8_t *)aligned_alloc(64, (size_t)(512 * chunk));
        if (!ip) {
            #pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += I16_ROW_RUN) {
            int64_t rows = M - m0 < I16_ROW_RUN ? M - m0 : I16_ROW_RUN;
            #pragma omp for schedule(guided)
            for (int64_t g = 0; g < N / 8; g += 2)
                if (ip) fn(xq + m0 * K, xs + m0 * (K / QK) * 2, ip, pk, y + m0 * N, rows, g, N, K);
        }
        free(ip);
    }
    free(xq);
    free(xs);
    return failed ? -2 : 0;
}

/* The input as gguf_linear_i8 rounds it: float32 [M, K] (X * s per block; tests) */
int gguf_input_i8(const float *x, float *out, int64_t M, int64_t K) {
    if (K % QK) return -1;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K) + 1);
    float *xs = (float *)malloc(sizeof(float) * 2 * M * (K / QK) + 4);
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -2;
    }
    i8_input(x, xq, xs, 0, M * K / QK);
    for (int64_t i = 0; i < M * K; i++) out[i] = (float)xq[i] * xs[(i / QK) * 2];
    free(xq);
    free(xs);
    return 0;
}
#endif

#if defined(__AVX512BF16__)
/* bfloat16 arithmetic over the same blocks (the avx512bf16 build; CPUs with AVX512_BF16).
   Each 32-weight block is dequantized exactly as above, rounded to bfloat16 (to nearest
   even: the numbers torch's .to(bfloat16) gives) and multiplied with the input rows rounded
   to bfloat16 by one VDPBF16PS (16 lanes, each adding two products into a float32 sum): half
   the multiply instructions of float32 and a panel half the size, where a batch of decodes is
   bound by the multiplies (all linears of a SmolLM2 step on a 2-core Zen 4: 16 rows 32 -> 20 ms,
   64 rows 109 -> 58 ms; one row the same, ~8 ms).
   As in float32, y[m, n] is one chain over k (one VDPBF16PS a block, in order) and one
   horizontal sum, in every path: bit-identical whatever M is. */
typedef __m512bh vb;

/* [sum a, sum b, sum c, sum d], each summed in exactly vhsum's order (256-bit halves, then
   128-bit halves, then lanes l and l + 2, then l and l + 1; additions commute exactly), with
   the steps shared: 22 instructions for four sums instead of 36. */
static inline __m128 vhsum4(vf a, vf b, vf c, vf d) {
    __m256 sa = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m256 sb = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    __m256 sc = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    __m256 sd = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(sa, sb, 0x20), _mm256_permute2f128_ps(sa, sb, 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(sc, sd, 0x20), _mm256_permute2f128_ps(sc, sd, 0x31));
    __m256 u = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    __m256 t = _mm256_add_ps(_mm256_shuffle_ps(u, u, 0x88), _mm256_shuffle_ps(u, u, 0xDD));
    /* t: [a, c, a, c | b, d, b, d] */
    return _mm_unpacklo_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* y[(m0 + j) * N + n0 + r] = sum of acc[r][j]: four output rows at a time where NR is a
   multiple of 4 (the indices are taken mod NR only so that the branch not taken compiles). */
#define store_sums(NR, MR, acc, y, m0, n0, N)                                              \
    do {                                                                                   \
        if ((NR) % 4 == 0) {                                                               \
            UNROLL for (int q = 0; q < (NR) / 4; q++)                                      \
                UNROLL for (int j = 0; j < (MR); j++)                                      \
                    _mm_storeu_ps((y) + ((m0) + j) * (N) + (n0) + 4 * q,                   \
                                  vhsum4(acc[(4 * q) % (NR)][j], acc[(4 * q + 1) % (NR)][j], \
                                         acc[(4 * q + 2) % (NR)][j], acc[(4 * q + 3) % (NR)][j])); \
        } else {                                                                           \
            UNROLL for (int r = 0; r < (NR); r++)                                          \
                UNROLL for (int j = 0; j < (MR); j++)                                      \
                    (y)[((m0) + j) * (N) + (n0) + r] = vhsum(acc[r][j]);                   \
        }                                                                                  \
    } while (0)

/* Block b of a row as 32 bfloat16 weights, in order. */
static inline __attribute__((always_inline)) vb wblock_bf16(int fmt, const uint8_t *row, int64_t b,
                                                            vf d, vf m) {
    return _mm512_cvtne2ps_pbh(dequant(fmt, row, b, 1, d, m), dequant(fmt, row, b, 0, d, m));
}

static inline vb xload_bf16(const uint16_t *p) { return (vb)_mm512_loadu_si512((const void *)p); }

/* Direct tile (bf16): NR output rows x MR input rows; weights converted as they are used. */
#define DTILEB(NR, MR)                                                                     \
static inline __attribute__((always_inline)) void dtileb_##NR##x##MR(int fmt, const uint16_t *x, \
        const uint8_t *w, float *y, int64_t m0, int64_t n0, int64_t N, int64_t K, int64_t rb) { \
    vf acc[NR][MR];                                                                        \
    UNROLL for (int r = 0; r < NR; r++)                                                    \
        UNROLL for (int j = 0; j < MR; j++) acc[r][j] = vzero();                           \
    const uint16_t *xr = x + m0 * K;                                                       \
    for (int64_t b = 0; b < K / QK; b++) {                                                 \
        vf d[NR], mm[NR];                                                                  \
        vf wb[NR][NCH];                                                                    \
        UNROLL for (int r = 0; r < NR; r++) {                                              \
            if (WHOLE_BLOCK(fmt)) dequant_block(fmt, w + (n0 + r) * rb + b * block_bytes(fmt), wb[r]); \
            else block_params(fmt, w + (n0 + r) * rb, b, &d[r], &mm[r]);                   \
        }                                                                                  \
        UNROLL for (int r = 0; r < NR; r++)                                                \
            _mm_prefetch((const char *)(w + (n0 + r + PREFETCH_ROWS) * rb + block_offset(fmt, b)), \
                         _MM_HINT_T0);                                                     \
        UNROLL for (int r = 0; r < NR; r++) {                                              \
            vb wv = wblock_bf16(fmt, w + (n0 + r) * rb, b, d[r], mm[r]);                   \
            UNROLL for (int j = 0; j < MR; j++)                                            \
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xload_bf16(xr + j * K + b * QK)); \
        }                                                                                  \
    }                                                                                      \
    store_sums(NR, MR, acc, y, m0, n0, N);                                                 \
}
DTILEB(4, 1)
DTILEB(4, 2)
DTILEB(4, 3)
DTILEB(4, 4)
DTILEB(2, 5)
DTILEB(1, 1)
DTILEB(1, 2)
DTILEB(1, 3)
DTILEB(1, 4)

static inline __attribute__((always_inline)) void direct_rows_bf16(int fmt, int nr, const uint16_t *x,
        const uint8_t *w, float *y, int64_t M, int64_t n, int64_t N, int64_t K, int64_t rb) {
    for (int64_t m = 0; m < M; m += 4) {
        int64_t mr = M - m < 4 ? M - m : 4;
        if (nr == 4) {
            if (mr == 4) dtileb_4x4(fmt, x, w, y, m, n, N, K, rb);
            else if (mr == 3) dtileb_4x3(fmt, x, w, y, m, n, N, K, rb);
            else if (mr == 2) dtileb_4x2(fmt, x, w, y, m, n, N, K, rb);
            else dtileb_4x1(fmt, x, w, y, m, n, N, K, rb);
        } else {
            if (mr == 4) dtileb_1x4(fmt, x, w, y, m, n, N, K, rb);
            else if (mr == 3) dtileb_1x3(fmt, x, w, y, m, n, N, K, rb);
            else if (mr == 2) dtileb_1x2(fmt, x, w, y, m, n, N, K, rb);
            else dtileb_1x1(fmt, x, w, y, m, n, N, K, rb);
        }
    }
}

/* Panel tile (bf16): NR rows of the bfloat16 panel p ([rows][K]) x MR input rows. The MR
   input blocks are loaded once per block into registers and each weight row's block once:
   NR + MR loads for NR * MR VDPBF16PS (8 x 3: 11 loads for 24; a load per product bound the
   4 x 6 tile). */
#define PTILEB(NR, MR)                                                                     \
static inline void ptileb_##NR##x##MR(const uint16_t *x, const uint16_t *p, float *y, int64_t m0, \
                                      int64_t n0, int64_t N, int64_t K) {                  \
    vf acc[NR][MR];                                                                        \
    UNROLL for (int r = 0; r < NR; r++)                                                    \
        UNROLL for (int j = 0; j < MR; j++) acc[r][j] = vzero();                           \
    const uint16_t *xr = x + m0 * K;                                                       \
    for (int64_t k = 0; k < K; k += QK) {                                                  \
        vb xv[MR];                                                                         \
        UNROLL for (int j = 0; j < MR; j++) xv[j] = xload_bf16(xr + j * K + k);            \
        UNROLL for (int r = 0; r < NR; r++) {                                              \
            vb wv = xload_bf16(p + r * K + k);                                             \
            UNROLL for (int j = 0; j < MR; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xv[j]); \
        }                                                                                  \
    }                                                                                      \
    store_sums(NR, MR, acc, y, m0, n0, N);                                                 \
}
PTILEB(8, 3) PTILEB(8, 2) PTILEB(8, 1)
PTILEB(1, 4) PTILEB(1, 3) PTILEB(1, 2) PTILEB(1, 1)

static inline void panel_rows_bf16(const uint16_t *x, const uint16_t *pan, float *y, int64_t M,
                                   int64_t n0, int64_t nr, int64_t N, int64_t K) {
    int64_t r = 0;
    for (; r + 8 <= nr; r += 8) {
        const uint16_t *p = pan + r * K;
        int64_t m = 0;
        for (; m + 3 <= M; m += 3) ptileb_8x3(x, p, y, m, n0 + r, N, K);
        switch (M - m) {
            case 2: ptileb_8x2(x, p, y, m, n0 + r, N, K); break;
            case 1: ptileb_8x1(x, p, y, m, n0 + r, N, K); break;
        }
    }
    for (; r < nr; r++) {
        const uint16_t *p = pan + r * K;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) ptileb_1x4(x, p, y, m, n0 + r, N, K);
        switch (M - m) {
            case 3: ptileb_1x3(x, p, y, m, n0 + r, N, K); break;
            case 2: ptileb_1x2(x, p, y, m, n0 + r, N, K); break;
            case 1: ptileb_1x1(x, p, y, m, n0 + r, N, K); break;
        }
    }
}

static inline __attribute__((always_inline)) void group_impl_bf16(
        const int fmt, const uint16_t *x, const uint8_t *w, float *y, uint16_t *pan, int64_t M,
        int64_t n0, int64_t nr, int64_t N, int64_t K) {
    int64_t rb = row_bytes(fmt, K), n = n0, end = n0 + nr;
    if (M < PANEL_MIN_ROWS_BF16) {
        if (M == 5)  /* one pass of 2 x 5 converts each block once (4 + 1 converted it twice) */
            for (; n + 2 <= end; n += 2) dtileb_2x5(fmt, x, w, y, 0, n, N, K, rb);
        for (; n + 4 <= end; n += 4) direct_rows_bf16(fmt, 4, x, w, y, M, n, N, K, rb);
        for (; n < end; n++) direct_rows_bf16(fmt, 1, x, w, y, M, n, N, K, rb);
        return;
    }
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *row = w + (n0 + r) * rb;
        for (int64_t b = 0; b < K / QK; b++) {
            _mm_prefetch((const char *)(row + PREFETCH_ROWS * rb + block_offset(fmt, b)), _MM_HINT_T0);
            if (WHOLE_BLOCK(fmt)) {
                vf wb[NCH];
                dequant_block(fmt, row + b * block_bytes(fmt), wb);
                UNROLL for (int c = 0; c < NCH; c++) vstorea(pan + r * K + b * QK + c * VW, wb[c]);
                continue;
            }
            vf d, mm;
            block_params(fmt, row, b, &d, &mm);
            _mm512_store_si512((void *)(pan + r * K + b * QK), (__m512i)wblock_bf16(fmt, row, b, d, mm));
        }
    }
    panel_rows_bf16(x, pan, y, M, n0, nr, N, K);
}

typedef void (*group_bf16_fn)(const uint16_t *, const uint8_t *, float *, uint16_t *, int64_t,
                              int64_t, int64_t, int64_t, int64_t);
#define GROUP_BF16_FN(F)                                                                     \
static void group_bf16_##F(const uint16_t *x, const uint8_t *w, float *y, uint16_t *pan,     \
                           int64_t M, int64_t n0, int64_t nr, int64_t N, int64_t K) {        \
    group_impl_bf16(FMT_##F, x, w, y, pan, M, n0, nr, N, K);                                \
}
GROUP_BF16_FN(Q8_0)
GROUP_BF16_FN(Q4_0)
GROUP_BF16_FN(Q4_1)
GROUP_BF16_FN(Q4_K)
GROUP_BF16_FN(Q6_K)

/* As gguf_linear, in bfloat16 arithmetic: x is rounded to bfloat16 once (to nearest even),
   each block of weights as it is dequantized; products summed in float32. */
int gguf_linear_bf16(int fmt, const float *x, const uint8_t *w, float *y, int64_t M, int64_t N,
                     int64_t K) {
    group_bf16_fn fn = fmt == FMT_Q8_0 ? group_bf16_Q8_0 : fmt == FMT_Q4_0 ? group_bf16_Q4_0
                     : fmt == FMT_Q4_1 ? group_bf16_Q4_1 : fmt == FMT_Q4_K ? group_bf16_Q4_K
                     : fmt == FMT_Q6_K ? group_bf16_Q6_K : 0;
    if (fn == 0 || row_bytes(fmt, K) == 0) return -1;
    if (M == 0) return 0;
    uint16_t *xb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * M * K);
    for (int64_t i = 0; i < M * K; i += QK)
        _mm512_store_si512((void *)(xb + i), (__m512i)_mm512_cvtne2ps_pbh(vload(x + i + VW), vload(x + i)));
    int64_t groups = (N + GROUP - 1) / GROUP;
    #pragma omp parallel
    {
        uint16_t *pan = M < PANEL_MIN_ROWS_BF16 ? 0
                      : (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * GROUP * K);
        #pragma omp for schedule(guided)
        for (int64_t g = 0; g < groups; g++) {
            int64_t n0 = g * GROUP;
            fn(xb, w, y, pan, M, n0, n0 + GROUP < N ? GROUP : N - n0, N, K);
        }
        free(pan);
    }
    free(xb);
    return 0;
}

/* The weights as the bf16 path multiplies them: bfloat16 bits [N, K] (tests). */
int gguf_dequantize_bf16(int fmt, const uint8_t *w, uint16_t *out, int64_t N, int64_t K) {
    int64_t rb = block_bytes(fmt) ? row_bytes(fmt, K) : 0;
    if (rb == 0) return -1;
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < K / QK; b++) {
            vf d, mm;
            block_params(fmt, w + n * rb, b, &d, &mm);
            _mm512_storeu_si512((void *)(out + n * K + b * QK), (__m512i)wblock_bf16(fmt, w + n * rb, b, d, mm));
        }
    return 0;
}
#endif
