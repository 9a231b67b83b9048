/* Row-invariant matmuls with int8 activations: W4A8 and W8A8, y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * They read the very tiles the W4A16 and W8A16 kernels read (w4a16.c, w8a16.c): one prepared weight,
 * either activation precision, chosen per call. Numerics (flowedge/kernels/int8act.py has the long form):
 *   per row m and group g of G inputs: s_a = max|x| / 127, q = rint(x / s_a) in -127..127 (int8),
 *   X_g = the fp32 sum of x over the group (16 fixed lanes, then the lanes in order), W4 only;
 *   per output n: S = sum over the group of (code - off) * q, in int32 (exact: order does not matter),
 *     W4: code 0..15, off 8; W8: the signed code + 128 (unsigned for vpdpbusd), off 128; the builds
 *     whose dot products take signed codes (AVX2 without AVX-VNNI for W8, NEON) sum code * q from 0;
 *   y = fma(float(S), scale * s_a, y) [W4: then y = fma(zero, X_g, y)], groups in order; y += bias.
 * The quantization of a row depends on that row only and every float operation is the same for every
 * row whatever M, its row pass or the thread count (threads split N only): rows are invariant. All
 * builds (AVX-512, AVX2 in int8act_avx2.h, NEON in int8act_neon.h, portable) compute the same integers
 * and the same float operations (fmaf in the portable build), so they agree bit for bit.
 *
 * Activation stream: per row, K int8 in dwords of 4 inputs, the pass's rows interleaved per dword
 * (dword j of row r at base + j * R + r). W8: inputs in order. W4: per 8 inputs the order 0 4 1 5 2 6 3 7,
 * which is what a nibble dword of the W4A16 layout (c0 c2 c4 c6 c1 c3 c5 c7) gives as bytes when masked
 * with 0x0f0f0f0f (inputs 0 4 1 5), then shifted right by 4 and masked (2 6 3 7).
 */
#include <float.h>
#include <math.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define AVX512_TILES
#endif
#if defined(__ARM_FEATURE_DOTPROD)
#define NEON_TILES   /* before dotprod NEON has no four-product int8 dot: the portable loop runs */
#endif
#include "tiles.h"

#define QMAX 127

typedef struct {   /* one call's quantized activations */
    int8_t *q;     /* [M, K] stream, see above */
    float *sa;     /* [M, K/G] s_a */
    int32_t *corr; /* [M, K/G] -off * sum q: the accumulator's start, so that it ends at S */
    float *xs;     /* [M, K/G] X_g */
} acts;

typedef struct {   /* one call's arguments, read by every thread */
    const uint8_t *w;   /* the tiles */
    int64_t M, K, G, N, ng, bt;   /* ng = K / G groups, bt bytes a tile */
    int w4;             /* W4A16 tiles (1) or W8A16 tiles (0) */
    acts a;
    const float *bias;
    float *y;
} job_t;

#if TILES_ISA == TILES_NEON || TILES_ISA == TILES_PORTABLE
static const int W4_POS[8] = {0, 2, 4, 6, 1, 3, 5, 7};   /* input e of 8 -> its place in the stream */

/* one row's group: s_a, q into the stream (dst: its first dword, R rows a dword), -off * sum q, X_g */
static void quantize_group(const float *xg, int64_t G, int w4, int8_t *dst, int64_t R, float *sa, int32_t *corr,
                           float *xs) {
    float amax = 0.f;
    int finite = 1;
    for (int64_t k = 0; k < G; k++) {
        float a = fabsf(xg[k]);
        finite &= a <= FLT_MAX;
        amax = a > amax ? a : amax;
    }
    float s = finite ? amax / QMAX : NAN;   /* NaN or inf in x: the group's outputs become NaN */
    int32_t sum = 0;
    for (int64_t k = 0; k < G; k++) {
        float v = finite && s > 0.f ? rintf(xg[k] / s) : 0.f;
        v = v > QMAX ? QMAX : v < -QMAX ? -QMAX : v;
        int8_t qv = (int8_t)v;
        int64_t p = w4 ? (k & ~(int64_t)7) + W4_POS[k & 7] : k;
        dst[(p >> 2) * R * 4 + (p & 3)] = qv;
        sum += qv;
    }
    float lane[16] = {0};
    for (int64_t k = 0; k < G; k += 16)
        for (int j = 0; j < 16; j++) lane[j] += xg[k + j];
    float total = 0.f;
    for (int j = 0; j < 16; j++) total += lane[j];
    *sa = s;
    *corr = -(w4 ? 8 : 128) * sum;
    *xs = total;
}
#endif

