/* Decode rows over a GGUF file's Q4_0, Q4_1 and Q8_0 blocks, interleaved 16 weight rows at a
   time: y[m, n] = sum_k x[m, k] * w[n, k] with the file's exact weights and x rounded to
   bfloat16. Built with AVX-512 BF16 (gguf_kernels.py loads it where the CPU has it).

   Each block of 32 weights of a row is d * q + m (Q4_1), d * (q - 8) (Q4_0) or d * q (Q8_0),
   so a row's dot product with x over the block is d * sum(q * x) + m * sum(x): the integers q
   are exact in bfloat16, their products with bfloat16 x exact in float32, and VDPBF16PS sums
   them; the scales are applied once per block. Nothing about the weights is rounded (the
   bfloat16 dot-product kernel of gguf_linear.c rounds each weight to bfloat16 first).

   Layout (`gguf_pack_il16`, a permutation of the file's numbers, the same size): for each
   group of 16 rows and each block, the 16 rows' d (float16), then their m (Q4_1), then 16
   pairs of the block's elements (2p, 2p + 1): 32 values, value v being row v / 2's element
   2p + v % 2, as nibbles, four pairs to 64 bytes (nibble_at), or 32 int8 a pair (Q8_0).
   A pair widens to one vector of 32 bfloat16 (byte lookups by nibble, four pairs at a time:
   quad_q; or int8 converted) whose 16 lanes are the 16 rows, so VDPBF16PS with the input's
   pair broadcast adds both products to each row's lane (its memory operand broadcast: one
   instruction a product pair): no per-row horizontal sum, and a block's 16 rows cost 16
   lookups where dequantizing them one by one cost 16 x 11 instructions. All linears of a
   SmolLM2 step, 2-core Zen 4, against gguf_linear.c's bfloat16 kernel in the same process:
   one row 9.1 -> 4.4 ms (the memory's pace: 96 MB); 8 rows 13.8 -> 7.3; 16 rows 18.9 ->
   13.2; 32 rows 29.9 -> 25.0; 64 rows 53.4 -> 49.7 (bound by VDPBF16PS); 96 rows 73.3 -> 72.8.

   y[m, n] is, in every path, one chain per block (the pairs in order) then d and m applied
   in block order: a row's result is bit-identical whatever M is and whatever else is in the
   batch. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "silu512.h"

enum { FMT_Q8_0 = 8, FMT_Q4_0 = 2, FMT_Q4_1 = 3 };
#define QK 32
#define MC 8 /* input rows per tile: 8 accumulators and 8 block sums in registers */
#define UNROLL _Pragma("GCC unroll 16")

static inline int64_t file_bytes(int fmt) {
    return fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : 0;
}

/* bytes of one (16 rows, block) unit: 16 x the file's block */
static inline int64_t unit_bytes(int fmt) { return 16 * file_bytes(fmt); }

/* where a unit's pairs begin: after d (and m for Q4_1) */
static inline int64_t pairs_at(int fmt) { return fmt == FMT_Q4_1 ? 64 : 32; }

/* element e (0..31) of a file block, as the integer its format stores */
static inline int file_q(int fmt, const uint8_t *blk, int e) {
    if (fmt == FMT_Q8_0) return (int8_t)blk[2 + e];
    const uint8_t *qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
    return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
}

/* 4-bit formats: the byte of a unit's pairs holding value v (0..31) of pair p (0..15), in the
   low half for pairs 4Q and 4Q + 1 of quad Q, the high half for 4Q + 2 and 4Q + 3: quad Q is
   64 bytes, its 16-byte lane k holding values 8k .. 8k + 7 of pairs 4Q and 4Q + 2 in bytes
   0..7 and of pairs 4Q + 1 and 4Q + 3 in bytes 8..15 (see quad_q). */
static inline int nibble_at(int p, int v) { return (p / 4) * 64 + (v / 8) * 16 + (p & 1) * 8 + v % 8; }

/* w: N rows of K weights in the file's blocks -> out (same size), interleaved as above.
   Returns 0, or -1 for another format, N not a multiple of 16 or K of 32. */
int gguf_pack_il16(int fmt, const uint8_t *w, uint8_t *out, int64_t N, int64_t K) {
    int64_t fb = file_bytes(fmt), ub = unit_bytes(fmt);
    if (!fb || N % 16 || K % QK) return -1;
    int64_t nb = K / QK, rb = nb * fb;
    memset(out, 0, (size_t)(N / 16 * nb * ub));
    for (int64_t g = 0; g < N / 16; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (g * nb + b) * ub, *pairs = dst + pairs_at(fmt);
            for (int r = 0; r < 16; r++) {
                const uint8_t *blk = w + (16 * g + r) * rb + b * fb;
                memcpy(dst + 2 * r, blk, 2);
                if (fmt == FMT_Q4_1) memcpy(dst + 32 + 2 * r, blk + 2, 2);
            }
            for (int p = 0; p < 16; p++)
                for (int v = 0; v < 32; v++) {
                    int q = file_q(fmt, w + (16 * g + v / 2) * rb + b * fb, 2 * p + v % 2);
                    if (fmt == FMT_Q8_0) pairs[p * 32 + v] = (uint8_t)(int8_t)q;
                    else pairs[nibble_at(p, v)] |= (uint8_t)(q << (p & 2 ? 4 : 0));
                }
        }
    return 0;
}

