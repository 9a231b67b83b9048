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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define TILE 16

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

/* x [M, K] fp32 -> xp: bf16 pairs (inputs 2j, 2j+1 in one u32), interleaved per pass of R rows
 * (pass base + j * R + r), so a kernel reaches every row of its pass from one pointer. */
static void prepare_x(const float *x, int64_t M, int64_t K, uint32_t *xp) {
    int64_t rb = rows_per_pass(M);
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        int64_t m0 = m - m % rb, R = M - m0 < rb ? M - m0 : rb;
        uint32_t *dst = xp + m0 * (K / 2) + (m - m0);
        for (int64_t j = 0; j < K / 2; j++)
            dst[j * R] = (uint32_t)bf16_rne(xr[2 * j]) | (uint32_t)bf16_rne(xr[2 * j + 1]) << 16;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

const char *w8a16_isa(void) { return "avx512bf16"; }

#define MAX_T 4
#define MAX_R 12
#define UNROLL _Pragma("GCC unroll 16")

/* acc += w . broadcast(the bf16 pair at x), the broadcast folded into the instruction (see w4a16.c) */
static inline __m512 dot_pair(__m512 acc, __m512bh w, const uint32_t *x) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

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
    UNROLL
    for (int t = 0; t < T; t++)
        UNROLL
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
    const int64_t blk = 64 + 16 * G;
    for (int64_t g = 0; g < ng; g++) {
        __m512 gacc[MAX_T][MAX_R];
        UNROLL
        for (int t = 0; t < T; t++)
            UNROLL
            for (int r = 0; r < R; r++) gacc[t][r] = _mm512_setzero_ps();
        for (int64_t j = 0; j < G / 2; j++) {
            if (R == 1 && (j & 1) == 0) {   /* one row streams weights from DRAM: fetch ~1 KB ahead */
                UNROLL
                for (int t = 0; t < T; t++) _mm_prefetch((const char *)(w + t * blk_tile + g * blk + 64 + j * 32 + 1024), _MM_HINT_T0);
            }
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
    UNROLL
    for (int t = 0; t < T; t++) {
        __m512 bv = bias ? _mm512_loadu_ps(bias + n0 + t * TILE) : _mm512_setzero_ps();
        UNROLL
        for (int r = 0; r < R; r++)
            _mm512_storeu_ps(y + r * N + n0 + t * TILE, _mm512_add_ps(acc[t][r], bv));
    }
}

#define KERNEL(R, T)                                                                                      \
    static void kern_##R##_##T(const uint8_t *w, int64_t bt, int64_t ng, int64_t G, const uint32_t *xp,  \
                               const float *bias, float *y, int64_t N, int64_t n0) {                      \
        tile_kernel(w, bt, ng, G, xp, bias, y, N, n0, R, T);                                              \
    }
KERNEL(1, 1) KERNEL(1, 4)
KERNEL(2, 1) KERNEL(2, 4)
KERNEL(3, 1) KERNEL(3, 4)
KERNEL(4, 1) KERNEL(4, 2)
KERNEL(5, 1) KERNEL(5, 2)
KERNEL(6, 1) KERNEL(6, 2)
KERNEL(7, 1) KERNEL(8, 1)
KERNEL(9, 1) KERNEL(10, 1) KERNEL(11, 1) KERNEL(12, 1)

typedef void (*kern_fn)(const uint8_t *, int64_t, int64_t, int64_t, const uint32_t *, const float *, float *,
                        int64_t, int64_t);
#define ROW_BLOCK MAX_R
static const kern_fn KERNELS[ROW_BLOCK + 1][2] = {
    {0, 0}, {kern_1_1, kern_1_4}, {kern_2_1, kern_2_4}, {kern_3_1, kern_3_4}, {kern_4_1, kern_4_2},
    {kern_5_1, kern_5_2}, {kern_6_1, kern_6_2}, {kern_7_1, kern_7_1}, {kern_8_1, kern_8_1},
    {kern_9_1, kern_9_1}, {kern_10_1, kern_10_1}, {kern_11_1, kern_11_1}, {kern_12_1, kern_12_1}};
static const int WIDE_T[ROW_BLOCK + 1] = {0, 4, 4, 4, 2, 2, 2, 1, 1, 1, 1, 1, 1};

/* Rows go in balanced passes of at most ROW_BLOCK (16 rows: 8 + 8, not 12 + 4). */
static int64_t rows_per_pass(int64_t M) {
    int64_t passes = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    return (M + passes - 1) / passes;
}

static int64_t tile_step(int64_t M) { return WIDE_T[rows_per_pass(M)]; }

static void run_tiles(const uint8_t *w, int64_t t0, int64_t t1, int64_t M, int64_t K, int64_t G, int64_t N,
                      const uint32_t *xp, const float *bias, float *y) {
    int64_t ng = K / G, bt = ng * (64 + 16 * G), rb = rows_per_pass(M);
    for (int64_t t = t0; t < t1;) {
        int64_t T = t1 - t >= WIDE_T[rb] ? WIDE_T[rb] : 1;
        for (int64_t m = 0; m < M; m += rb) {
            int64_t R = M - m < rb ? M - m : rb;
            const uint32_t *xr = xp + m * (K / 2);
            if (WIDE_T[R] == T) {
                KERNELS[R][T > 1](w + t * bt, bt, ng, G, xr, bias, y + m * N, N, t * TILE);
            } else {
                for (int64_t u = t; u < t + T; u++)
                    KERNELS[R][0](w + u * bt, bt, ng, G, xr, bias, y + m * N, N, u * TILE);
            }
        }
        t += T;
    }
}

#else /* portable: plain C that the compiler vectorizes over the 16 outputs of a tile */

const char *w8a16_isa(void) { return "portable"; }

static int64_t rows_per_pass(int64_t M) {
    (void)M;
    return 1;
}

static int64_t tile_step(int64_t M) {
    (void)M;
    return 1;
}

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define HALF 8
#define PASS 4

static inline v8f load_v8f(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_v8f(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* wf[k][half] = code of the group's input k for the tile's outputs 8 * half .. 8 * half + 7 */
static void unpack_group(const uint8_t *p, int64_t G, v8f (*wf)[2]) {
    const int8_t *c = (const int8_t *)(p + 64);
    for (int64_t j = 0; j < G / 2; j++)
        for (int e = 0; e < 2; e++)
            for (int h = 0; h < 2; h++) {
                v8i v;
                for (int i = 0; i < HALF; i++) v[i] = c[j * 32 + 2 * (h * HALF + i) + e];
                wf[2 * j + e][h] = __builtin_convertvector(v, v8f);
            }
}

/* rows m0 .. m0 + R - 1 of one group of one tile; R is a constant after inlining */
static inline __attribute__((always_inline)) void
group_rows(v8f (*wf)[2], int64_t G, const uint32_t *xr, int64_t xstride, v8f s0, v8f s1, float *yr, int64_t N,
           const int R) {
    v8f a0[PASS], a1[PASS];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = (v8f){0};
    for (int64_t j = 0; j < G / 2; j++)
        for (int e = 0; e < 2; e++) {
            v8f w0 = wf[2 * j + e][0], w1 = wf[2 * j + e][1];
            for (int r = 0; r < R; r++) {
                float xv = bf16_to_f32((uint16_t)(xr[r * xstride + j] >> (16 * e)));
                a0[r] = a0[r] + w0 * xv;
                a1[r] = a1[r] + w1 * xv;
            }
        }
    for (int r = 0; r < R; r++) {
        float *o = yr + r * N;
        store_v8f(o, load_v8f(o) + a0[r] * s0);
        store_v8f(o + HALF, load_v8f(o + HALF) + a1[r] * s1);
    }
}

static void run_tiles(const uint8_t *w, int64_t t0, int64_t t1, int64_t M, int64_t K, int64_t G, int64_t N,
                      const uint32_t *xp, const float *bias, float *y) {
    int64_t ng = K / G, blk = 64 + 16 * G, bt = ng * blk;
    v8f wf[256][2];
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t m = 0; m < M; m++) memset(y + m * N + t * TILE, 0, TILE * sizeof(float));
        for (int64_t g = 0; g < ng; g++) {
            const uint8_t *p = w + t * bt + g * blk;
            v8f s0 = load_v8f((const float *)p), s1 = load_v8f((const float *)p + HALF);
            unpack_group(p, G, wf);
            for (int64_t m = 0; m < M; m += PASS) {
                const uint32_t *xr = xp + m * (K / 2) + g * G / 2;
                float *yr = y + m * N + t * TILE;
                switch (M - m < PASS ? M - m : PASS) {
                case 1: group_rows(wf, G, xr, K / 2, s0, s1, yr, N, 1); break;
                case 2: group_rows(wf, G, xr, K / 2, s0, s1, yr, N, 2); break;
                case 3: group_rows(wf, G, xr, K / 2, s0, s1, yr, N, 3); break;
                default: group_rows(wf, G, xr, K / 2, s0, s1, yr, N, 4);
                }
            }
        }
        if (bias)
            for (int64_t m = 0; m < M; m++)
                for (int i = 0; i < TILE; i++) y[m * N + t * TILE + i] += bias[t * TILE + i];
    }
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias). Returns 0, or -1 on bad arguments / no memory. */
int w8a16_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t G, const float *bias,
                 float *y, int nthreads) {
    if (M <= 0 || K <= 0 || N <= 0 || N % TILE || G % 16 || G > 256 || K % G) return -1;
    uint32_t *xp = malloc((size_t)(M * K / 2) * sizeof(uint32_t));
    if (!xp) return -1;
    prepare_x(x, M, K, xp);
    int64_t tiles = N / TILE, step = tile_step(M), units = (tiles + step - 1) / step;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > units) nthreads = (int)units;
    if (nthreads == 1) {
        run_tiles(w, 0, tiles, M, K, G, N, xp, bias, y);
    } else {   /* threads split N only, in whole steps of tiles, taking chunks as they finish */
        int64_t per = (units + 4 * nthreads - 1) / (4 * nthreads), chunks = (units + per - 1) / per;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t a = c * per * step, b = (c + 1) * per * step;
            run_tiles(w, a, b < tiles ? b : tiles, M, K, G, N, xp, bias, y);
        }
    }
    free(xp);
    return 0;
}