#if TILES_ISA == TILES_AVX512

const char *int8act_isa(void) { return "avx512vnni"; }

/* The portable quantize_group (below) in 16 lanes: the same IEEE operations (a division, round to nearest
 * even, lane sums in the same order), so the same bits; gcc left the scalar one unvectorized: 16 rows of
 * 1536 inputs took ~45 us, half of a 16-row k/v_proj call. */
static void quantize_group(const float *xg, int64_t G, int w4, int8_t *dst, int64_t R, float *sa, int32_t *corr,
                           float *xs) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff)), big = _mm512_set1_ps(FLT_MAX);
    __m512 vmax = _mm512_setzero_ps(), lane = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t k = 0; k < G; k += 16) {
        __m512 v = _mm512_loadu_ps(xg + k), a = _mm512_and_ps(v, absmask);
        bad |= _mm512_cmp_ps_mask(a, big, _CMP_NLE_UQ);   /* inf or NaN */
        vmax = _mm512_max_ps(vmax, a);
        lane = _mm512_add_ps(lane, v);
    }
    float amax = _mm512_reduce_max_ps(vmax), l[16], total = 0.f;
    _mm512_storeu_ps(l, lane);
    for (int j = 0; j < 16; j++) total += l[j];
    float s = bad ? NAN : amax / QMAX;
    /* W4: per 8 inputs the stream order 0 4 1 5 2 6 3 7 */
    const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-QMAX), hi = _mm512_set1_ps(QMAX);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < G; k += 16) {
        __m512i qi = _mm512_setzero_si512();
        if (!bad && s > 0.f) {
            __m512 v = _mm512_div_ps(_mm512_loadu_ps(xg + k), sv);
            v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            qi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
        }
        sum = _mm512_add_epi32(sum, qi);
        __m128i b = _mm512_cvtepi32_epi8(qi);
        int8_t q16[16];
        _mm_storeu_si128((__m128i *)q16, w4 ? _mm_shuffle_epi8(b, order) : b);
        for (int j = 0; j < 4; j++) memcpy(dst + ((k >> 2) + j) * R * 4, q16 + 4 * j, 4);
    }
    *sa = s;
    *corr = -(w4 ? 8 : 128) * _mm512_reduce_add_epi32(sum);
    *xs = total;
}

/* acc += u8(w) . s8(the dword at x, broadcast), 4 products a lane. A separate vpbroadcastd, not the
 * {1to16} memory operand w4a16.c folds in: on Zen 4 vpdpbusd with a broadcast memory operand ran at
 * 0.4-0.6 a cycle, from a register at 0.95 (measured, 8-12 accumulators). */
static inline __m512i dot4(__m512i acc, __m512i w, const int32_t *x) {
    __m512i xv = _mm512_set1_epi32(*x);
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(xv));   /* in place (the intrinsic made gcc copy it) */
    return acc;
}

/* W8A16 block pair (32 bytes: byte 2i + e = output i at input 2j + e, then the same for 2j + 2) ->
 * dword i = output i's four inputs in order */