/* acc + the pairwise products of w with the input pair at p broadcast (VDPBF16PS with its
   memory operand broadcast: GCC keeps a separate broadcast for the intrinsic) */
static inline __m512 dp_bcast(__m512 acc, __m512bh w, const uint16_t *p) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* Rows another kernel reads next, prefetched into L2 a few per block by the next
   gguf_linear_il16 call, spread over its work: the engine's decode step hands it the layer's
   K/V rows before the Q/K/V multiply (fused_avx2.c decode_layers), so the attention after it
   finds them in cache instead of waiting on memory (its multiply is bound by VDPBF16PS, the
   attention by memory latency). rows: n addresses of `lines` 64-byte lines each; kept until
   that call (one caller thread). */
struct side { const char *const *rows; int64_t n, lines; };
static struct side next_side;
void gguf_il16_prefetch_next(const char *const *rows, int64_t n, int64_t lines) {
    next_side.rows = rows;
    next_side.lines = lines;
    next_side.n = rows && lines > 0 ? n : 0;
}

/* Q8_0 pair p of a unit as 32 bfloat16: lane l = row l's elements 2p and 2p + 1 */
static inline __attribute__((always_inline)) __m512bh pair_q8(const uint8_t *pairs, int p) {
    const uint8_t *s = pairs + p * 32;
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)s)));
    __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(s + 16))));
    return _mm512_cvtne2ps_pbh(c, a);  /* |q| <= 128: exact */
}

/* Pairs 4Q .. 4Q + 3 of a unit as 32 bfloat16 each (lane l = row l's elements 2p and 2p + 1):
   Q8_0 by pair_q8; the 4-bit formats' quad Q (nibble_at) in one 64-byte load, its nibbles to
   the bfloat16 numbers' low and high bytes by 16-entry byte lookups (VPSHUFB), the two
   interleaved into each pair's 32 values in order: 11 instructions for four pairs, where
   widening a pair's 16 bytes and looking up its 32 nibbles as words took ~6 a pair, most of
   them on the one shuffle port. The same numbers; all linears of a SmolLM2 step on the AMX
   Xeon: one row 4.47 -> 3.75 ms, 16 rows 6.60 -> 6.00, 64 rows 25.2 -> 25.0; VDPBF16PS
   (no AMX) 8 rows 13.2 -> 12.3, 16 rows 25.5 -> 23.6. */
static const uint8_t BF16_NIBBLE_LO[16] = {0x00, 0x80, 0x00, 0x40, 0x80, 0xA0, 0xC0, 0xE0,
                                          0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70};
static const uint8_t BF16_NIBBLE_HI[16] = {0x00, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
                                          0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41};
static inline __attribute__((always_inline)) void quad_q(int fmt, const uint8_t *pairs, int Q,
                                                        __m512bh out[4]) {
    if (fmt == FMT_Q8_0) {
        for (int i = 0; i < 4; i++) out[i] = pair_q8(pairs, 4 * Q + i);
        return;
    }
    const __m512i tlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)BF16_NIBBLE_LO));
    const __m512i thi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)BF16_NIBBLE_HI));
    const __m512i mask = _mm512_set1_epi8(15);
    __m512i v = _mm512_loadu_si512((const void *)(pairs + 64 * Q));
    __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    __m512i lol = _mm512_shuffle_epi8(tlo, lo), loh = _mm512_shuffle_epi8(thi, lo);
    __m512i hil = _mm512_shuffle_epi8(tlo, hi), hih = _mm512_shuffle_epi8(thi, hi);
    out[0] = (__m512bh)_mm512_unpacklo_epi8(lol, loh);
    out[1] = (__m512bh)_mm512_unpackhi_epi8(lol, loh);
    out[2] = (__m512bh)_mm512_unpacklo_epi8(hil, hih);
    out[3] = (__m512bh)_mm512_unpackhi_epi8(hil, hih);
}

/* Input rows j0 .. j0 + MR - 1 against the 16 rows of group g. xb: the inputs in bfloat16
   [M, K]; xs: each input row's block sums [M, K / 32] (of the bfloat16 values). */
#define TILE(MR)                                                                                      \
static inline __attribute__((always_inline)) void tile_##MR(int fmt, const uint16_t *xb,             \
        const float *xs, const uint8_t *pk, float *y, int64_t j0, int64_t g, int64_t N, int64_t K,    \
        const struct side *sd, int64_t p0, int64_t p1) {                                              \
    int64_t nb = K / QK, ub = unit_bytes(fmt);                                                        \
    const uint8_t *unit = pk + g * nb * ub;                                                           \
    __m512 acc[MR];                                                                                   \
    UNROLL for (int j = 0; j < MR; j++) acc[j] = _mm512_setzero_ps();                                 \
    for (int64_t b = 0; b < nb; b++, unit += ub) {                                                    \
        for (int64_t o = 0; o < ub; o += 64)  /* four units ahead */                                  \
            _mm_prefetch((const char *)(unit + 4 * ub + o), _MM_HINT_T0);                            \
        for (int64_t r = p0 + (p1 - p0) * b / nb, e = p0 + (p1 - p0) * (b + 1) / nb; r < e; r++)     \
            for (int64_t l = 0; l < sd->lines; l++)                                                   \
                _mm_prefetch(sd->rows[r] + 64 * l, _MM_HINT_T0);                                      \
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)unit));                       \
        __m512 m = fmt == FMT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + 32))) \
                 : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));  /* Q4_0: d * (q - 8) */                 \
        __m512 part[MR];                                                                              \
        UNROLL for (int j = 0; j < MR; j++) part[j] = _mm512_setzero_ps();                            \
        UNROLL for (int Q = 0; Q < 4; Q++) {                                                          \
            __m512bh wq[4];                                                                           \
            quad_q(fmt, unit + pairs_at(fmt), Q, wq);                                                 \
            UNROLL for (int i = 0; i < 4; i++)                                                        \
                UNROLL for (int j = 0; j < MR; j++)                                                   \
                    part[j] = dp_bcast(part[j], wq[i],                                                \
                                       xb + (j0 + j) * K + b * QK + 2 * (4 * Q + i));                 \
        }                                                                                             \
        UNROLL for (int j = 0; j < MR; j++) {                                                         \
            acc[j] = _mm512_fmadd_ps(d, part[j], acc[j]);                                             \
            if (fmt != FMT_Q8_0)                                                                      \
                acc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[(j0 + j) * nb + b]), acc[j]);           \
        }                                                                                             \
    }                                                                                                 \
    UNROLL for (int j = 0; j < MR; j++) _mm512_storeu_ps(y + (j0 + j) * N + 16 * g, acc[j]);         \
}
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)

