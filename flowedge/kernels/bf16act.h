/* What the two bf16-activation kernels (w4a16.c, w8a16.c) share on top of tiles.h: the activation stream
 * (x rounded to bf16: pairs for AVX-512's dot product and the portable loop, one float each for AVX2 and
 * NEON's multiply-adds; a pass's rows interleaved), the group sums zero points need, the body of their
 * entry points, the AVX-512 dot product with a broadcast pair, and the portable build's loop over a tile's
 * groups and rows.
 *
 * The two differ in the tile layout only: w4a16 has bf16 scales and zeros (y also takes zero * X_g),
 * w8a16 fp32 scales and no zeros.
 */
#ifndef FLOWEDGE_BF16ACT_H
#define FLOWEDGE_BF16ACT_H

#include "tiles.h"

typedef struct {   /* one call's arguments, read by every thread */
    const uint8_t *w;   /* the tiles */
    int64_t M, K, G, N, ng, bt;   /* ng = K / G groups, bt bytes a tile */
    const uint32_t *xp; /* the activation stream: pack_pairs, or pack_floats (FLOAT_STREAM) */
    const float *xf;
    const float *xs;    /* [M, ng] group sums of bf16(x) (w4a16), or NULL */
    const float *bias;
    float *y;
} bf16_job;

/* x [M, K] fp32 -> xp: bf16 pairs (inputs 2j, 2j+1 in one u32), interleaved per pass of R rows
 * (pass base + j * R + r), so a kernel reaches every row of its pass from one pointer. */
static void pack_pairs(const float *x, int64_t M, int64_t K, uint32_t *xp) {
    int64_t rb = rows_per_pass(M);
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        int64_t m0, R = pass_of(m, M, rb, &m0);
        uint32_t *dst = xp + m0 * (K / 2) + (m - m0);
        for (int64_t j = 0; j < K / 2; j++)
            dst[j * R] = (uint32_t)bf16_rne(xr[2 * j]) | (uint32_t)bf16_rne(xr[2 * j + 1]) << 16;
    }
}

#define FLOAT_STREAM NARROW_SIMD   /* AVX2 and NEON broadcast one float an input */
#if FLOAT_STREAM
typedef float stream_t;      /* what a SIMD kernel reads the stream as */
#else
typedef uint32_t stream_t;
#endif

/* The stream of the pass that starts at row m */
static inline const stream_t *stream_of(const bf16_job *j, int64_t m) {
#if FLOAT_STREAM
    return j->xf + m * j->K;
#else
    return j->xp + m * (j->K / 2);
#endif
}

/* x [M, K] fp32 -> xf: bf16(x) as fp32 times unit[k % 8], interleaved per pass of R rows (pass base +
 * k * R + r). unit: powers of two (exact short of underflow below 2^-100), or NULL for none. */
static void pack_floats(const float *x, int64_t M, int64_t K, const float *unit, float *xf) {
    int64_t rb = rows_per_pass(M);
    for (int64_t m = 0; m < M; m++) {
        int64_t m0, R = pass_of(m, M, rb, &m0);
        float *dst = xf + m0 * K + (m - m0);
        for (int64_t k = 0; k < K; k++) {
            float v = bf16_to_f32(bf16_rne(x[m * K + k]));
            dst[k * R] = unit ? v * unit[k & 7] : v;
        }
    }
}

/* xs [M, K/G]: group sums of the rounded values in 16 fixed lanes, then the lanes in order (the zero
 * points' term, w4a16). */
static void group_sums(const float *x, int64_t M, int64_t K, int64_t G, float *xs) {
    int64_t ng = K / G;
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
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

/* The body of either kernel's entry point: the activation stream (float streams times unit[k % 8], see
 * pack_floats) and group sums (with_sums), then the tiles (blk bytes a tile's group) by `run` on up to
 * nthreads threads. 0, or -1 on bad arguments / no memory. */
static int bf16_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t G,
                       const float *bias, float *y, int nthreads, int64_t blk, int with_sums, const float *unit,
                       tiles_fn run) {
    if (bad_shape(M, K, N, G)) return -1;
    int64_t ng = K / G;
    void *stream = malloc((size_t)(M * K) * (FLOAT_STREAM ? sizeof(float) : sizeof(uint16_t)));
    float *xs = with_sums ? malloc((size_t)(M * ng) * sizeof(float)) : NULL;
    int rc = -1;
    if (stream && (xs || !with_sums)) {
        if (FLOAT_STREAM)
            pack_floats(x, M, K, unit, stream);
        else
            pack_pairs(x, M, K, stream);
        if (with_sums) group_sums(x, M, K, G, xs);
        bf16_job job = {w, M, K, G, N, ng, ng * blk, stream, stream, xs, bias, y};
        split_tiles(&job, N / TILE, M, nthreads, run);
        rc = 0;
    }
    free(stream);
    free(xs);
    return rc;
}

