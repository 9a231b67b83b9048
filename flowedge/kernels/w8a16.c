/* Row-invariant W8A16 matmul: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W 8-bit group-quantized (symmetric).
 *
 * Called through ctypes with raw pointers. The numerics and the tiled layout are documented in
 * flowedge/kernels/w8a16.py; in short, per output n and group g of G inputs:
 *   S = sum over the group's k of code * bf16(x[k])   (fp32, a fixed order per build; codes are exact in bf16)
 *   y = S * scale + y                                 (fp32 scale, groups in order)
 * Every output's operations are the same whatever M, the row pass a row falls in, or the thread count
 * (threads split N only), so a row's result never depends on the rows beside it.
 *
 * Layout (per tile of 16 outputs, per group; BLK = 64 + 16 * G bytes, tiles then groups):
 *   16 scales fp32 | G/2 blocks of 32 int8: byte 2i + e of block j is output i's code at k = 2j + e,
 *   i.e. the (input pair, output) order `vdpbf16ps` consumes once widened to bf16.
 */
/* The tiles per build (tiles.h picks): AVX512-BF16 `vdpbf16ps` here; AVX2 and NEON fused multiply-adds
 * (tiles_avx2.h, tiles_neon.h); the portable loop (bf16act.h). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define AVX512_TILES
#endif
#define NEON_TILES   /* plain aarch64 NEON suffices */
#include "bf16act.h"

#if TILES_ISA == TILES_AVX512

const char *w8a16_isa(void) { return "avx512bf16"; }

/* 32 int8 codes -> 32 bf16 (exact: |code| <= 127 fits bf16's 8-bit significand), lanes in byte order */
static inline __m512bh widen_pair_block(const int8_t *p) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* R rows x T tiles, all of K; accumulators in registers (R, T are constants after inlining). */
static inline __attribute__((always_inline)) void
tile_kernel(const uint8_t *w, int64_t blk_tile, int64_t ng, int64_t G, const uint32_t *xp,
            const float *bias, float *y, int64_t N, int64_t n0, const int R, const int T) {
    __m512 acc[MAX_T][MAX_R];
    ZERO_TILES(acc, R, T);
    const int64_t blk = 64 + 16 * G;
    for (int64_t g = 0; g < ng; g++) {
        __m512 gacc[MAX_T][MAX_R];
        ZERO_TILES(gacc, R, T);
        for (int64_t j = 0; j < G / 2; j++) {
            if (R == 1 && (j & 1) == 0) prefetch_tiles(w, blk_tile, g, blk, 64 + j * 32, T);
            const uint32_t *xj = xp + (g * G / 2 + j) * R;   /* pair (g, j) of row r at xj[r] */
            UNROLL
            for (int t = 0; t < T; t++) {
                __m512bh wv = widen_pair_block((const int8_t *)(w + t * blk_tile + g * blk + 64 + j * 32));
                UNROLL
                for (int r = 0; r < R; r++) gacc[t][r] = dot_pair(gacc[t][r], wv, xj + r);
            }
        }
        UNROLL
        for (int t = 0; t < T; t++) {
            __m512 s = _mm512_loadu_ps((const float *)(w + t * blk_tile + g * blk));
            UNROLL
            for (int r = 0; r < R; r++) acc[t][r] = _mm512_fmadd_ps(gacc[t][r], s, acc[t][r]);
        }
    }
    STORE_TILES(acc, bias, y, N, n0, R, T, 1);
}

#elif NARROW_SIMD

const char *w8a16_isa(void) { return TILES_ISA == TILES_AVX2 ? "avx2" : "neon"; }

/* R rows x T tiles, all of K, over tiles_avx2.h / tiles_neon.h: per output and group, in input order,
 * S = fma(code, bf16(x), S); y = fma(S, scale, y). */