/* Group g's share of the side rows, [q0, q1), spread over its tiles' blocks. */
static inline __attribute__((always_inline)) void group_impl(int fmt, const uint16_t *xb, const float *xs,
        const uint8_t *pk, float *y, int64_t M, int64_t g, int64_t N, int64_t K, const struct side *sd) {
    int64_t q0 = sd->n * g / (N / 16), q1 = sd->n * (g + 1) / (N / 16), tiles = (M + MC - 1) / MC;
    for (int64_t j0 = 0; j0 < M; j0 += MC) {
        int64_t t = j0 / MC, p0 = q0 + (q1 - q0) * t / tiles, p1 = q0 + (q1 - q0) * (t + 1) / tiles;
        switch (M - j0 < MC ? M - j0 : MC) {
            case 1: tile_1(fmt, xb, xs, pk, y, j0, g, N, K, sd, p0, p1); break;
            case 2: tile_2(fmt, xb, xs, pk, y, j0, g, N, K, sd, p0, p1); break;
            case 3: tile_3(fmt, xb, xs, pk, y, j0, g, N, K, sd, p0, p1); break;
            case 4: tile_4(fmt, xb, xs, pk, y, j0, g, N, K, sd, p0, p1); break;
            case 5: tile_5(fmt, xb, xs, pk, y, j0, g, N, K, sd, p0, p1); break;
            case 6: tile_6(fmt, xb, xs, pk, y, j0, g, N, K, sd, p0, p1); break;
            case 7: tile_7(fmt, xb, xs, pk, y, j0, g, N, K, sd, p0, p1); break;
            default: tile_8(fmt, xb, xs, pk, y, j0, g, N, K, sd, p0, p1); break;
        }
    }
}

typedef void (*group_fn)(const uint16_t *, const float *, const uint8_t *, float *, int64_t, int64_t,
                         int64_t, int64_t, const struct side *);
#define GROUP_FN(F)                                                                                   \
static void group_##F(const uint16_t *xb, const float *xs, const uint8_t *pk, float *y, int64_t M,   \
                      int64_t g, int64_t N, int64_t K, const struct side *sd) {                      \
    group_impl(FMT_##F, xb, xs, pk, y, M, g, N, K, sd);                                              \
}
GROUP_FN(Q8_0)
GROUP_FN(Q4_0)
GROUP_FN(Q4_1)

/* One block of 32 inputs to bfloat16 (to nearest even) at xb, returning the sum of those
   bfloat16 values (the block sum m multiplies). */
static inline float input_block(const float *x, uint16_t *xb) {
    __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
    _mm512_store_si512((void *)xb, (__m512i)v);
    __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256((__m512i)v));
    __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64((__m512i)v, 1));
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                                              _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16))));
}

/* x: float32 [M, K]; pk: gguf_pack_il16's layout of N rows; y: float32 [M, N]. Returns 0, or
   -1 for another format, N not a multiple of 16 or K of 32. Prefetches the rows that
   gguf_il16_prefetch_next gave it, if any (then forgets them). */
int gguf_linear_il16(int fmt, const float *x, const uint8_t *pk, float *y, int64_t M, int64_t N,
                     int64_t K) {
    struct side sd = next_side;
    next_side.n = 0;
    group_fn fn = fmt == FMT_Q4_1 ? group_Q4_1 : fmt == FMT_Q4_0 ? group_Q4_0
                : fmt == FMT_Q8_0 ? group_Q8_0 : 0;
    if (!fn || N % 16 || K % QK) return -1;
    if (M == 0) return 0;
    int64_t nb = K / QK;
    uint16_t *xb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * M * K);
    float *xs = (float *)malloc(sizeof(float) * M * nb);
    #pragma omp parallel
    {
        /* the input rows to bfloat16 (to nearest even) with each block's sum, shared out too:
           one thread alone took ~4 us of a 16-row call's ~40 */
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < M * K; i += QK) xs[i / QK] = input_block(x + i, xb + i);
        #pragma omp for schedule(guided)
        for (int64_t g = 0; g < N / 16; g++) fn(xb, xs, pk, y, M, g, N, K, &sd);
    }
    free(xs);
    free(xb);
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX (this source built again with -mamx-tile -mamx-bf16 where the CPU has AMX-BF16; then
   gguf_kernels.py calls gguf_linear_il16_amx instead of gguf_linear_il16): the same
   arithmetic as above, on tiles. A unit's 16 pairs of integers q (quad_q) are exactly an AMX
   B tile (16 pairs of k x 16 weight rows), so a unit's sums of q * x for 16 input rows are one
   TDPBF16PS (A: 16 input rows of the bfloat16 input, read in place), whose C tile is then
   scaled into the rows' float32 sums as above: acc += d * part (+ m * the input block's sum).
   So the weights are the file's exact numbers, the input is rounded to bfloat16, and only the
   order of the 32 exact products inside a block's part differs from gguf_linear_il16 (the
   tile's order rather than VDPBF16PS's). Each unit of a group is converted once into L1/L2 and
   serves every 16 input rows; every M takes this one path, so y[m, n] is the same bits
   whatever M is (tested): a row's result does not depend on the batch. */