static inline __m512i w8_perm(void) {
    uint8_t idx[64];
    for (int i = 0; i < 16; i++) {
        idx[4 * i] = (uint8_t)(2 * i);
        idx[4 * i + 1] = (uint8_t)(2 * i + 1);
        idx[4 * i + 2] = (uint8_t)(32 + 2 * i);
        idx[4 * i + 3] = (uint8_t)(33 + 2 * i);
    }
    return _mm512_loadu_si512((const void *)idx);
}

/* R rows x T tiles, all of K; W4 (w4 = 1) or W8. R, T, w4 are constants after inlining. */
static inline __attribute__((always_inline)) void
tile_kernel(const uint8_t *w, int64_t blk_tile, int64_t ng, int64_t G, const int32_t *xq, const float *sa,
            const int32_t *corr, const float *xs, const float *bias, float *y, int64_t N, int64_t n0, const int R,
            const int T, const int w4) {
    const __m512i nib = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    const __m512i perm = w8_perm();
    __m512 acc[MAX_T][MAX_R];
    ZERO_TILES(acc, R, T);
    const int64_t blk = w4 ? 64 + 8 * G : 64 + 16 * G;
    for (int64_t g = 0; g < ng; g++) {
        __m512i gacc[MAX_T][MAX_R];
        UNROLL
        for (int r = 0; r < R; r++) {
            __m512i c = _mm512_set1_epi32(corr[r * ng + g]);
            UNROLL
            for (int t = 0; t < T; t++) gacc[t][r] = c;
        }
        const int32_t *xg = xq + g * (G / 4) * R;
        for (int64_t b = 0; b < G / (w4 ? 8 : 4); b++) {   /* 64 bytes of codes a tile */
            if (R == 1) prefetch_tiles(w, blk_tile, g, blk, b * 64, T);
            UNROLL
            for (int t = 0; t < T; t++) {
                __m512i d = _mm512_loadu_si512((const void *)(w + t * blk_tile + g * blk + 64 + b * 64));
                if (w4) {
                    const int32_t *xj = xg + 2 * b * R;
                    __m512i lo = _mm512_and_si512(d, nib), hi = _mm512_and_si512(_mm512_srli_epi32(d, 4), nib);
                    UNROLL
                    for (int r = 0; r < R; r++) gacc[t][r] = dot4(dot4(gacc[t][r], lo, xj + r), hi, xj + R + r);
                } else {
                    const int32_t *xj = xg + b * R;
                    __m512i u = _mm512_xor_si512(_mm512_permutexvar_epi8(perm, d), flip);
                    UNROLL
                    for (int r = 0; r < R; r++) gacc[t][r] = dot4(gacc[t][r], u, xj + r);
                }
            }
        }
        UNROLL
        for (int t = 0; t < T; t++) {
            const uint8_t *sp = w + t * blk_tile + g * blk;
            __m512 s = w4 ? load_bf16x16(sp) : _mm512_loadu_ps((const float *)sp);
            __m512 z = w4 ? load_bf16x16(sp + 32) : s;
            UNROLL
            for (int r = 0; r < R; r++) {
                __m512 f = _mm512_mul_ps(s, _mm512_set1_ps(sa[r * ng + g]));
                acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(gacc[t][r]), f, acc[t][r]);
                if (w4) acc[t][r] = _mm512_fmadd_ps(z, _mm512_set1_ps(xs[r * ng + g]), acc[t][r]);
            }
        }
    }
    STORE_TILES(acc, bias, y, N, n0, R, T, 0);
}

#elif NARROW_SIMD
/* After a group, lane by lane: acc += float(S) * (scale * s_a), then (W4) acc += zero * X_g: the same
 * fused operations as the portable loop's fmaf, so every build gives the same bits. */
static inline __attribute__((always_inline)) vf group_end(vf acc, vi S, vf s, vf z, float sa, float xs, const int w4) {
    acc = vf_fma(vf_of_i32(S), vf_mul(s, vf_set1(sa)), acc);
    return w4 ? vf_fma(z, vf_set1(xs), acc) : acc;
}

