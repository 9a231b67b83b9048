/* Row-invariant W4A16 matmul: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W 4-bit group-quantized.
 *
 * Called through ctypes with raw pointers (no torch, no Python API). The numerics and the tiled
 * weight layout are documented in flowedge/kernels/w4a16.py; in short, per output n and group g:
 *   S = sum over the group's k of (code - 8) * bf16(x[k])   (fp32, a fixed order per build)
 *   y += S * scale + zero * X_g,   X_g = sum over the group of bf16(x[k]) (fp32, fixed order)
 * Every output's operations are the same whatever M, the row block a row falls in, or the thread
 * count (threads split N only), so a row's result never depends on the rows beside it.
 *
 * Layout (per tile of 16 outputs, per group; BLK = 64 + 8 * G bytes, tiles then groups):
 *   16 scales bf16 | 16 zeros bf16 | G/8 blocks of 16 dwords; dword i of block b holds the codes
 *   c0..c7 of output i at k = 8b..8b+7 as nibbles c0 c2 c4 c6 c1 c3 c5 c7 (low to high), so that
 *   (dword >> 4p) puts (c_2p, c_2p+1) in the low bits of its two 16-bit halves.
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
 * (pass base + j * R + r), so a kernel reaches every row of its pass from one pointer; and
 * xs [M, K/G]: group sums of the rounded values in 16 fixed lanes, then the lanes in order. */
