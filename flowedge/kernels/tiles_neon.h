/* The vector helpers of tiles_avx2.h for aarch64 NEON: 4 lanes, a tile of 16 outputs in four vectors, the
 * same operations (fused multiply-add, exact code conversions), so the kernels written with them run the
 * same arithmetic on both. Included by tiles.h for an aarch64 target. */
#ifndef FLOWEDGE_TILES_NEON_H
#define FLOWEDGE_TILES_NEON_H

#include <arm_neon.h>

#define LANES 4              /* outputs a vector */
#define VECS (TILE / LANES)  /* vectors a tile */

typedef float32x4_t vf;   /* LANES floats */
typedef uint32x4_t vi;    /* LANES 32-bit integers, or 4 LANES bytes */

static inline vf vf_zero(void) { return vdupq_n_f32(0.f); }
static inline vf vf_load(const float *p) { return vld1q_f32(p); }
static inline void vf_store(float *p, vf v) { vst1q_f32(p, v); }
static inline vf vf_bcast(const float *p) { return vld1q_dup_f32(p); }
static inline vf vf_set1(float f) { return vdupq_n_f32(f); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }   /* a * b + c, one rounding */
static inline vf vf_of_i32(vi v) { return vcvtq_f32_s32(vreinterpretq_s32_u32(v)); }
static inline vi vi_load(const void *p) { return vld1q_u32((const uint32_t *)p); }

/* LANES bf16 at p -> fp32 (the W4A16 tiles' scales and zeros) */
static inline vf vf_bf16(const uint8_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p), 16));
}

/* Code c of each lane's W4 dword (c0 c2 c4 c6 c1 c3 c5 c7 from the low nibble up) as a float: masked in
 * place, then a fixed-point conversion with s fraction bits divides the 2^s out (exact: 4 bits). Two
 * instructions, no shift; the immediates need a literal per case. */
#define W4_SHIFT(c) 0   /* the codes convert exactly: the activation stream carries no factor */
#define W4_AT(s) vcvtq_n_f32_u32(vandq_u32(d, vdupq_n_u32(15u << (s))), (s))
static inline __attribute__((always_inline)) vf w4_code(vi d, const int c) {
    switch (c) {
    case 0: return vcvtq_f32_u32(vandq_u32(d, vdupq_n_u32(15u)));
    case 1: return W4_AT(16);
    case 2: return W4_AT(4);
    case 3: return W4_AT(20);
    case 4: return W4_AT(8);
    case 5: return W4_AT(24);
    case 6: return W4_AT(12);
    default: return W4_AT(28);
    }
}
#undef W4_AT

/* The W8 codes of LANES outputs at two inputs (bytes 2i, 2i + 1 at p: output i at inputs 2j, 2j + 1) ->
 * *even, *odd. Each 16-bit pair sign-extends to a lane: shifted to the top, the even code converts with
 * 24 fraction bits; the odd one with its low byte cleared, with 8. */
static inline void w8_pair(const uint8_t *p, vf *even, vf *odd) {
    int32x4_t v = vmovl_s16(vld1_s16((const int16_t *)p));
    *even = vcvtq_n_f32_s32(vshlq_n_s32(v, 24), 24);
    *odd = vcvtq_n_f32_s32(vandq_s32(v, vdupq_n_s32(~0xff)), 8);
}

#endif /* FLOWEDGE_TILES_NEON_H */
