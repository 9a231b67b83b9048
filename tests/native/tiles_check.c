/* The tiled kernels of one build checked against the portable build of the same sources, in one process:
 * every row's bits equal the row computed alone for 1..MAXM rows (each pass shape), whatever the thread
 * count, and the outputs agree with the reference (int8 activations bit for bit, bf16 within float
 * rounding). tests/test_kernels_neon.py cross-compiles it for aarch64 and runs it under qemu; any target
 * works. The reference objects are the kernel sources built with -DFLOWEDGE_PORTABLE and their entry
 * points renamed ref_<name>.
 *
 * Prints each kernel's tile code, then one line a check; exits 0 when all hold, 1 at the first failure. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*linear_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, const float *, float *,
                         int);
#define DECLARE(name)                                                                                       \
    int name##_linear(const float *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, const float *, float *, \
                      int);                                                                                 \
    int ref_##name##_linear(const float *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, const float *,    \
                            float *, int);
DECLARE(w4a16)
DECLARE(w8a16)
DECLARE(w4a8)
DECLARE(w8a8)
const char *w4a16_isa(void), *w8a16_isa(void), *int8act_isa(void);

#define N 208    /* 13 tiles: not a multiple of any kernel's tile step */
#define K 256    /* every group size up to 256 divides it */
#define MAXM 19  /* passes of 4, 4, 4, 4, 3 rows (NEON), 10 + 9 (AVX-512) */

typedef struct {
    const char *name;
    linear_fn fn, ref;
    int bits;   /* the tiles' codes: 4 or 8 */
    int exact;  /* int8 activations: the reference's bits */
} kernel_t;

static uint32_t state = 12345u;

static float uniform(void) {   /* in [-1, 1) */
    state = state * 1664525u + 1013904223u;
    return (float)(state >> 8) / 8388608.0f - 1.0f;
}

static void put_bf16(uint8_t *p, float f) {   /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    uint16_t h = (uint16_t)(u >> 16);
    memcpy(p, &h, 2);
}

/* Random tiles [N/16][K/G][table | codes]: W4 bf16 scales and zeros, code bytes; W8 fp32 scales, codes
 * in -127..127 */
static uint8_t *random_tiles(int bits, int G) {
    int64_t blk = bits == 4 ? 64 + 8 * G : 64 + 16 * G, size = (N / 16) * (K / G) * blk;
    uint8_t *w = malloc((size_t)size);
    for (int64_t at = 0; at < size; at += blk) {
        for (int i = 0; i < 16; i++) {
            float s = 0.01f * (1.5f + uniform());
            if (bits == 4) {
                put_bf16(w + at + 2 * i, s);
                put_bf16(w + at + 32 + 2 * i, 0.05f * uniform());
            } else {
                memcpy(w + at + 4 * i, &s, 4);
            }
        }
        for (int64_t b = 64; b < blk; b++)
            w[at + b] = bits == 4 ? (uint8_t)(state = state * 1664525u + 1013904223u) >> 24
                                  : (uint8_t)(int8_t)(int)(127.f * uniform());
    }
    return w;
}

static int fail(const kernel_t *k, int G, const char *what) {
    printf("FAIL %s G=%d: %s\n", k->name, G, what);
    return 1;
}

static int check(const kernel_t *k, int G) {
    static float x[MAXM * K], alone[MAXM * N], y[MAXM * N], ref[MAXM * N];
    float bias[N];
    uint8_t *w = random_tiles(k->bits, G);
    for (int m = 0; m < MAXM; m++)   /* rows of every magnitude: each row's scale is its own */
        for (int i = 0; i < K; i++) x[m * K + i] = uniform() * powf(10.f, (float)(m % 7) - 3.f);
    for (int n = 0; n < N; n++) bias[n] = uniform();
    int bad = 0;
    for (int m = 0; m < MAXM && !bad; m++) bad = k->fn(x + m * K, 1, K, w, N, G, bias, alone + m * N, 1) != 0;
    for (int M = 1; M <= MAXM && !bad; M++) {
        bad = k->fn(x, M, K, w, N, G, bias, y, 1) != 0;
        if (!bad && memcmp(y, alone, sizeof(float) * M * N)) return free(w), fail(k, G, "a row differs from itself alone");
    }
    for (int threads = 2; threads <= 5 && !bad; threads += 3) {
        bad = k->fn(x, MAXM, K, w, N, G, bias, y, threads) != 0;
        if (!bad && memcmp(y, alone, sizeof y)) return free(w), fail(k, G, "the thread count changed a bit");
    }
    bad = bad || k->ref(x, MAXM, K, w, N, G, bias, ref, 1) != 0;
    free(w);
    if (bad) return fail(k, G, "a kernel refused its arguments");
    double diff = 0, norm = 0;
    for (int i = 0; i < MAXM * N; i++) {
        diff += ((double)alone[i] - ref[i]) * ((double)alone[i] - ref[i]);
        norm += (double)ref[i] * ref[i];
    }
    if (k->exact ? memcmp(alone, ref, sizeof ref) != 0 : !(sqrt(diff / norm) < 1e-5))
        return fail(k, G, k->exact ? "not the reference's bits" : "too far from the reference");
    printf("ok %s G=%d: rows and threads invariant, %s the portable reference (rel. %.1e)\n", k->name, G,
           k->exact ? "the bits of" : "close to", sqrt(diff / norm));
    return 0;
}

int main(void) {
    const kernel_t kernels[] = {{"w4a16", w4a16_linear, ref_w4a16_linear, 4, 0},
                                {"w8a16", w8a16_linear, ref_w8a16_linear, 8, 0},
                                {"w4a8", w4a8_linear, ref_w4a8_linear, 4, 1},
                                {"w8a8", w8a8_linear, ref_w8a8_linear, 8, 1}};
    printf("tiles: w4a16 %s, w8a16 %s, int8act %s\n", w4a16_isa(), w8a16_isa(), int8act_isa());
    static const int groups[] = {16, 32, 128};
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < 3; g++)
            if (check(&kernels[i], groups[g])) return 1;
    return 0;
}