#if TILES_ISA == TILES_AVX512

/* acc += w . broadcast(the bf16 pair at x): written out because gcc does not fold the broadcast
 * into the instruction's memory operand (a separate vpbroadcastd per row doubled the instructions) */
static inline __m512 dot_pair(__m512 acc, __m512bh w, const uint32_t *x) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

#elif TILES_ISA == TILES_PORTABLE /* plain C that the compiler vectorizes over the 16 outputs of a tile */

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

/* rows m0 .. m0 + R - 1 of one group of one tile; R and zp (zero points?) are constants after inlining */
static inline __attribute__((always_inline)) void
group_rows(v8f (*wf)[2], int64_t G, const uint32_t *xr, int64_t xstride, const float *xg, int64_t ng,
           v8f s0, v8f s1, v8f z0, v8f z1, float *yr, int64_t N, const int R, const int zp) {
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
        if (zp) {
            store_v8f(o, (load_v8f(o) + a0[r] * s0) + z0 * xg[r * ng]);
            store_v8f(o + HALF, (load_v8f(o + HALF) + a1[r] * s1) + z1 * xg[r * ng]);
        } else {
            store_v8f(o, load_v8f(o) + a0[r] * s0);
            store_v8f(o + HALF, load_v8f(o + HALF) + a1[r] * s1);
        }
    }
}

/* rows m .. m + min(PASS, M - m) - 1 of one group of one tile: group_rows for a constant R */
static inline __attribute__((always_inline)) void
group_pass(v8f (*wf)[2], int64_t G, const uint32_t *xr, int64_t xstride, const float *xg, int64_t ng, v8f s0,
           v8f s1, v8f z0, v8f z1, float *yr, int64_t N, int64_t rows, const int zp) {
    switch (rows < PASS ? rows : PASS) {
    case 1: group_rows(wf, G, xr, xstride, xg, ng, s0, s1, z0, z1, yr, N, 1, zp); break;
    case 2: group_rows(wf, G, xr, xstride, xg, ng, s0, s1, z0, z1, yr, N, 2, zp); break;
    case 3: group_rows(wf, G, xr, xstride, xg, ng, s0, s1, z0, z1, yr, N, 3, zp); break;
    default: group_rows(wf, G, xr, xstride, xg, ng, s0, s1, z0, z1, yr, N, 4, zp);
    }
}

/* The tile layout's part of the portable loop, one per kernel file: the group at p's scales in s[0..1]
 * (zeros in z[0..1] where it has them) and its weights as floats in wf[k][half]. */
typedef void (*unpack_fn)(const uint8_t *p, int64_t G, v8f (*wf)[2], v8f *s, v8f *z);

/* Tiles t0..t1: per tile and group, unpack once, then the rows PASS at a time; zp (zero points?) and
 * unpack are constants after inlining. */
static inline __attribute__((always_inline)) void
portable_tiles(const bf16_job *j, int64_t t0, int64_t t1, int64_t blk, unpack_fn unpack, const int zp) {
    int64_t M = j->M, K = j->K, G = j->G, N = j->N, ng = K / G, bt = ng * blk;
    const uint8_t *w = j->w;   /* locals: clear_tile's memset could otherwise change what j points to */
    const uint32_t *xp = j->xp;
    const float *xs = j->xs, *bias = j->bias;
    float *y = j->y;
    v8f wf[256][2], s[2], z[2] = {{0}, {0}};
    for (int64_t t = t0; t < t1; t++) {
        clear_tile(y, M, N, t);
        for (int64_t g = 0; g < ng; g++) {
            unpack(w + t * bt + g * blk, G, wf, s, z);
            for (int64_t m = 0; m < M; m += PASS)
                group_pass(wf, G, xp + m * (K / 2) + g * G / 2, K / 2, zp ? xs + m * ng + g : NULL, ng, s[0], s[1],
                           z[0], z[1], y + m * N + t * TILE, N, M - m, zp);
        }
        add_bias(y, M, N, t, bias);
    }
}
#endif

#endif /* FLOWEDGE_BF16ACT_H */
