/* What the tiled weight kernels (w4a16.c, w8a16.c, int8act.c) share: the shape check, bf16 rounding, the
 * choice of tile code for the build's target, and the scaffolding around their hot loops (row passes, tile
 * steps, the thread split over N, the prefetch, the epilogues), so that the three files hold only what a
 * tile contains and how they multiply it.
 *
 * Row invariance is decided here: a kernel call covers whole rows and all of K, and threads split N only,
 * in whole steps of tiles, so every output's operations are the same whatever M, the pass a row falls in,
 * or the thread count.
 *
 * Tile code (TILES_ISA), the highest the compiler's target allows (build.py sets the target per ISA level):
 *   TILES_AVX512  the including file defined AVX512_TILES (its own AVX-512 extensions are there): kernels
 *                 of up to 12 rows, or of 1 row by 8 tiles, 32 registers of 16 lanes;
 *   TILES_AVX2    AVX2 + FMA (tiles_avx2.h): up to 4 rows by 4 tiles, 16 registers of 8 lanes;
 *   TILES_NEON    aarch64, the including file defined NEON_TILES (tiles_neon.h): the AVX2 shapes in
 *                 32 registers of 4 lanes;
 *   TILES_PORTABLE plain C, one row a pass; also whenever FLOWEDGE_PORTABLE is defined (the reference).
 * The SIMD kernels are instantiated from an always_inline template per TILE_SHAPES. build.py hashes this
 * header (and those it includes) into every including kernel's cache key.
 */
#ifndef FLOWEDGE_TILES_H
#define FLOWEDGE_TILES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define TILES_PORTABLE 0
#define TILES_NEON 1
#define TILES_AVX2 2
#define TILES_AVX512 3

#if defined(FLOWEDGE_PORTABLE)
#define TILES_ISA TILES_PORTABLE
#elif defined(AVX512_TILES)
#define TILES_ISA TILES_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define TILES_ISA TILES_AVX2
#elif defined(NEON_TILES) && defined(__aarch64__)
#define TILES_ISA TILES_NEON
#else
#define TILES_ISA TILES_PORTABLE
#endif

/* AVX2 and NEON run the same kernels over a few vector helpers (tiles_avx2.h, tiles_neon.h) */
#define NARROW_SIMD (TILES_ISA == TILES_AVX2 || TILES_ISA == TILES_NEON)

#define UNROLL _Pragma("GCC unroll 16")   /* fully: keeps a kernel's accumulators in registers */

#define TILE 16   /* outputs per tile */

/* The shapes every kernel refuses with -1 (tiled.py's supports() is the same test in Python). */
static inline int bad_shape(int64_t M, int64_t K, int64_t N, int64_t G) {
    return M <= 0 || K <= 0 || N <= 0 || N % TILE || G % 16 || G > 256 || K % G;
}

static inline uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static int64_t rows_per_pass(int64_t M);

/* Row m's pass of rb rows (the last one shorter): its first row in *m0, its row count returned. A pass's
 * rows are interleaved in the activation streams (element j of row m0 + r at base + j * R + r). */
static inline int64_t pass_of(int64_t m, int64_t M, int64_t rb, int64_t *m0) {
    *m0 = m - m % rb;
    return M - *m0 < rb ? M - *m0 : rb;
}

#if TILES_ISA == TILES_AVX512
#include <immintrin.h>

#define MAX_T 8    /* tiles a wide kernel runs at once (one row) */
#define MAX_R 12   /* rows a kernel runs at once */

/* The (R rows, T tiles) kernels a file instantiates from its template: TILE_SHAPES(KERNEL) */
#define TILE_SHAPES(X)                                                                            \
    X(1, 1) X(1, 8) X(2, 1) X(2, 4) X(3, 1) X(3, 4) X(4, 1) X(4, 2) X(5, 1) X(5, 2) X(6, 1) X(6, 2) \
    X(7, 1) X(8, 1) X(9, 1) X(10, 1) X(11, 1) X(12, 1)

/* Rows per pass: 12 rows x (accumulator + group accumulator) fill 24 of the 32 vector registers
 * (measured 8-10% faster than 8 rows at M = 16..32: the weights are unpacked fewer times). */
#define ROW_BLOCK MAX_R