#if TILES_ISA == TILES_AVX2
#include "int8act_avx2.h"
#else
#include "int8act_neon.h"
#endif
#endif

#if TILES_ISA != TILES_PORTABLE
typedef void (*kern_fn)(const uint8_t *, int64_t, int64_t, int64_t, const int32_t *, const float *, const int32_t *,
                        const float *, const float *, float *, int64_t, int64_t);
#define KERNEL(R, T)                                                                                           \
    static void k4_##R##_##T(const uint8_t *w, int64_t bt, int64_t ng, int64_t G, const int32_t *xq,          \
                             const float *sa, const int32_t *corr, const float *xs, const float *bias, float *y, \
                             int64_t N, int64_t n0) {                                                          \
        tile_kernel(w, bt, ng, G, xq, sa, corr, xs, bias, y, N, n0, R, T, 1);                                  \
    }                                                                                                          \
    static void k8_##R##_##T(const uint8_t *w, int64_t bt, int64_t ng, int64_t G, const int32_t *xq,          \
                             const float *sa, const int32_t *corr, const float *xs, const float *bias, float *y, \
                             int64_t N, int64_t n0) {                                                          \
        tile_kernel(w, bt, ng, G, xq, sa, corr, xs, bias, y, N, n0, R, T, 0);                                  \
    }
TILE_SHAPES(KERNEL)

static const kern_fn KERNELS[2][ROW_BLOCK + 1][2] = {ROWS_OF(k8), ROWS_OF(k4)};   /* [w4][R][wide?] */

static inline void pass(const void *job, int64_t m, int64_t R, int64_t t, int wide) {
    const job_t *j = job;
    int64_t ng = j->ng;
    KERNELS[j->w4][R][wide](j->w + t * j->bt, j->bt, ng, j->G, (const int32_t *)(j->a.q + m * j->K), j->a.sa + m * ng,
                            j->a.corr + m * ng, j->a.xs + m * ng, j->bias, j->y + m * j->N, j->N, t * TILE);
}

static void run_tiles(const void *job, int64_t t0, int64_t t1) {
    row_passes(job, t0, t1, ((const job_t *)job)->M, pass);
}

#else /* portable: plain C over 16-lane vectors (gcc maps them onto the target's registers) */

const char *int8act_isa(void) { return "portable"; }

typedef int32_t v16i __attribute__((vector_size(64)));

/* wq[p] = the unsigned codes (W4: 0..15; W8: code + 128) of the tile's 16 outputs at stream place p */
static void unpack_group(const uint8_t *p, int64_t G, int w4, v16i *wq) {
    for (int i = 0; i < TILE; i++) {
        if (w4) {
            for (int64_t b = 0; b < G / 8; b++) {
                uint32_t d;
                memcpy(&d, p + 64 + b * 64 + 4 * i, 4);
                uint32_t lo = d & 0x0f0f0f0fu, hi = (d >> 4) & 0x0f0f0f0fu;
                for (int e = 0; e < 4; e++) {
                    wq[8 * b + e][i] = (int32_t)((lo >> (8 * e)) & 0xff);
                    wq[8 * b + 4 + e][i] = (int32_t)((hi >> (8 * e)) & 0xff);
                }
            }
        } else {
            const int8_t *c = (const int8_t *)(p + 64);
            for (int64_t k = 0; k < G; k++) wq[k][i] = c[(k / 2) * 32 + 2 * i + (k & 1)] + 128;
        }
    }
}

static inline float bf16_at(const uint8_t *p, int i) {
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return bf16_to_f32(h);
}