#include <sys/syscall.h>
#include <unistd.h>

/* Asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
   once per process, before any tile instruction. 0: granted. */
int gguf_il16_amx_init(void) {
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : -1;
}

struct amx_cfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

/* Two tile sets, 0 (tiles 0, 2, 4) and 1 (tiles 1, 3, 5): A (input rows x 32 k), B (a unit's
   pairs), C (input rows x 16 weight rows). Up to 16 input rows both hold all M rows and take
   a unit each, two chains at once (one unit's part is a chain of tile loads, a multiply, a
   store and vector loads: alone, its latency bounds a one-row call); more rows: both hold 16
   (the input's rows zero-padded to 16s) and take alternate units. */
static void amx_configure(int64_t M) {
    struct amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) {  /* B tiles (2, 3) always hold a unit's 16 pairs */
        c.colsb[t] = 64;
        c.rows[t] = (uint8_t)(M <= 16 && !(t == 2 || t == 3) ? M : 16);
    }
    _tile_loadconfig(&c);
}

/* One unit's part for the rows of one input tile, on tile set `set`, into cb [rows][16].
   stream: the input tile read with TILELOADDT1 (past 16 rows the input is read from L2 for
   every unit, once per group; the hint keeps it from pushing the group's B tiles out of L1:
   all linears of a SmolLM2 step at 64 rows, 2-core AMX Xeon, 0.96-0.97x the time; up to 16
   rows the input stays in L1 and the hint costs ~5%). */
static inline __attribute__((always_inline)) void amx_part(int set, const uint16_t *xt, int64_t xs,
                                                           const uint16_t *bq, float *cb, int stream) {
    if (set) {
        if (stream) _tile_stream_loadd(1, xt, xs);
        else _tile_loadd(1, xt, xs);
        _tile_loadd(3, bq, 64);
        _tile_zero(5);
        _tile_dpbf16ps(5, 1, 3);
        _tile_stored(5, cb, 64);
    } else {
        if (stream) _tile_stream_loadd(0, xt, xs);
        else _tile_loadd(0, xt, xs);
        _tile_loadd(2, bq, 64);
        _tile_zero(4);
        _tile_dpbf16ps(4, 0, 2);
        _tile_stored(4, cb, 64);
    }
}

/* acc[i] += d * part[i] (+ m * the block's input sum), rows i of input tile t */
static inline __attribute__((always_inline)) void amx_scale(int fmt, const uint8_t *unit, const float *cb,
        const float *sx, int64_t nb, int64_t b, int64_t t, int64_t rows, __m512 acc[16]) {
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)unit));
    __m512 m = fmt == FMT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + 32)))
             : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));  /* Q4_0: d * (q - 8) */
    UNROLL for (int i = 0; i < 16; i++) {
        if (i < rows) {
            acc[i] = _mm512_fmadd_ps(d, _mm512_load_ps(cb + i * 16), acc[i]);
            if (fmt != FMT_Q8_0)
                acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[(t + i) * nb + b]), acc[i]);
        }
    }
}

/* A unit's 16 pairs of q as one B tile at bt (1 KB, aligned). */
static inline __attribute__((always_inline)) void unit_tile(int fmt, const uint8_t *unit, uint16_t *bt) {
    UNROLL for (int Q = 0; Q < 4; Q++) {
        __m512bh wq[4];
        quad_q(fmt, unit + pairs_at(fmt), Q, wq);
        UNROLL for (int i = 0; i < 4; i++)
            _mm512_store_si512((void *)(bt + (4 * Q + i) * 32), (__m512i)wq[i]);
    }
}

/* Group g: its units' q converted once into bt (B tiles), then each input tile of up to 16
   rows: per unit one TDPBF16PS and the scaling of its part, in unit order, the rows' sums in
   registers, into yg (its 16 columns: yg[i * ldy + c] for input row i). cb: two C tiles' room. */
