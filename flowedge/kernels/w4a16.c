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
/* The tiles per build (tiles.h picks): AVX512-BF16 `vdpbf16ps` here; AVX2 and NEON fused multiply-adds
 * (tiles_avx2.h, tiles_neon.h); the portable loop (bf16act.h). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define AVX512_TILES
#endif
#define NEON_TILES   /* plain aarch64 NEON suffices */
#include "bf16act.h"

#if TILES_ISA == TILES_AVX512

const char *w4a16_isa(void) { return "avx512bf16"; }

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
    ZERO_TILES(acc, R, T);
    const int64_t blk = 64 + 8 * G;
    for (int64_t g = 0; g < ng; g++) {
        __m512 gacc[MAX_T][MAX_R];
        ZERO_TILES(gacc, R, T);
        for (int64_t b = 0; b < G / 8; b++) {
            if (R == 1) prefetch_tiles(w, blk_tile, g, blk, b * 64, T);
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
    STORE_TILES(acc, bias, y, N, n0, R, T, 1);
}

#elif NARROW_SIMD

const char *w4a16_isa(void) { return TILES_ISA == TILES_AVX2 ? "avx2" : "neon"; }

/* R rows x T tiles, all of K, over tiles_avx2.h / tiles_neon.h. Per output and group, in input order,
 * S' = fma(code, bf16(x), S') with the code as stored (0..15, not code - 8): the -8 goes into the zero,
 * y += S' * scale + (zero - 8 * scale) * X_g, which saves a subtraction an input (equal to S * scale +
 * zero * X_g in exact arithmetic, and agreeing within float rounding). */
static inline __attribute__((always_inline)) void
tile_kernel(const uint8_t *w, int64_t blk_tile, int64_t ng, int64_t G, const float *xf, const float *xs,
            const float *bias, float *y, int64_t N, int64_t n0, const int R, const int T) {
    vf acc[MAX_T][VECS][MAX_R];
    ZERO_VECS(acc, R, T);
    const int64_t blk = 64 + 8 * G;
    for (int64_t g = 0; g < ng; g++) {
        vf gacc[MAX_T][VECS][MAX_R];
        ZERO_VECS(gacc, R, T);
        for (int64_t b = 0; b < G / 8; b++) {
            if (R == 1) prefetch_tiles(w, blk_tile, g, blk, b * 64, T);
            const float *xb = xf + (g * G + b * 8) * R;   /* input 8b + c of row r at xb[c * R + r] */
            UNROLL
            for (int t = 0; t < T; t++) {
                vi d[VECS];
                UNROLL
                for (int v = 0; v < VECS; v++) d[v] = vi_load(w + t * blk_tile + g * blk + 64 + b * 64 + v * 4 * LANES);
                UNROLL
                for (int c = 0; c < 8; c++) {
                    vf wv[VECS];
                    UNROLL
                    for (int v = 0; v < VECS; v++) wv[v] = w4_code(d[v], c);
                    UNROLL
                    for (int r = 0; r < R; r++) {
                        vf xv = vf_bcast(xb + c * R + r);
                        UNROLL
                        for (int v = 0; v < VECS; v++) gacc[t][v][r] = vf_fma(wv[v], xv, gacc[t][v][r]);
                    }
                }
            }
        }
        UNROLL
        for (int t = 0; t < T; t++)
            UNROLL
            for (int v = 0; v < VECS; v++) {
                const uint8_t *sp = w + t * blk_tile + g * blk + v * 2 * LANES;
                vf s = vf_bf16(sp), z = vf_fma(s, vf_set1(-8.f), vf_bf16(sp + 32));
                UNROLL
                for (int r = 0; r < R; r++) {
                    acc[t][v][r] = vf_fma(gacc[t][v][r], s, acc[t][v][r]);
                    acc[t][v][r] = vf_fma(z, vf_bcast(xs + r * ng + g), acc[t][v][r]);
                }
            }
    }
    STORE_VECS(acc, bias, y, N, n0, R, T);
}

/* What the activation stream carries for input c of 8: 2^-W4_SHIFT(c), undoing w4_code's factor */
#define UNIT(c) (1.f / (float)(1 << W4_SHIFT(c)))
static const float W4_UNITS[8] = {UNIT(0), UNIT(1), UNIT(2), UNIT(3), UNIT(4), UNIT(5), UNIT(6), UNIT(7)};
#undef UNIT
#endif

#if !NARROW_SIMD
#define W4_UNITS NULL   /* a pair stream: no factors */
#endif

#if TILES_ISA != TILES_PORTABLE
#define KERNEL(R, T)                                                                                      \
    static void kern_##R##_##T(const uint8_t *w, int64_t bt, int64_t ng, int64_t G, const stream_t *xa,  \
                               const float *xs, const float *bias, float *y, int64_t N, int64_t n0) {     \
        tile_kernel(w, bt, ng, G, xa, xs, bias, y, N, n0, R, T);                                          \
    }
TILE_SHAPES(KERNEL)

typedef void (*kern_fn)(const uint8_t *, int64_t, int64_t, int64_t, const stream_t *, const float *,
                        const float *, float *, int64_t, int64_t);
static const kern_fn KERNELS[ROW_BLOCK + 1][2] = ROWS_OF(kern);

static inline void pass(const void *job, int64_t m, int64_t R, int64_t t, int wide) {
    const bf16_job *j = job;
    KERNELS[R][wide](j->w + t * j->bt, j->bt, j->ng, j->G, stream_of(j, m), j->xs + m * j->ng, j->bias,
                     j->y + m * j->N, j->N, t * TILE);
}

static void run_tiles(const void *job, int64_t t0, int64_t t1) {
    row_passes(job, t0, t1, ((const bf16_job *)job)->M, pass);
}

#else /* portable */

const char *w4a16_isa(void) { return "portable"; }

static inline v8f bf16x8(const uint8_t *p) {   /* 8 bf16 -> fp32 */
    uint16_t h[HALF];
    v8u u;
    memcpy(h, p, sizeof h);
    for (int i = 0; i < HALF; i++) u[i] = (uint32_t)h[i] << 16;
    return (v8f)u;
}

/* s, z = the group's scales and zeros; wf[k][half] = (code - 8) of input k for outputs 8 * half .. + 7 */
static void unpack_group(const uint8_t *p, int64_t G, v8f (*wf)[2], v8f *s, v8f *z) {
    static const int shift[8] = {0, 16, 4, 20, 8, 24, 12, 28};   /* c0..c7 in a dword (see the layout) */
    s[0] = bf16x8(p), s[1] = bf16x8(p + 16), z[0] = bf16x8(p + 32), z[1] = bf16x8(p + 48);
    for (int64_t b = 0; b < G / 8; b++)
        for (int h = 0; h < 2; h++) {
            v8u d;
            memcpy(&d, p + 64 + b * 64 + h * 32, sizeof d);
            for (int c = 0; c < 8; c++)
                wf[b * 8 + c][h] = __builtin_convertvector((v8i)((d >> shift[c]) & 15u) - 8, v8f);
        }
}

static void run_tiles(const void *job, int64_t t0, int64_t t1) {
    const bf16_job *j = job;
    portable_tiles(j, t0, t1, 64 + 8 * j->G, unpack_group, 1);
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias). Returns 0, or -1 on bad arguments / no memory. */
int w4a16_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t G, const float *bias,
                 float *y, int nthreads) {
    return bf16_linear(x, M, K, w, N, G, bias, y, nthreads, 64 + 8 * G, 1, W4_UNITS, run_tiles);
}