/* w4 is a constant after inlining: one copy of the loop per tile kind (see run_tiles) */
static inline __attribute__((always_inline)) void tiles_of(const job_t *j, int64_t t0, int64_t t1, const int w4) {
    const uint8_t *w = j->w;
    int64_t M = j->M, K = j->K, G = j->G, N = j->N, ng = K / G, blk = w4 ? 64 + 8 * G : 64 + 16 * G, bt = ng * blk;
    acts a = j->a;   /* locals: clear_tile's memset could otherwise change what j points to */
    const float *bias = j->bias;
    float *y = j->y;
    v16i wq[256];
    float s[TILE], z[TILE];
    for (int64_t t = t0; t < t1; t++) {
        clear_tile(y, M, N, t);
        for (int64_t g = 0; g < ng; g++) {
            const uint8_t *p = w + t * bt + g * blk;
            for (int i = 0; i < TILE; i++) {
                if (w4) {
                    s[i] = bf16_at(p, i);
                    z[i] = bf16_at(p + 32, i);
                } else {
                    memcpy(&s[i], p + 4 * i, 4);
                }
            }
            unpack_group(p, G, w4, wq);
            for (int64_t m = 0; m < M; m++) {
                const int8_t *q = a.q + m * K + g * G;
                v16i acc = (v16i){0} + a.corr[m * ng + g];
                for (int64_t k = 0; k < G; k++) acc += wq[k] * (int32_t)q[k];
                float sam = a.sa[m * ng + g], xsm = a.xs[m * ng + g], *o = y + m * N + t * TILE;
                for (int i = 0; i < TILE; i++) {
                    float v = __builtin_fmaf((float)acc[i], s[i] * sam, o[i]);
                    o[i] = w4 ? __builtin_fmaf(z[i], xsm, v) : v;
                }
            }
        }
        add_bias(y, M, N, t, bias);
    }
}

static void run_tiles(const void *job, int64_t t0, int64_t t1) {
    const job_t *j = job;
    if (j->w4)
        tiles_of(j, t0, t1, 1);
    else
        tiles_of(j, t0, t1, 0);
}
#endif

static void quantize_x(const float *x, int64_t M, int64_t K, int64_t G, int w4, acts a) {
    int64_t ng = K / G, rb = rows_per_pass(M);
    for (int64_t m = 0; m < M; m++) {
        int64_t m0, R = pass_of(m, M, rb, &m0);
        int8_t *row = a.q + m0 * K + (m - m0) * 4;
        for (int64_t g = 0; g < ng; g++)
            quantize_group(x + m * K + g * G, G, w4, row + g * G * R, R, a.sa + m * ng + g, a.corr + m * ng + g,
                           a.xs + m * ng + g);
    }
}

static int linear(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t G, const float *bias,
                  float *y, int nthreads, int w4) {
    if (bad_shape(M, K, N, G)) return -1;
    int64_t ng = K / G;
    acts a = {malloc((size_t)(M * K)), malloc((size_t)(M * ng) * sizeof(float)),
              malloc((size_t)(M * ng) * sizeof(int32_t)), malloc((size_t)(M * ng) * sizeof(float))};
    int rc = -1;
    if (a.q && a.sa && a.corr && a.xs) {
        quantize_x(x, M, K, G, w4, a);
        job_t job = {w, M, K, G, N, ng, ng * (w4 ? 64 + 8 * G : 64 + 16 * G), w4, a, bias, y};
        split_tiles(&job, N / TILE, M, nthreads, run_tiles);
        rc = 0;
    }
    free(a.q);
    free(a.sa);
    free(a.corr);
    free(a.xs);
    return rc;
}

/* y[M, N] = x[M, K] @ W^T (+ bias) over W4A16 tiles (w4a16.c's layout). 0, or -1 on bad arguments / no memory. */
int w4a8_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t G, const float *bias,
                float *y, int nthreads) {
    return linear(x, M, K, w, N, G, bias, y, nthreads, 1);
}

/* The same over W8A16 tiles (w8a16.c's layout). */
int w8a8_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t G, const float *bias,
                float *y, int nthreads) {
    return linear(x, M, K, w, N, G, bias, y, nthreads, 0);
}
