/* int8act.c's AVX2 tiles: its quantization in 8-lane vectors, and the R rows x T tiles kernel, a tile's 16
 * outputs in two vectors of 8 int32 sums. With AVX-VNNI (Alder Lake and later, Gracemont, Zen 4) the dot
 * product is `vpdpbusd` on 256 bits, as the AVX-512 build's; without it (Haswell to Zen 3) two
 * `vpmaddubsw` and a `vpmaddwd`. The sums are exact integers either way, and the float operations are
 * the portable loop's: every build gives the same bits. Included by int8act.c only. */

#if defined(__AVXVNNI__)
#define VNNI_AVX2 1
#else
#define VNNI_AVX2 0
#endif

const char *int8act_isa(void) { return VNNI_AVX2 ? "avx2vnni" : "avx2"; }

/* The portable quantize_group in 2 x 8 lanes: the same IEEE operations (a division, round to nearest even,
 * lane sums in the same order), so the same bits. */
static void quantize_group(const float *xg, int64_t G, int w4, int8_t *dst, int64_t R, float *sa, int32_t *corr,
                           float *xs) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(FLT_MAX);
    __m256 vmax = _mm256_setzero_ps(), lane[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int bad = 0;
    for (int64_t k = 0; k < G; k += 16)
        for (int h = 0; h < 2; h++) {
            __m256 v = _mm256_loadu_ps(xg + k + 8 * h), a = _mm256_and_ps(v, absmask);
            bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_NLE_UQ));   /* inf or NaN */
            vmax = _mm256_max_ps(vmax, a);
            lane[h] = _mm256_add_ps(lane[h], v);
        }
    float m[8], l[16], amax = 0.f, total = 0.f;
    _mm256_storeu_ps(m, vmax);
    _mm256_storeu_ps(l, lane[0]);
    _mm256_storeu_ps(l + 8, lane[1]);
    for (int j = 0; j < 8; j++) amax = m[j] > amax ? m[j] : amax;
    for (int j = 0; j < 16; j++) total += l[j];
    float s = bad ? NAN : amax / QMAX;
    /* W4: per 8 inputs the stream order 0 4 1 5 2 6 3 7 */
    const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-QMAX), hi = _mm256_set1_ps(QMAX);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = 0; k < G; k += 16) {
        __m256i q[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (!bad && s > 0.f)
            for (int h = 0; h < 2; h++) {
                __m256 v = _mm256_div_ps(_mm256_loadu_ps(xg + k + 8 * h), sv);
                v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[h] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
            }
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(q[0], q[1]));
        /* 16 int32 -> 16 int8 in order (packs work per 128-bit half: the permute undoes their interleave) */
        __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
        __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
        int8_t q16[16];
        _mm_storeu_si128((__m128i *)q16, w4 ? _mm_shuffle_epi8(b, order) : b);
        for (int j = 0; j < 4; j++) memcpy(dst + ((k >> 2) + j) * R * 4, q16 + 4 * j, 4);
    }
    int32_t s8[8], qsum = 0;
    _mm256_storeu_si256((__m256i *)s8, sum);
    for (int j = 0; j < 8; j++) qsum += s8[j];
    *sa = s;
    *corr = -(w4 ? 8 : 128) * qsum;
    *xs = total;
}

#if VNNI_AVX2
/* W8 codes + 128 (unsigned for vpdpbusd): sums start at corr = -128 sum q, as the AVX-512 build's */
#define W8_UNSIGNED 1

/* acc += lo . x0 + hi . x1, four u8 x s8 products a lane each (W4: codes 0..15) */
static inline __m256i w4_dot(__m256i acc, __m256i lo, __m256i hi, __m256i x0, __m256i x1) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, x0), hi, x1);
}

/* acc += u . x (u: the W8 codes + 128; au unused) */
static inline __m256i w8_dot(__m256i acc, __m256i u, __m256i au, __m256i x) {
    (void)au;
    return _mm256_dpbusd_avx_epi32(acc, u, x);
}
#else
/* W8 codes stay signed (u8 codes + 128 would overflow vpmaddubsw's 16-bit pair sums): sums start at 0 */
#define W8_UNSIGNED 0

/* The same sums from vpmaddubsw's 16-bit pair sums: codes 0..15 times |q| <= 127, four products
 * <= 7620 fit 16 bits before vpmaddwd widens them. */