static void agroup_amx(int fmt, const uint16_t *xb, const float *sx, const uint8_t *pk, float *yg,
                       int64_t ldy, int64_t M, int64_t g, int64_t K, uint16_t *bt, float *cb) {
    int64_t nb = K / QK, ub = unit_bytes(fmt), xs = K * 2;
    const uint8_t *units = pk + g * nb * ub;
    if (M <= 16) {
        /* Units converted two at a time into a ring of four B tiles, each pair multiplied
           (two chains) and scaled in order one pair later, so the conversion of the next pair
           overlaps the tiles' latency. */
        __m512 acc[16];
        UNROLL for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb + 2; b += 2) {
            for (int64_t u = b; u < b + 2 && u < nb; u++) {
                const uint8_t *unit = units + u * ub;
                for (int64_t o = 0; o < ub; o += 64)
                    _mm_prefetch((const char *)(unit + 4 * ub + o), _MM_HINT_T0);
                unit_tile(fmt, unit, bt + (u & 3) * 512);
            }
            int64_t u = b - 2;
            if (u < 0) continue;
            int two = u + 1 < nb;
            amx_part(0, xb + u * QK, xs, bt + (u & 3) * 512, cb, 0);
            if (two) amx_part(1, xb + (u + 1) * QK, xs, bt + ((u + 1) & 3) * 512, cb + 256, 0);
            amx_scale(fmt, units + u * ub, cb, sx, nb, u, 0, M, acc);
            if (two) amx_scale(fmt, units + (u + 1) * ub, cb + 256, sx, nb, u + 1, 0, M, acc);
        }
        UNROLL for (int i = 0; i < 16; i++)
            if (i < M) _mm512_storeu_ps(yg + i * ldy, acc[i]);
        return;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *unit = units + b * ub;
        for (int64_t o = 0; o < ub; o += 64)
            _mm_prefetch((const char *)(unit + 4 * ub + o), _MM_HINT_T0);
        unit_tile(fmt, unit, bt + b * 512);
    }
    /* Each input tile of 16 rows (xb's rows are zero-padded to 16s; rows past M are not
       kept): unit b + 1 multiplied on the other tile set while unit b's part is scaled. */
    for (int64_t t = 0; t < M; t += 16) {
        int64_t rows = M - t < 16 ? M - t : 16;
        __m512 acc[16];
        UNROLL for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        amx_part(0, xb + t * K, xs, bt, cb, 1);
        for (int64_t b = 0; b < nb; b++) {
            if (b + 1 < nb)
                amx_part((int)((b + 1) & 1), xb + t * K + (b + 1) * QK, xs, bt + (b + 1) * 512,
                         cb + ((b + 1) & 1) * 256, 1);
            amx_scale(fmt, units + b * ub, cb + (b & 1) * 256, sx, nb, b, t, rows, acc);
        }
        UNROLL for (int i = 0; i < 16; i++)
            if (i < rows) _mm512_storeu_ps(yg + (t + i) * ldy, acc[i]);
    }
}

/* A thread's B and C tile room, kept between calls (64-byte aligned; grown when a longer
   row needs more): an allocation a call cost ~1 us of its ~10 us fixed cost. */
static __thread void *amx_buf;
static __thread size_t amx_buf_bytes;
static void *amx_scratch(size_t bytes) {
    if (bytes > amx_buf_bytes) {
        free(amx_buf);
        amx_buf = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        amx_buf_bytes = amx_buf ? bytes : 0;
    }
    return amx_buf;
}

/* ARGMAX mode: each row's running best over the columns seen so far, lane by lane (lane l
   of a work item's 16 columns holds column 16 g + l): bestv/besti [M][16] (besti -1: none
   yet). A column replaces a lane's best when it is larger, or a NaN where the best is not
   (argmax_rows' rules: the first of equal values, the first NaN; a thread takes its groups in
   increasing order, so a later column never wins a tie). ys: the item's columns [M][16]. */
static void argmax_fold(const float *ys, float *bestv, int32_t *besti, int64_t M, int64_t g) {
    __m512i col = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(16 * g)),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int64_t i = 0; i < M; i++) {
        __m512 v = _mm512_loadu_ps(ys + 16 * i), b = _mm512_loadu_ps(bestv + 16 * i);
        __m512i bi = _mm512_loadu_si512((const void *)(besti + 16 * i));
        __mmask16 take = _mm512_cmp_ps_mask(v, b, _CMP_GT_OQ)
                       | (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & ~_mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q))
                       | _mm512_cmplt_epi32_mask(bi, _mm512_setzero_si512());
        _mm512_storeu_ps(bestv + 16 * i, _mm512_mask_mov_ps(b, take, v));
        _mm512_storeu_si512((void *)(besti + 16 * i), _mm512_mask_mov_epi32(bi, take, col));
    }
}

/* A thread's lane bests into the team's per-row best (gv, gi; gi -1: none yet), by the same
   rules over the column indices (one thread at a time). */
static void argmax_merge(const float *bestv, const int32_t *besti, float *gv, int64_t *gi, int64_t M) {
    for (int64_t i = 0; i < M; i++)
        for (int l = 0; l < 16; l++) {
            float v = bestv[16 * i + l];
            int64_t c = besti[16 * i + l];
            if (c < 0) continue;
            int vn = v != v, gn = gv[i] != gv[i];
            int take = gi[i] < 0 || (vn ? (!gn || c < gi[i]) : (!gn && (v > gv[i] || (v == gv[i] && c < gi[i]))));
            if (take) {
                gv[i] = v;
                gi[i] = c;
            }
        }
}