static void prepare_x(const float *x, int64_t M, int64_t K, int64_t G, uint32_t *xp, float *xs) {
    int64_t ng = K / G, rb = rows_per_pass(M);
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        int64_t m0 = m - m % rb, R = M - m0 < rb ? M - m0 : rb;
        uint32_t *dst = xp + m0 * (K / 2) + (m - m0);
        for (int64_t j = 0; j < K / 2; j++)
            dst[j * R] = (uint32_t)bf16_rne(xr[2 * j]) | (uint32_t)bf16_rne(xr[2 * j + 1]) << 16;
        for (int64_t g = 0; g < ng; g++) {
            float lane[16] = {0};
            for (int64_t k = 0; k < G; k += 16)
                for (int j = 0; j < 16; j++) lane[j] += bf16_to_f32(bf16_rne(xr[g * G + k + j]));
            float s = 0.f;
            for (int j = 0; j < 16; j++) s += lane[j];
            xs[m * ng + g] = s;
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

const char *w4a16_isa(void) { return "avx512bf16"; }

#define MAX_T 4
#define MAX_R 12
#define UNROLL _Pragma("GCC unroll 16")   /* fully: keeps the [T][R] accumulators in registers */

/* acc += w . broadcast(the bf16 pair at x): written out because gcc does not fold the broadcast
 * into the instruction's memory operand (a separate vpbroadcastd per row doubled the instructions) */
static inline __m512 dot_pair(__m512 acc, __m512bh w, const uint32_t *x) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

static inline __m512 load_bf16x16(const uint8_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* R rows x T tiles, all of K. acc/gacc live in registers (R, T are constants after inlining). */
static inline __attribute__((always_inline)) void
tile_kernel(const uint8_t *w, int64_t blk_tile, int64_t ng, int64_t G, const uint32_t *xp, const float *xs,
            const float *bias, float *y, int64_t N, int64_t n0, const int R, const int T) {
    /* entries 0..15 = bf16(c - 8); 16..31 repeat them so bit 4 of the index does not matter */
    const __m512i table = _mm512_set_epi16(
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
        (short)0xbf80, (short)0xc000, (short)0xc040, (short)0xc080, (short)0xc0a0, (short)0xc0c0, (short)0xc0e0, (short)0xc100,
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
        (short)0xbf80, (short)0xc000, (short)0xc040, (short)0xc080, (short)0xc0a0, (short)0xc0c0, (short)0xc0e0, (short)0xc100);
    __m512 acc[MAX_T][MAX_R];   /* fixed sizes (not [T][R], a VLA that gcc keeps in memory) */
    UNROLL
    for (int t = 0; t < T; t++)
        UNROLL
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
    const int64_t blk = 64 + 8 * G;
    for (int64_t g = 0; g < ng; g++) {
        __m512 gacc[MAX_T][MAX_R];
        UNROLL
        for (int t = 0; t < T; t++)
            UNROLL
            for (int r = 0; r < R; r++) gacc[t][r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < G / 8; b++) {
            if (R == 1) {   /* one row streams weights from DRAM: fetch ~1 KB ahead (+12-19% cold, 1536 x 1536/8960) */
                UNROLL
                for (int t = 0; t < T; t++) _mm_prefetch((const char *)(w + t * blk_tile + g * blk + b * 64 + 1024), _MM_HINT_T0);
            }
            const uint32_t *xj = xp + (g * G / 2 + b * 4) * R;   /* pair j of row r at xj[j * R + r] */
            UNROLL
            for (int t = 0; t < T; t++) {
                const uint8_t *cp = w + t * blk_tile + g * blk + 64 + b * 64;
                __m512i d = _mm512_loadu_si512((const void *)cp);
                UNROLL
                for (int p = 0; p < 4; p++) {
                    __m512i idx = p == 0 ? d : _mm512_srli_epi32(d, 4 * p);
                    __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(idx, table);
                    UNROLL
                    for (int r = 0; r < R; r++) gacc[t][r] = dot_pair(gacc[t][r], wv, xj + p * R + r);
                }
            }
        }
        UNROLL
        for (int t = 0; t < T; t++) {
            const uint8_t *sp = w + t * blk_tile + g * blk;
            __m512 s = load_bf16x16(sp), z = load_bf16x16(sp + 32);
            UNROLL
            for (int r = 0; r < R; r++) {
                acc[t][r] = _mm512_fmadd_ps(gacc[t][r], s, acc[t][r]);
                acc[t][r] = _mm512_fmadd_ps(z, _mm512_set1_ps(xs[r * ng + g]), acc[t][r]);
            }
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
                               const float *xs, const float *bias, float *y, int64_t N, int64_t n0) {     \
        tile_kernel(w, bt, ng, G, xp, xs, bias, y, N, n0, R, T);                                          \
    }
KERNEL(1, 1) KERNEL(1, 4)
KERNEL(2, 1) KERNEL(2, 4)
KERNEL(3, 1) KERNEL(3, 4)
KERNEL(4, 1) KERNEL(4, 2)
KERNEL(5, 1) KERNEL(5, 2)
KERNEL(6, 1) KERNEL(6, 2)
KERNEL(7, 1) KERNEL(8, 1)
KERNEL(9, 1) KERNEL(10, 1) KERNEL(11, 1) KERNEL(12, 1)

typedef void (*kern_fn)(const uint8_t *, int64_t, int64_t, int64_t, const uint32_t *, const float *,
                        const float *, float *, int64_t, int64_t);
/* Rows per pass: 12 rows x (accumulator + group accumulator) fill 24 of the 32 vector registers
 * (measured 8-10% faster than 8 rows at M = 16..32: the weights are unpacked fewer times). */
#define ROW_BLOCK MAX_R
/* [R][wide?]: the wide variant runs WIDE_T[R] tiles at once: independent dpbf16 chains for few rows
 * (T x R x 2 accumulators stay within the 32 registers; measured 5-10% faster at 2-3 rows than half as wide) */
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

/* Tiles a thread takes at a time: the wide kernel's width for the row pass, so splits fall between them */
static int64_t tile_step(int64_t M) { return WIDE_T[rows_per_pass(M)]; }

static void run_tiles(const uint8_t *w, int64_t t0, int64_t t1, int64_t M, int64_t K, int64_t G, int64_t N,
                      const uint32_t *xp, const float *xs, const float *bias, float *y) {
    int64_t ng = K / G, bt = ng * (64 + 8 * G), rb = rows_per_pass(M);
    for (int64_t t = t0; t < t1;) {
        int64_t T = t1 - t >= WIDE_T[rb] ? WIDE_T[rb] : 1;
        for (int64_t m = 0; m < M; m += rb) {
            int64_t R = M - m < rb ? M - m : rb;
            const uint32_t *xr = xp + m * (K / 2);
            if (WIDE_T[R] == T) {
                KERNELS[R][T > 1](w + t * bt, bt, ng, G, xr, xs + m * ng, bias, y + m * N, N, t * TILE);
            } else {
                for (int64_t u = t; u < t + T; u++)
                    KERNELS[R][0](w + u * bt, bt, ng, G, xr, xs + m * ng, bias, y + m * N, N, u * TILE);
            }
        }
        t += T;
    }
}

#else /* portable: plain C that the compiler vectorizes over the 16 outputs of a tile */

const char *w4a16_isa(void) { return "portable"; }

static int64_t rows_per_pass(int64_t M) {   /* rows one at a time over each unpacked group: x stays row-major */
    (void)M;
    return 1;
}

static int64_t tile_step(int64_t M) {
    (void)M;
    return 1;
}

/* A tile's 16 outputs as two 8-lane vectors: gcc maps the type onto the target (one AVX2 or two NEON
 * registers) and computes each lane on its own, no reassociation: every row sees the same operations. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define HALF 8
#define PASS 4   /* rows per pass over an unpacked group (8 accumulators in registers) */

static inline v8f load_v8f(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_v8f(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f bf16x8(const uint8_t *p) {   /* 8 bf16 -> fp32 */
    uint16_t h[HALF];
    v8u u;
    memcpy(h, p, sizeof h);
    for (int i = 0; i < HALF; i++) u[i] = (uint32_t)h[i] << 16;
    return (v8f)u;
}

/* wf[k][half] = (code - 8) of the group's input k for the tile's outputs 8 * half .. 8 * half + 7 */
static void unpack_group(const uint8_t *p, int64_t G, v8f (*wf)[2]) {
    static const int shift[8] = {0, 16, 4, 20, 8, 24, 12, 28};   /* c0..c7 in a dword (see the layout) */
    for (int64_t b = 0; b < G / 8; b++)
        for (int h = 0; h < 2; h++) {
            v8u d;
            memcpy(&d, p + 64 + b * 64 + h * 32, sizeof d);
            for (int c = 0; c < 8; c++)
                wf[b * 8 + c][h] = __builtin_convertvector((v8i)((d >> shift[c]) & 15u) - 8, v8f);
        }
}

/* rows m0 .. m0 + R - 1 of one group of one tile; R is a constant after inlining */
static inline __attribute__((always_inline)) void
group_rows(v8f (*wf)[2], int64_t G, const uint32_t *xr, int64_t xstride, const float *xg, int64_t ng,
           v8f s0, v8f s1, v8f z0, v8f z1, float *yr, int64_t N, const int R) {
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
        store_v8f(o, (load_v8f(o) + a0[r] * s0) + z0 * xg[r * ng]);
        store_v8f(o + HALF, (load_v8f(o + HALF) + a1[r] * s1) + z1 * xg[r * ng]);
    }
}

static void run_tiles(const uint8_t *w, int64_t t0, int64_t t1, int64_t M, int64_t K, int64_t G, int64_t N,
                      const uint32_t *xp, const float *xs, const float *bias, float *y) {
    int64_t ng = K / G, blk = 64 + 8 * G, bt = ng * blk;
    v8f wf[256][2];
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t m = 0; m < M; m++) memset(y + m * N + t * TILE, 0, TILE * sizeof(float));
        for (int64_t g = 0; g < ng; g++) {
            const uint8_t *p = w + t * bt + g * blk;
            v8f s0 = bf16x8(p), s1 = bf16x8(p + 16), z0 = bf16x8(p + 32), z1 = bf16x8(p + 48);
            unpack_group(p, G, wf);
            for (int64_t m = 0; m < M; m += PASS) {
                const uint32_t *xr = xp + m * (K / 2) + g * G / 2;
                float *yr = y + m * N + t * TILE;
                switch (M - m < PASS ? M - m : PASS) {
                case 1: group_rows(wf, G, xr, K / 2, xs + m * ng + g, ng, s0, s1, z0, z1, yr, N, 1); break;
                case 2: group_rows(wf, G, xr, K / 2, xs + m * ng + g, ng, s0, s1, z0, z1, yr, N, 2); break;
                case 3: group_rows(wf, G, xr, K / 2, xs + m * ng + g, ng, s0, s1, z0, z1, yr, N, 3); break;
                default: group_rows(wf, G, xr, K / 2, xs + m * ng + g, ng, s0, s1, z0, z1, yr, N, 4);
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
int w4a16_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t G, const float *bias,
                 float *y, int nthreads) {
    if (M <= 0 || K <= 0 || N <= 0 || N % TILE || G % 16 || G > 256 || K % G) return -1;
    uint32_t *xp = malloc((size_t)(M * K / 2) * sizeof(uint32_t));
    float *xs = malloc((size_t)(M * (K / G)) * sizeof(float));
    if (!xp || !xs) {
        free(xp);
        free(xs);
        return -1;
    }
    prepare_x(x, M, K, G, xp, xs);
    int64_t tiles = N / TILE, step = tile_step(M), units = (tiles + step - 1) / step;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > units) nthreads = (int)units;
    if (nthreads == 1) {
        run_tiles(w, 0, tiles, M, K, G, N, xp, xs, bias, y);
    } else {   /* threads split N only, in whole steps of tiles (K is never split), taking chunks as they
                * finish: on a shared CPU a preempted thread does not hold the others up */
        int64_t per = (units + 4 * nthreads - 1) / (4 * nthreads), chunks = (units + per - 1) / per;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t a = c * per * step, b = (c + 1) * per * step;
            run_tiles(w, a, b < tiles ? b : tiles, M, K, G, N, xp, xs, bias, y);
        }
    }
    free(xp);
    free(xs);
    return 0;
}