static inline __m256i w4_dot(__m256i acc, __m256i lo, __m256i hi, __m256i x0, __m256i x1) {
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* acc += w . x with signed codes w: |w| times x carrying w's sign (two products <= 2 * 128 * 127 fit);
 * au = |w|, taken once a weight vector */
static inline __m256i w8_dot(__m256i acc, __m256i w, __m256i au, __m256i x) {
    __m256i pairs = _mm256_maddubs_epi16(au, _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

/* W8 codes of 4 inputs (blocks a, b: 2 inputs x 16 outputs each, output i at bytes 2i, 2i + 1) ->
 * one dword an output: u[0] holds outputs 0-3 and 8-11, u[1] 4-7 and 12-15 (vpunpck works per 128-bit
 * half); au = |codes| where the dot product wants them. */
static inline void w8_quads(const uint8_t *a, const uint8_t *b, __m256i u[2], __m256i au[2]) {
    __m256i pa = _mm256_loadu_si256((const __m256i *)a), pb = _mm256_loadu_si256((const __m256i *)b);
    u[0] = _mm256_unpacklo_epi16(pa, pb);
    u[1] = _mm256_unpackhi_epi16(pa, pb);
    for (int v = 0; v < 2; v++) {
        au[v] = W8_UNSIGNED ? u[v] : _mm256_abs_epi8(u[v]);
        if (W8_UNSIGNED) u[v] = _mm256_xor_si256(u[v], _mm256_set1_epi8((char)0x80));
    }
}

/* The W8 lane order (outputs 0-3, 8-11 | 4-7, 12-15) to and from the tile's (0-7 | 8-15): the same swap
 * of 128-bit halves both ways. */
static inline void w8_swap(vf *a, vf *b) {
    vf lo = _mm256_permute2f128_ps(*a, *b, 0x20), hi = _mm256_permute2f128_ps(*a, *b, 0x31);
    *a = lo, *b = hi;
}

/* One tile's group done for R rows: its scales (and zeros) at sp, row r's s_a and X_g at sa[r * ng],
 * xs[r * ng]; W8's scales in its lane order */
static inline __attribute__((always_inline)) void
tile_group_end(vf acc[VECS][MAX_R], __m256i gacc[VECS][MAX_R], const uint8_t *sp, const float *sa, const float *xs,
               int64_t ng, const int R, const int w4) {
    vf s[VECS], z[VECS];
    UNROLL
    for (int v = 0; v < VECS; v++) {
        s[v] = w4 ? vf_bf16(sp + 16 * v) : vf_load((const float *)sp + 8 * v);
        z[v] = w4 ? vf_bf16(sp + 32 + 16 * v) : s[v];
    }
    if (!w4) w8_swap(&s[0], &s[1]);
    UNROLL
    for (int v = 0; v < VECS; v++)
        UNROLL
        for (int r = 0; r < R; r++) acc[v][r] = group_end(acc[v][r], gacc[v][r], s[v], z[v], sa[r * ng], xs[r * ng], w4);
}

/* R rows x T tiles, all of K; W4 (w4 = 1) or W8. R, T, w4 are constants after inlining. */
static inline __attribute__((always_inline)) void
tile_kernel(const uint8_t *w, int64_t blk_tile, int64_t ng, int64_t G, const int32_t *xq, const float *sa,
            const int32_t *corr, const float *xs, const float *bias, float *y, int64_t N, int64_t n0, const int R,
            const int T, const int w4) {
    const __m256i nib = _mm256_set1_epi8(0x0f);
    vf acc[MAX_T][VECS][MAX_R];
    ZERO_VECS(acc, R, T);
    const int64_t blk = w4 ? 64 + 8 * G : 64 + 16 * G;
    for (int64_t g = 0; g < ng; g++) {
        __m256i gacc[MAX_T][VECS][MAX_R];
        UNROLL
        for (int r = 0; r < R; r++) {
            __m256i c = w4 || W8_UNSIGNED ? _mm256_set1_epi32(corr[r * ng + g]) : _mm256_setzero_si256();
            UNROLL
            for (int t = 0; t < T; t++)
                UNROLL
                for (int v = 0; v < VECS; v++) gacc[t][v][r] = c;
        }
        const int32_t *xg = xq + g * (G / 4) * R;
        for (int64_t b = 0; b < G / (w4 ? 8 : 4); b++) {   /* 64 bytes of codes a tile */
            if (R == 1) prefetch_tiles(w, blk_tile, g, blk, b * 64, T);
            UNROLL
            for (int t = 0; t < T; t++) {
                const uint8_t *cp = w + t * blk_tile + g * blk + 64 + b * 64;
                if (w4) {
                    const int32_t *xj = xg + 2 * b * R;
                    UNROLL
                    for (int v = 0; v < VECS; v++) {
                        __m256i d = _mm256_loadu_si256((const __m256i *)(cp + 32 * v));
                        __m256i lo = _mm256_and_si256(d, nib), hi = _mm256_and_si256(_mm256_srli_epi32(d, 4), nib);
                        UNROLL
                        for (int r = 0; r < R; r++)
                            gacc[t][v][r] = w4_dot(gacc[t][v][r], lo, hi, _mm256_set1_epi32(xj[r]),
                                                   _mm256_set1_epi32(xj[R + r]));
                    }
                } else {
                    const int32_t *xj = xg + b * R;
                    __m256i u[2], au[2];
                    w8_quads(cp, cp + 32, u, au);
                    UNROLL
                    for (int r = 0; r < R; r++) {
                        __m256i x = _mm256_set1_epi32(xj[r]);
                        UNROLL
                        for (int v = 0; v < VECS; v++) gacc[t][v][r] = w8_dot(gacc[t][v][r], u[v], au[v], x);
                    }
                }
            }
        }
        UNROLL
        for (int t = 0; t < T; t++) tile_group_end(acc[t], gacc[t], w + t * blk_tile + g * blk, sa + g, xs + g, ng, R, w4);
    }
    if (!w4)
        UNROLL
        for (int t = 0; t < T; t++)
            UNROLL
            for (int r = 0; r < R; r++) w8_swap(&acc[t][0][r], &acc[t][1][r]);
    STORE_VECS(acc, bias, y, N, n0, R, T);
}
