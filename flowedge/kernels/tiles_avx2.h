/* The vector helpers the AVX2 tile kernels are written with (tiles_neon.h has the same ones for NEON), so
 * that one kernel template per file serves both: 8 lanes, a tile of 16 outputs in two vectors. Included
 * by tiles.h for an AVX2 + FMA target. */
#ifndef FLOWEDGE_TILES_AVX2_H
#define FLOWEDGE_TILES_AVX2_H

#include <immintrin.h>

#define LANES 8              /* outputs a vector */
#define VECS (TILE / LANES)  /* vectors a tile */

typedef __m256 vf;    /* LANES floats */
typedef __m256i vi;   /* LANES 32-bit integers, or 4 LANES bytes */

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
/* A broadcast load each time it is written: gcc otherwise keeps one input's broadcast for all the tiles
 * of a kernel, 8 more live registers than there are (a 1-row kernel spilled its accumulators). */
static inline vf vf_bcast(const float *p) {
    vf v;
    __asm__ volatile("vbroadcastss %1, %0" : "=x"(v) : "m"(*p));
    return v;
}
static inline vf vf_set1(float f) { return _mm256_set1_ps(f); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }   /* a * b + c, one rounding */
static inline vf vf_of_i32(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* LANES bf16 at p -> fp32 (the W4A16 tiles' scales and zeros) */
static inline vf vf_bf16(const uint8_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Code c (input c of 8, 0..15) of each lane's W4 dword as a float, times 2^W4_SHIFT(c): the dword holds
 * c0 c2 c4 c6 c1 c3 c5 c7 from the low nibble up, and the code is masked in place, not shifted down (one
 * instruction less an input: the 1-row kernel is bound by these). The activation stream carries the
 * 2^-W4_SHIFT(c) instead (pack_floats), so the products are the exact code x activation products. The top
 * nibble, which would convert as a negative int32, is shifted down instead: no factor there. */
#define W4_SHIFT(c) ((c) == 7 ? 0 : ((c) & 1) * 16 + ((c) >> 1) * 4)
static inline __attribute__((always_inline)) vf w4_code(vi d, const int c) {
    if (c == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 28));
    return _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15 << W4_SHIFT(c))));
}

/* The W8 codes of LANES outputs at two inputs: bytes 2i, 2i + 1 at p are output i's codes at inputs
 * 2j, 2j + 1 -> *even, *odd. Each 16-bit pair sign-extends to a lane; shifts split it. */
static inline void w8_pair(const uint8_t *p, vf *even, vf *odd) {
    __m256i v = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)p));
    *even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
    *odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 8));
}

#endif /* FLOWEDGE_TILES_AVX2_H */