static inline __attribute__((always_inline)) void
tile_kernel(const uint8_t *w, int64_t blk_tile, int64_t ng, int64_t G, const float *xf,
            const float *bias, float *y, int64_t N, int64_t n0, const int R, const int T) {
    vf acc[MAX_T][VECS][MAX_R];
    ZERO_VECS(acc, R, T);
    const int64_t blk = 64 + 16 * G;
    for (int64_t g = 0; g < ng; g++) {
        vf gacc[MAX_T][VECS][MAX_R];
        ZERO_VECS(gacc, R, T);
        for (int64_t j = 0; j < G / 2; j++) {
            if (R == 1 && (j & 1) == 0) prefetch_tiles(w, blk_tile, g, blk, 64 + j * 32, T);
            const float *xj = xf + (g * G + 2 * j) * R;   /* input 2j + e of row r at xj[e * R + r] */
            UNROLL
            for (int t = 0; t < T; t++) {
                vf even[VECS], odd[VECS];
                UNROLL
                for (int v = 0; v < VECS; v++)
                    w8_pair(w + t * blk_tile + g * blk + 64 + j * 32 + v * 2 * LANES, &even[v], &odd[v]);
                UNROLL
                for (int r = 0; r < R; r++) {
                    vf x0 = vf_bcast(xj + r), x1 = vf_bcast(xj + R + r);
                    UNROLL
                    for (int v = 0; v < VECS; v++) gacc[t][v][r] = vf_fma(odd[v], x1, vf_fma(even[v], x0, gacc[t][v][r]));
                }
            }
        }
        UNROLL
        for (int t = 0; t < T; t++)
            UNROLL
            for (int v = 0; v < VECS; v++) {
                vf s = vf_load((const float *)(w + t * blk_tile + g * blk) + v * LANES);
                UNROLL
                for (int r = 0; r < R; r++) acc[t][v][r] = vf_fma(gacc[t][v][r], s, acc[t][v][r]);
            }
    }
    STORE_VECS(acc, bias, y, N, n0, R, T);
}
#endif

#if TILES_ISA != TILES_PORTABLE
#define KERNEL(R, T)                                                                                      \
    static void kern_##R##_##T(const uint8_t *w, int64_t bt, int64_t ng, int64_t G, const stream_t *xa,  \
                               const float *bias, float *y, int64_t N, int64_t n0) {                      \
        tile_kernel(w, bt, ng, G, xa, bias, y, N, n0, R, T);                                              \
    }
TILE_SHAPES(KERNEL)

typedef void (*kern_fn)(const uint8_t *, int64_t, int64_t, int64_t, const stream_t *, const float *, float *,
                        int64_t, int64_t);
static const kern_fn KERNELS[ROW_BLOCK + 1][2] = ROWS_OF(kern);

static inline void pass(const void *job, int64_t m, int64_t R, int64_t t, int wide) {
    const bf16_job *j = job;
    KERNELS[R][wide](j->w + t * j->bt, j->bt, j->ng, j->G, stream_of(j, m), j->bias, j->y + m * j->N, j->N,
                     t * TILE);
}

static void run_tiles(const void *job, int64_t t0, int64_t t1) {
    row_passes(job, t0, t1, ((const bf16_job *)job)->M, pass);
}

#else /* portable */

const char *w8a16_isa(void) { return "portable"; }

/* s = the group's scales (no zeros); wf[k][half] = code of input k for outputs 8 * half .. 8 * half + 7 */
static void unpack_group(const uint8_t *p, int64_t G, v8f (*wf)[2], v8f *s, v8f *z) {
    const int8_t *c = (const int8_t *)(p + 64);
    (void)z;
    s[0] = load_v8f((const float *)p), s[1] = load_v8f((const float *)p + HALF);
    for (int64_t j = 0; j < G / 2; j++)
        for (int e = 0; e < 2; e++)
            for (int h = 0; h < 2; h++) {
                v8i v;
                for (int i = 0; i < HALF; i++) v[i] = c[j * 32 + 2 * (h * HALF + i) + e];
                wf[2 * j + e][h] = __builtin_convertvector(v, v8f);
            }
}

static void run_tiles(const void *job, int64_t t0, int64_t t1) {
    const bf16_job *j = job;
    portable_tiles(j, t0, t1, 64 + 16 * j->G, unpack_group, 0);
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias). Returns 0, or -1 on bad arguments / no memory. */
int w8a16_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t G, const float *bias,
                 float *y, int nthreads) {
    return bf16_linear(x, M, K, w, N, G, bias, y, nthreads, 64 + 16 * G, 0, NULL, run_tiles);
}