/* As gguf_linear_il16, on AMX tiles (gguf_il16_amx_init first). Rows handed to
   gguf_il16_prefetch_next are dropped (gguf_kernels.py hands none here). Modes:
   SWIGLU: w is [gate; up] (N / 2 rows each, N % 32 == 0) and y [M, N / 2] = silu(gate) * up:
     a work item is gate group g with up group g + N / 32, each summed exactly as alone, their
     16 columns for all M rows kept in scratch and combined by silu_mul16 (silu_mul's
     arithmetic on the same numbers: the same bits as this linear, then silu_mul), so the
     decode step neither writes the [M, N] gate/up output nor reads it back, nor waits on
     another parallel region.
   ARGMAX: ids [M] (int64) = each row's argmax over the N columns of this linear's y (the
     index argmax_rows gives over y: the same sums, the same rules), y never written: a greedy
     step's logits (SmolLM2: 64 rows x 49,152, 12.6 MB) are neither written to memory nor
     read back by a separate argmax. */
enum { IL_PLAIN = 0, IL_SWIGLU = 1, IL_ARGMAX = 2 };
static int il16_amx_run(int fmt, const float *x, const uint8_t *pk, float *y, int64_t *ids, int64_t M,
                        int64_t N, int64_t K, int mode) {
    next_side.n = 0;
    if (!(fmt == FMT_Q4_1 || fmt == FMT_Q4_0 || fmt == FMT_Q8_0) || N % (mode == IL_SWIGLU ? 32 : 16) || K % QK)
        return -1;
    if (M == 0) return 0;
    int64_t nb = K / QK, Mp = M > 16 ? (M + 15) / 16 * 16 : M;  /* input tiles of 16 rows past 16 */
    uint16_t *xb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * Mp * K);
    float *sx = (float *)malloc(sizeof(float) * M * nb);
    float *gv = mode == IL_ARGMAX ? (float *)malloc(sizeof(float) * M) : 0;
    if (!xb || !sx || (mode == IL_ARGMAX && !gv)) {
        free(xb);
        free(sx);
        free(gv);
        return -2;
    }
    memset(xb + M * K, 0, sizeof(uint16_t) * (Mp - M) * K);
    if (mode == IL_ARGMAX)
        for (int64_t i = 0; i < M; i++) ids[i] = -1;
    int rc = 0;
    int64_t half = N / 2, nbt = nb > 4 ? nb : 4;
    /* past the B tiles and two C tiles: SWIGLU the gate's and the up's 16 columns of every
       row; ARGMAX an item's columns, the lane bests and their columns */
    int64_t extra = mode == IL_SWIGLU ? 32 * M : mode == IL_ARGMAX ? 48 * M : 0;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < M * K; i += QK) sx[i / QK] = input_block(x + i, xb + i);
        amx_configure(M);
        /* every unit's B tile, and at least the four of agroup_amx's ring; two C tiles; extra */
        uint16_t *bt = amx_scratch(sizeof(uint16_t) * nbt * 512 + sizeof(float) * (512 + extra));
        float *cb = bt ? (float *)(bt + nbt * 512) : 0, *gs = cb ? cb + 512 : 0, *us = gs ? gs + 16 * M : 0;
        float *bestv = gs ? gs + 16 * M : 0;  /* ARGMAX (where SWIGLU keeps us) */
        int32_t *besti = bestv ? (int32_t *)(bestv + 16 * M) : 0;
        if (!bt) {
            #pragma omp atomic write
            rc = -2;
        } else if (mode == IL_ARGMAX) {
            for (int64_t i = 0; i < 16 * M; i++) besti[i] = -1;
        }
        if (mode == IL_SWIGLU) {
            #pragma omp for schedule(guided)
            for (int64_t g = 0; g < N / 32; g++) {
                if (!bt) continue;
                agroup_amx(fmt, xb, sx, pk, gs, 16, M, g, K, bt, cb);
                agroup_amx(fmt, xb, sx, pk, us, 16, M, g + N / 32, K, bt, cb);
                for (int64_t i = 0; i < M; i++)
                    _mm512_storeu_ps(y + i * half + 16 * g,
                                     silu_mul16(_mm512_loadu_ps(gs + 16 * i), _mm512_loadu_ps(us + 16 * i)));
            }
        } else if (mode == IL_ARGMAX) {
            #pragma omp for schedule(guided) nowait
            for (int64_t g = 0; g < N / 16; g++) {
                if (!bt) continue;
                agroup_amx(fmt, xb, sx, pk, gs, 16, M, g, K, bt, cb);
                argmax_fold(gs, bestv, besti, M, g);
            }
            if (bt) {
                #pragma omp critical(il16_argmax)
                argmax_merge(bestv, besti, gv, ids, M);
            }
        } else {
            #pragma omp for schedule(guided)
            for (int64_t g = 0; g < N / 16; g++)
                if (bt) agroup_amx(fmt, xb, sx, pk, y + 16 * g, N, M, g, K, bt, cb);
        }
        _tile_release();
    }
    free(gv);
    free(sx);
    free(xb);
    return rc;
}

int gguf_linear_il16_amx(int fmt, const float *x, const uint8_t *pk, float *y, int64_t M, int64_t N,
                         int64_t K) {
    return il16_amx_run(fmt, x, pk, y, 0, M, N, K, IL_PLAIN);
}

/* y float32 [M, N / 2] = silu(x @ gate.T) * (x @ up.T) for pk a [gate; up] matrix of N rows */
int gguf_linear_il16_amx_swiglu(int fmt, const float *x, const uint8_t *pk, float *y, int64_t M,
                                int64_t N, int64_t K) {
    return il16_amx_run(fmt, x, pk, y, 0, M, N, K, IL_SWIGLU);
}

