/* int8act.c's NEON tiles (aarch64 with dotprod, i8mm where there is one): R rows x T tiles, a tile's 16
 * outputs in four vectors of 4 int32 sums. The signed dot products take W4's codes as they are (0..15,
 * its sums start at corr = -8 sum q, as the x86 builds') and W8's signed codes (sums from 0): the same
 * integers S as every build, and group_end's float epilogue, so the same bits. The quantization is the
 * portable one. Included by int8act.c only.
 *
 * Dot products per 8 inputs of a tile: `sdot` takes 4 outputs x 4 inputs of one row (the row's dword
 * broadcast), 16 products; with i8mm `smmla` takes 2 rows x 2 outputs x 8 inputs, 32 products, for each
 * pair of rows of a pass (a pass's odd row still takes sdot). */

#if defined(__ARM_FEATURE_MATMUL_INT8)
#define NEON_I8MM 1
#else
#define NEON_I8MM 0
#endif

const char *int8act_isa(void) { return NEON_I8MM ? "neon-i8mm" : "neon-dotprod"; }

/* The codes of a tile's 8 inputs as two halves of 4 (what two sdot take): per vector v (outputs 4v..4v+3)
 * one dword an output. W4 (64 bytes at p, a dword an output): the low nibbles (inputs 0 4 1 5 in the
 * stream's order) and the high ones (2 6 3 7), 0..15. W8 (128 bytes: 4 blocks of 2 inputs x 16 outputs):
 * each output's 16-bit pairs of two blocks zipped into its 4 inputs. */
static inline __attribute__((always_inline)) void
step_codes(const uint8_t *p, const int w4, int8x16_t first[VECS], int8x16_t second[VECS]) {
    if (w4) {
        for (int v = 0; v < VECS; v++) {
            uint8x16_t d = vld1q_u8(p + 16 * v);
            first[v] = vreinterpretq_s8_u8(vandq_u8(d, vdupq_n_u8(15)));
            second[v] = vreinterpretq_s8_u8(vshrq_n_u8(d, 4));
        }
        return;
    }
    for (int half = 0; half < 2; half++) {   /* inputs 0-3 (blocks 0, 1), then 4-7 (blocks 2, 3) */
        const uint8_t *b = p + 64 * half;
        int8x16_t *out = half ? second : first;
        for (int o = 0; o < 2; o++) {   /* outputs 0-7, then 8-15 */
            int16x8_t a = vreinterpretq_s16_u8(vld1q_u8(b + 16 * o)), c = vreinterpretq_s16_u8(vld1q_u8(b + 32 + 16 * o));
            out[2 * o] = vreinterpretq_s8_s16(vzip1q_s16(a, c));
            out[2 * o + 1] = vreinterpretq_s8_s16(vzip2q_s16(a, c));
        }
    }
}

/* acc += first . x0 + second . x1 for one row (x0, x1: its two dwords of the step, broadcast) */
static inline int32x4_t row_dot(int32x4_t acc, int8x16_t first, int8x16_t second, const int32_t *x0,
                                const int32_t *x1) {
    acc = vdotq_s32(acc, first, vreinterpretq_s8_s32(vld1q_dup_s32(x0)));
    return vdotq_s32(acc, second, vreinterpretq_s8_s32(vld1q_dup_s32(x1)));
}

#if NEON_I8MM
/* Rows r, r + 1 of the step as smmla's left 2 x 8: [row r's dwords x0, x1 | row r + 1's] (each pointer at
 * row r's dword, row r + 1's next to it) */
static inline int8x16_t row_pair(const int32_t *x0, const int32_t *x1) {
    int32x2_t a = vld1_s32(x0), c = vld1_s32(x1);
    return vreinterpretq_s8_s32(vcombine_s32(vzip1_s32(a, c), vzip2_s32(a, c)));
}

/* acc[q] (outputs 2q, 2q + 1 of rows r, r + 1 as [r:2q, r:2q+1, r1:2q, r1:2q+1]) += the step's products */
static inline __attribute__((always_inline)) void
pair_dots(int32x4_t acc[2 * VECS], const int8x16_t first[VECS], const int8x16_t second[VECS], int8x16_t rows) {
    for (int v = 0; v < VECS; v++) {
        int32x4_t f = vreinterpretq_s32_s8(first[v]), s = vreinterpretq_s32_s8(second[v]);
        acc[2 * v] = vmmlaq_s32(acc[2 * v], rows, vreinterpretq_s8_s32(vzip1q_s32(f, s)));
        acc[2 * v + 1] = vmmlaq_s32(acc[2 * v + 1], rows, vreinterpretq_s8_s32(vzip2q_s32(f, s)));
    }
}

#define PAIRS(R) ((R) / 2)   /* rows a kernel runs in smmla pairs */
#else
#define PAIRS(R) 0
#endif