/* [R][wide?]: the kernels named k_R_T of TILE_SHAPES; the wide one runs WIDE_T[R] tiles at once */
#define ROWS_OF(k)                                                                                        \
    {{0, 0}, {k##_1_1, k##_1_8}, {k##_2_1, k##_2_4}, {k##_3_1, k##_3_4}, {k##_4_1, k##_4_2},              \
     {k##_5_1, k##_5_2}, {k##_6_1, k##_6_2}, {k##_7_1, k##_7_1}, {k##_8_1, k##_8_1}, {k##_9_1, k##_9_1}, \
     {k##_10_1, k##_10_1}, {k##_11_1, k##_11_1}, {k##_12_1, k##_12_1}}

/* Independent accumulator chains for few rows (T x R x 2 accumulators stay within the 32 registers;
 * measured 5-10% faster at 2-3 rows than half as wide). One row runs 8 tiles: with 4, its 4 chains of
 * `vdpbf16ps` waited on each other's latency (the W4A16 tile streamed ~26 GB/s from DRAM, 8 tiles ~33;
 * W8A16 ~29 -> ~35; 12 tiles spilled W8A16's registers; tools/bench_kernel_ab.py). Each output's
 * operations stay the same: the tiles of a kernel call are independent. */
static const int WIDE_T[ROW_BLOCK + 1] = {0, 8, 4, 4, 2, 2, 2, 1, 1, 1, 1, 1, 1};

/* 16 bf16 -> fp32 (the W4A16 tiles' scales and zeros) */
static inline __m512 load_bf16x16(const uint8_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Macros, not functions, for the two pieces of the kernel templates they share: an always_inline
 * function taking the accumulator arrays changed the kernels' generated code (disassembly compared). */

/* acc[t][r] = 0 for the T tiles x R rows of one kernel call */
#define ZERO_TILES(acc, R, T)       \
    UNROLL                          \
    for (int t_ = 0; t_ < (T); t_++) \
        UNROLL                      \
        for (int r_ = 0; r_ < (R); r_++) (acc)[t_][r_] = _mm512_setzero_ps()

/* y[r, n0 + 16t + i] = acc[t][r][i] + bias[n0 + 16t + i]. Without a bias the bf16 kernels add +0 and
 * int8act stores acc as is (add_zero 0): the same bits, as an accumulator started at +0 is never -0;
 * each kept the code it was measured with. */
#define STORE_TILES(acc, bias, y, N, n0, R, T, add_zero)                                                   \
    UNROLL                                                                                                 \
    for (int t_ = 0; t_ < (T); t_++) {                                                                     \
        __m512 bv = (bias) ? _mm512_loadu_ps((bias) + (n0) + t_ * TILE) : _mm512_setzero_ps();            \
        UNROLL                                                                                             \
        for (int r_ = 0; r_ < (R); r_++)                                                                   \
            _mm512_storeu_ps((y) + r_ * (N) + (n0) + t_ * TILE,                                            \
                             (add_zero) || (bias) ? _mm512_add_ps((acc)[t_][r_], bv) : (acc)[t_][r_]);    \
    }

#elif NARROW_SIMD
#if TILES_ISA == TILES_AVX2
#include "tiles_avx2.h"
#else
#include "tiles_neon.h"
#endif

#define MAX_T 4   /* tiles a kernel runs at once */
#define MAX_R 4   /* rows a kernel runs at once: R x T x VECS accumulators stay within the registers */

#define TILE_SHAPES(X) X(1, 1) X(1, 4) X(2, 1) X(2, 2) X(3, 1) X(4, 1)
#define ROW_BLOCK MAX_R
#define ROWS_OF(k) {{0, 0}, {k##_1_1, k##_1_4}, {k##_2_1, k##_2_2}, {k##_3_1, k##_3_1}, {k##_4_1, k##_4_1}}

/* One row needs 4 tiles (8 AVX2 accumulator chains) to hide the FMA latency; two rows 2 */
static const int WIDE_T[ROW_BLOCK + 1] = {0, 4, 2, 1, 1};

/* acc[t][v][r] = 0 for T tiles x VECS vectors x R rows */
#define ZERO_VECS(acc, R, T)                 \
    UNROLL                                   \
    for (int t_ = 0; t_ < (T); t_++)         \
        UNROLL                               \
        for (int v_ = 0; v_ < VECS; v_++)    \
            UNROLL                           \
            for (int r_ = 0; r_ < (R); r_++) (acc)[t_][v_][r_] = vf_zero()

/* y[r, n0 + 16t + LANES v + i] = acc[t][v][r][i] (+ bias) */
#define STORE_VECS(acc, bias, y, N, n0, R, T)                                                         \
    UNROLL                                                                                          \
    for (int t_ = 0; t_ < (T); t_++)                                                                \
        UNROLL                                                                                      \
        for (int v_ = 0; v_ < VECS; v_++) {                                                         \
            int64_t at_ = (n0) + t_ * TILE + v_ * LANES;                                            \
            UNROLL                                                                                  \
            for (int r_ = 0; r_ < (R); r_++)                                                        \
                vf_store((y) + r_ * (N) + at_,                                                      \
                         (bias) ? vf_add((acc)[t_][v_][r_], vf_load((bias) + at_)) : (acc)[t_][v_][r_]); \
        }
#endif

#if TILES_ISA != TILES_PORTABLE

/* Rows go in balanced passes of at most ROW_BLOCK (AVX-512, 16 rows: 8 + 8, not 12 + 4). */
static int64_t rows_per_pass(int64_t M) {
    int64_t passes = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    return (M + passes - 1) / passes;
}

/* Tiles a thread takes at a time: the wide kernel's width for the row pass, so splits fall between them */
static int64_t tile_step(int64_t M) { return WIDE_T[rows_per_pass(M)]; }

/* One row streams weights from DRAM: fetch ~1 KB ahead of byte `at` of group g (blk bytes a group) in
 * each of the T tiles from w (+12-19% cold, 1536 x 1536/8960). Spelled as the address it was before the
 * kernels shared it: gcc then emits the same code (g * blk + at summed by the caller cost the 1-row,
 * 4-tile kernels 27 more instructions). */
static inline __attribute__((always_inline)) void
prefetch_tiles(const uint8_t *w, int64_t blk_tile, int64_t g, int64_t blk, int64_t at, const int T) {
    UNROLL
    for (int t = 0; t < T; t++) __builtin_prefetch(w + t * blk_tile + g * blk + at + 1024, 0, 3);
}

/* The kernel call for R rows from row m and the tiles from t (WIDE_T[R] of them when wide, else one). */
typedef void (*pass_fn)(const void *job, int64_t m, int64_t R, int64_t t, int wide);

/* Tiles t0..t1 for all M rows: steps of the row pass's wide width (single tiles for a last short step),
 * each step's rows in passes; a pass whose own width differs from the step's runs its tiles one by one. */
static inline __attribute__((always_inline)) void
row_passes(const void *job, int64_t t0, int64_t t1, int64_t M, pass_fn call) {
    int64_t rb = rows_per_pass(M);
    for (int64_t t = t0; t < t1;) {
        int64_t T = t1 - t >= WIDE_T[rb] ? WIDE_T[rb] : 1;
        for (int64_t m = 0; m < M; m += rb) {
            int64_t R = M - m < rb ? M - m : rb;
            if (WIDE_T[R] == T) {
                call(job, m, R, t, T > 1);
            } else {
                for (int64_t u = t; u < t + T; u++) call(job, m, R, u, 0);
            }
        }
        t += T;
    }
}

#else /* portable */

static int64_t rows_per_pass(int64_t M) {   /* rows one at a time over each unpacked group: x stays row-major */
    (void)M;
    return 1;
}

static int64_t tile_step(int64_t M) {
    (void)M;
    return 1;
}

/* Tile t's outputs of every row start at 0 (the portable builds add group by group into y). */
static inline void clear_tile(float *y, int64_t M, int64_t N, int64_t t) {
    for (int64_t m = 0; m < M; m++) memset(y + m * N + t * TILE, 0, TILE * sizeof(float));
}

/* ... and end with the bias added, last. */
static inline void add_bias(float *y, int64_t M, int64_t N, int64_t t, const float *bias) {
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int i = 0; i < TILE; i++) y[m * N + t * TILE + i] += bias[t * TILE + i];
}
#endif

/* Runs tiles t0..t1 of one call (job: the call's arguments). */
typedef void (*tiles_fn)(const void *job, int64_t t0, int64_t t1);

/* All tiles of one call on up to nthreads threads: threads split N only, in whole steps of tiles (K is
 * never split), taking chunks as they finish: on a shared CPU a preempted thread does not hold the
 * others up. */
static void split_tiles(const void *job, int64_t tiles, int64_t M, int nthreads, tiles_fn run) {
    int64_t step = tile_step(M), units = (tiles + step - 1) / step;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > units) nthreads = (int)units;
    if (nthreads == 1) {
        run(job, 0, tiles);
        return;
    }
    int64_t per = (units + 4 * nthreads - 1) / (4 * nthreads), chunks = (units + per - 1) / per;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t a = c * per * step, b = (c + 1) * per * step;
        run(job, a, b < tiles ? b : tiles);
    }
}

#endif /* FLOWEDGE_TILES_H */