/* ids int64 [M] = argmax over n of (x @ w.T)[m, n] (ARGMAX above) */
int gguf_argmax_il16_amx(int fmt, const float *x, const uint8_t *pk, int64_t *ids, int64_t M, int64_t N,
                         int64_t K) {
    return il16_amx_run(fmt, x, pk, 0, ids, M, N, K, IL_ARGMAX);
}

/* Prompt rows in bfloat16 on AMX (GGUFLinear's bfloat16 copy of the weights, where this build
   has AMX): y = x @ w.T, x bfloat16 [M, K], y float32 or bfloat16 (rounded to nearest even)
   [M, N], products of bfloat16 summed in float32, in K order 32 at a time (so a row's result
   is the same bits whatever M is and whatever rows are beside it). The weights are packed once
   (`bf16_pack_tiles`): for each 16 rows of w and each 32 of K, the B tile of TDPBF16PS (16
   pairs of k x 16 rows, 1 KB). A 32 x 32 block of y is four C tiles: per 32 of K, two A tiles
   (x's rows read in place), two B tiles and four multiplies. Work items are a block of rows
   sized to stay in L2 (ROWS_L2_BYTES of x) x two column tiles, in row-block order (a block's
   rows serve every column before the next block's are read). SmolLM2's prompt linears, 1,024
   rows, 2-core Xeon, two engines in one process taking turns, each matrix's share of a 16 x
   64-token prefill against oneDNN's bfloat16 (torch's mkldnn linear, prepacked): 576x576 17.1 vs
   19.5 ms, 576x1536 41.0 vs 67.2, 960x576 31.0 vs 40.8 (float32 out there; the engine now
   takes bfloat16 from both), 3072x576 75.4 vs 91.1. What it took: x's tiles read with
   TILELOADDT1 (streamed past the weights' tiles, which stay in L1: ~20% at K = 576); an
   item's first rows prefetch its B
   tiles two steps ahead (they come from memory: 576x576 21.4 -> 16.9 ms); bfloat16 rows of two
   column tiles written as one 64-byte store (3072x576 slower than oneDNN before, faster after). */
#define ROWS_L2_BYTES (512 * 1024)

/* w: bfloat16 [N, K] -> out (the same size): tile (j, s) at (j * K / 32 + s) * 512, its row r
   = pairs (32 s + 2 r, 32 s + 2 r + 1) of w's rows 16 j .. 16 j + 15. -1 unless N % 16 == 0
   and K % 32 == 0. */
int bf16_pack_tiles(const uint16_t *w, uint16_t *out, int64_t N, int64_t K) {
    if (N % 16 || K % 32) return -1;
    int64_t ks = K / 32;
    for (int64_t j = 0; j < N / 16; j++)
        for (int64_t s = 0; s < ks; s++)
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 2; e++)
                        out[(j * ks + s) * 512 + r * 32 + c * 2 + e] = w[(16 * j + c) * K + 32 * s + 2 * r + e];
    return 0;
}

static void gemm_configure(void) {
    struct amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {  /* 0-3: C, 4-5: A, 6-7: B; all 16 rows of 64 bytes */
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* C tile t's 16 x 16 float32 into y's rows m (those < rows) and columns 16 j */
static inline void gemm_out(const float *cb, void *y, int64_t m, int64_t rows, int64_t j, int64_t N,
                            int out_bf16) {
    for (int64_t r = 0; r < 16 && r < rows; r++) {
        __m512 v = _mm512_load_ps(cb + 16 * r);
        if (out_bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + (m + r) * N + 16 * j), (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_storeu_ps((float *)y + (m + r) * N + 16 * j, v);
    }
}

/* C tiles of columns 16 j and 16 (j + 1), side by side, into y's rows m (< rows) as bfloat16 */
static inline void gemm_out2(const float *c0, const float *c1, void *y, int64_t m, int64_t rows, int64_t j,
                             int64_t N) {
    for (int64_t r = 0; r < 16 && r < rows; r++)
        _mm512_storeu_si512((void *)((uint16_t *)y + (m + r) * N + 16 * j),
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(c1 + 16 * r), _mm512_load_ps(c0 + 16 * r)));
}

/* SwiGLU of a gate C tile and its up C tile (rows m.. < rows) into y's columns 16 j (I wide) as
   bfloat16: each sum rounded to bfloat16 first, as the unfused step's gate/up output is, then
   silu_mul's arithmetic on those numbers (the same bits as silu_mul over that output). */
static inline void gemm_out_silu(const float *cg, const float *cu, uint16_t *y, int64_t m, int64_t rows,
                                 int64_t j, int64_t I) {
    for (int64_t r = 0; r < 16 && r < rows; r++) {
        __m512 g = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_load_ps(cg + 16 * r)));
        __m512 u = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_load_ps(cu + 16 * r)));
        _mm256_storeu_si256((__m256i *)(y + (m + r) * I + 16 * j), (__m256i)_mm512_cvtneps_pbh(silu_mul16(g, u)));
    }
}

/* rows [m, m + 32) of x (xa: their first, lda: its row stride in elements) against column
   tiles j and j1 (two: whether there is a j1) */