/* The pair accumulators -> one vector a row for outputs 4v..4v+3 (row r: upper = 0; row r + 1: 1) */
static inline int32x4_t pair_row(const int32x4_t acc[2 * VECS], int v, int upper) {
    int64x2_t a = vreinterpretq_s64_s32(acc[2 * v]), b = vreinterpretq_s64_s32(acc[2 * v + 1]);
    return vreinterpretq_s32_s64(upper ? vzip2q_s64(a, b) : vzip1q_s64(a, b));
}

/* One tile's sums at a group's start, row r's at corr[r * ng] for W4 (its codes are 0..15: -8 sum q), at 0
 * for W8 (signed codes): sacc[v][r] for the single rows, pacc[p][q] = [r, r, r + 1, r + 1] for the pairs */
static inline __attribute__((always_inline)) void
group_start(int32x4_t sacc[VECS][MAX_R], int32x4_t pacc[MAX_R / 2][2 * VECS], const int32_t *corr, int64_t ng,
            const int R, const int w4) {
    UNROLL
    for (int p = 0; p < PAIRS(R); p++)
        UNROLL
        for (int q = 0; q < 2 * VECS; q++)
            pacc[p][q] = w4 ? vcombine_s32(vdup_n_s32(corr[2 * p * ng]), vdup_n_s32(corr[(2 * p + 1) * ng]))
                            : vdupq_n_s32(0);
    UNROLL
    for (int v = 0; v < VECS; v++)
        UNROLL
        for (int r = 2 * PAIRS(R); r < R; r++) sacc[v][r] = vdupq_n_s32(w4 ? corr[r * ng] : 0);
}

/* One tile's group done for R rows: its scales (and zeros) at sp, row r's s_a and X_g at sa[r * ng],
 * xs[r * ng], its sums from the pair or the single-row accumulators */
static inline __attribute__((always_inline)) void
tile_group_end(vf acc[VECS][MAX_R], int32x4_t sacc[VECS][MAX_R], int32x4_t pacc[MAX_R / 2][2 * VECS],
               const uint8_t *sp, const float *sa, const float *xs, int64_t ng, const int R, const int w4) {
    UNROLL
    for (int v = 0; v < VECS; v++) {
        vf s = w4 ? vf_bf16(sp + 8 * v) : vf_load((const float *)sp + 4 * v);
        vf z = w4 ? vf_bf16(sp + 32 + 8 * v) : s;
        UNROLL
        for (int r = 0; r < R; r++) {
            int32x4_t sum = r < 2 * PAIRS(R) ? pair_row(pacc[r / 2], v, r & 1) : sacc[v][r];
            acc[v][r] = group_end(acc[v][r], vreinterpretq_u32_s32(sum), s, z, sa[r * ng], xs[r * ng], w4);
        }
    }
}

/* R rows x T tiles, all of K; W4 (w4 = 1) or W8. R, T, w4 are constants after inlining. */
static inline __attribute__((always_inline)) void
tile_kernel(const uint8_t *w, int64_t blk_tile, int64_t ng, int64_t G, const int32_t *xq, const float *sa,
            const int32_t *corr, const float *xs, const float *bias, float *y, int64_t N, int64_t n0, const int R,
            const int T, const int w4) {
    vf acc[MAX_T][VECS][MAX_R];
    ZERO_VECS(acc, R, T);
    const int64_t blk = w4 ? 64 + 8 * G : 64 + 16 * G, step = w4 ? 64 : 128;   /* bytes of 8 inputs */
    for (int64_t g = 0; g < ng; g++) {
        int32x4_t sacc[MAX_T][VECS][MAX_R], pacc[MAX_T][MAX_R / 2][2 * VECS];
        UNROLL
        for (int t = 0; t < T; t++) group_start(sacc[t], pacc[t], corr + g, ng, R, w4);
        const int32_t *xg = xq + g * (G / 4) * R;
        for (int64_t b = 0; b < G / 8; b++) {
            if (R == 1) {
                prefetch_tiles(w, blk_tile, g, blk, b * step, T);
                if (!w4) prefetch_tiles(w, blk_tile, g, blk, b * step + 64, T);
            }
            const int32_t *x0 = xg + 2 * b * R, *x1 = x0 + R;   /* the step's dwords of row r: x0[r], x1[r] */
            UNROLL
            for (int t = 0; t < T; t++) {
                int8x16_t first[VECS], second[VECS];
                step_codes(w + t * blk_tile + g * blk + 64 + b * step, w4, first, second);
#if NEON_I8MM
                UNROLL
                for (int p = 0; p < PAIRS(R); p++) pair_dots(pacc[t][p], first, second, row_pair(x0 + 2 * p, x1 + 2 * p));
#endif
                UNROLL
                for (int r = 2 * PAIRS(R); r < R; r++)
                    UNROLL
                    for (int v = 0; v < VECS; v++) sacc[t][v][r] = row_dot(sacc[t][v][r], first[v], second[v], x0 + r, x1 + r);
            }
        }
        UNROLL
        for (int t = 0; t < T; t++)
            tile_group_end(acc[t], sacc[t], pacc[t], w + t * blk_tile + g * blk, sa + g, xs + g, ng, R, w4);
    }
    STORE_VECS(acc, bias, y, N, n0, R, T);
}