static inline __attribute__((always_inline)) void gemm_block(const uint16_t *xa, int64_t lda,
        const uint16_t *bp, int64_t ks, int64_t j, int64_t j1, int two, float *cb, int fetch) {
    const uint16_t *b0 = bp + j * ks * 512, *b1 = bp + j1 * ks * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (two)
        for (int64_t s = 0; s < ks; s++) {
            if (fetch)  /* an item's first rows: its B tiles come from memory, two steps ahead */
                for (int o = 0; o < 512; o += 32) {
                    _mm_prefetch((const char *)(b0 + (s + 2) * 512 + o), _MM_HINT_T0);
                    _mm_prefetch((const char *)(b1 + (s + 2) * 512 + o), _MM_HINT_T0);
                }
            _tile_stream_loadd(4, xa + 32 * s, lda * 2);
            _tile_loadd(6, b0 + s * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b1 + s * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_stream_loadd(5, xa + 16 * lda + 32 * s, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    else
        for (int64_t s = 0; s < ks; s++) {
            _tile_stream_loadd(4, xa + 32 * s, lda * 2);
            _tile_loadd(6, b0 + s * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_stream_loadd(5, xa + 16 * lda + 32 * s, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
        }
    _tile_stored(0, cb, 64);
    _tile_stored(2, cb + 256, 64);
    if (two) {
        _tile_stored(1, cb + 512, 64);
        _tile_stored(3, cb + 768, 64);
    }
}

/* mode 0: y float32 [M, N]; 1: bfloat16 [M, N]; 2 (SWIGLU): w is [gate; up] (N / 2 rows each,
   N % 32 == 0) and y bfloat16 [M, N / 2] = silu(gate) * up, each work item a gate column tile
   with its up column tile, so the step never writes the [M, N] gate/up output nor reads it back
   (gemm_out_silu: the same bits as bfloat16 gate/up output then silu_mul). */
enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_SWIGLU = 2 };
static int gemm_run(const uint16_t *x, const uint16_t *bp, void *y, int64_t M, int64_t N, int64_t K, int mode) {
    if (N % 16 || K % 32 || (mode == OUT_SWIGLU && N % 32)) return -1;
    if (M == 0) return 0;
    int64_t ks = K / 32, nt = N / 16, np = mode == OUT_SWIGLU ? nt / 2 : (nt + 1) / 2;
    int64_t rb = ROWS_L2_BYTES / (K * 2) / 32 * 32;  /* rows a block: 32s that fit */
    if (rb < 32) rb = 32;
    int64_t nrb = (M + rb - 1) / rb;
    int rc = 0;
    #pragma omp parallel
    {
        gemm_configure();
        /* four C tiles' room, and a 32-row copy of the last rows (zero past M) */
        float *cb = amx_scratch(sizeof(float) * 1024 + sizeof(uint16_t) * 32 * K);
        uint16_t *tail = cb ? (uint16_t *)(cb + 1024) : 0;
        if (!cb) {
            #pragma omp atomic write
            rc = -2;
        }
        #pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < nrb * np; item++) {
            if (!cb) continue;
            int64_t b = item / np, j = item % np, j1, two;
            if (mode == OUT_SWIGLU) {
                j1 = j + np;  /* the up half's tile of the same columns */
                two = 1;
            } else {
                j *= 2;
                j1 = j + 1;
                two = j1 < nt;
            }
            for (int64_t m = b * rb; m < M && m < (b + 1) * rb; m += 32) {
                int64_t rows = M - m < 32 ? M - m : 32;
                const uint16_t *xa = x + m * K;
                if (rows < 32) {
                    memcpy(tail, xa, sizeof(uint16_t) * rows * K);
                    memset(tail + rows * K, 0, sizeof(uint16_t) * (32 - rows) * K);
                    xa = tail;
                }
                gemm_block(xa, K, bp, ks, j, j1, (int)two, cb, m == b * rb);
                if (mode == OUT_SWIGLU) {
                    gemm_out_silu(cb, cb + 512, y, m, rows, j, N / 2);
                    gemm_out_silu(cb + 256, cb + 768, y, m + 16, rows - 16, j, N / 2);
                } else if (two && mode == OUT_BF16) {  /* a row's 32 columns: one 64-byte store */
                    gemm_out2(cb, cb + 512, y, m, rows, j, N);
                    gemm_out2(cb + 256, cb + 768, y, m + 16, rows - 16, j, N);
                } else {
                    gemm_out(cb, y, m, rows, j, N, mode);
                    gemm_out(cb + 256, y, m + 16, rows - 16, j, N, mode);
                    if (two) {
                        gemm_out(cb + 512, y, m, rows, j1, N, mode);
                        gemm_out(cb + 768, y, m + 16, rows - 16, j1, N, mode);
                    }
                }
            }
        }
        _tile_release();
    }
    return rc;
}

int bf16_gemm_amx(const uint16_t *x, const uint16_t *bp, void *y, int64_t M, int64_t N, int64_t K,
                  int out_bf16) {
    return gemm_run(x, bp, y, M, N, K, out_bf16 ? OUT_BF16 : OUT_F32);
}

/* y bfloat16 [M, N / 2] = silu(x @ gate.T) * (x @ up.T), bp the tiles of [gate; up] (N rows) */
int bf16_gemm_amx_swiglu(const uint16_t *x, const uint16_t *bp, uint16_t *y, int64_t M, int64_t N, int64_t K) {
    return gemm_run(x, bp, y, M, N, K, OUT_SWIGLU);
}
#endif
