/* Row-invariant grouped-query attention over a KV cache, float32.
 *
 * Why our own: torch's CPU matmuls pick a different kernel (and so a different summation order) for
 * 1, 2-3 and more query rows, so a token's attention output would depend on how many rows share the
 * forward (1 in `ar`, 16 in a verified segment). Here every (row, head) output is computed by one
 * thread with the same loops whatever the row count: scores = q.k * scale + mask, a max-shifted
 * softmax, then the weighted sum of v. Masked columns (mask <= -1e30) are skipped: their weight is
 * exactly 0 either way.
 *
 * q    [n, hq, d]               query rows, rotary applied
 * k, v [hkv, *, d]              cache buffers, head h at k + h * head_stride, column j at + j * d
 * mask [n, len] additive        0 where allowed
 * out  [n, hq, d]
 *
 * flowedge_rope_attend_f32 is the same attention with the steps before it in one call (what a decode step
 * at one row otherwise spends in a dozen torch ops a layer): RoPE on the new rows' q and k, the new k and v
 * written into the cache, then attention. The RoPE is torch's x * cos + rotate_half(x) * sin with the same
 * roundings (built with -ffp-contract=off: two products, one sum), so its results are bit-identical.
 */
#include <stdlib.h>

#define MASKED (-1e30f)

static float dot(const float *a, const float *b, int d) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= d; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.f;
    for (; i < d; i++) s += a[i] * b[i];
    for (int l = 0; l < 16; l++) s += acc[l];
    return s;
}

/* e^x for x <= 0, within ~2 ulp: 2^n * e^r with |r| <= ln2/2 and a degree-7 Taylor polynomial. Plain
 * float arithmetic, so gcc vectorizes the softmax loop (glibc's vector expf needs -ffast-math, which
 * would switch the whole process to flush-to-zero). */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;
    float t = x * 1.44269504f;
    int n = (int)(t - 0.5f);            /* round half away: t <= 0 */
    float r = x - (float)n * 0.693145752f - (float)n * 1.42860677e-06f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 + r * (1.f / 5040)))))));
    union { int i; float f; } scale = { .i = (n + 127) << 23 };
    return p * scale.f;
}

static void one_row(const float *q, const float *k, const float *v, const float *mask, float *out,
                    int d, int len, float scale, float *scores) {
    float top = -3.0e38f;
    int seen = 0;
    for (int j = 0; j < len; j++) {
        float s = mask[j] <= MASKED ? -3.0e38f : dot(q, k + (long)j * d, d) * scale + mask[j];
        scores[j] = s;
        seen |= mask[j] > MASKED;
        top = s > top ? s : top;
    }
    for (int t = 0; t < d; t++) out[t] = 0.f;
    if (!seen) return;   /* a row that may see nothing: zeros, never NaN */
    float total = 0.f;
    for (int j = 0; j < len; j++) {
        float p = mask[j] <= MASKED ? 0.f : exp_nonpositive(scores[j] - top);
        scores[j] = p;
        total += p;
    }
    for (int j = 0; j < len; j++) {
        float p = scores[j];
        if (p == 0.f) continue;
        const float *vj = v + (long)j * d;
        for (int t = 0; t < d; t++) out[t] += p * vj[t];
    }
    float inv = 1.f / total;
    for (int t = 0; t < d; t++) out[t] *= inv;
}

int flowedge_attend_f32(const float *q, const float *k, const float *v, const float *mask, float *out,
                        int n, int hq, int hkv, int d, int len, long head_stride, float scale, int threads) {
    if (n <= 0 || hq <= 0 || hkv <= 0 || hq % hkv || d <= 0 || len < 0) return -1;
    int group = hq / hkv;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float *scores = malloc(sizeof(float) * (len > 0 ? len : 1));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (long w = 0; w < (long)n * hq; w++) {
                int i = (int)(w / hq), h = (int)(w % hq), g = h / group;
                one_row(q + w * d, k + g * head_stride, v + g * head_stride, mask + (long)i * len,
                        out + w * d, d, len, scale, scores);
            }
            free(scores);
        }
    }
    return failed ? -2 : 0;
}

/* x [d] -> dst: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[d/2:], x[:d/2]) */
static void rope(const float *x, const float *cos, const float *sin, float *dst, int d) {
    int half = d / 2;
    for (int t = 0; t < half; t++) dst[t] = x[t] * cos[t] + (-x[t + half]) * sin[t];
    for (int t = half; t < d; t++) dst[t] = x[t] * cos[t] + x[t - half] * sin[t];
}

/* q, k, v: the new rows (row i of each at + i * its row stride, heads contiguous within a row); cos, sin
 * [n, d]; kbuf, vbuf: the cache buffers, head h at + h * head_stride; the new rows go to columns
 * at .. at + n - 1 and attention reads columns 0 .. at + n - 1; mask [n, at + n]; out [n, hq, d]. */
int flowedge_rope_attend_f32(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                             long v_stride, const float *cos, const float *sin, float *kbuf, float *vbuf,
                             long head_stride, int at, const float *mask, float *out, int n, int hq, int hkv,
                             int d, float scale, int threads) {
    if (n <= 0 || hq <= 0 || hkv <= 0 || hq % hkv || d <= 0 || d % 2 || d > 1024 || at < 0) return -1;
    int len = at + n, group = hq / hkv, failed = 0;
    for (int i = 0; i < n; i++)
        for (int h = 0; h < hkv; h++) {
            long slot = h * head_stride + (long)(at + i) * d;
            rope(k + i * k_stride + h * d, cos + (long)i * d, sin + (long)i * d, kbuf + slot, d);
            for (int t = 0; t < d; t++) vbuf[slot + t] = v[i * v_stride + h * d + t];
        }
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float *scores = malloc(sizeof(float) * len);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        } else {
            float qr[1024];
#pragma omp for schedule(static)
            for (long w = 0; w < (long)n * hq; w++) {
                int i = (int)(w / hq), h = (int)(w % hq), g = h / group;
                rope(q + i * q_stride + h * d, cos + (long)i * d, sin + (long)i * d, qr, d);
                one_row(qr, kbuf + g * head_stride, vbuf + g * head_stride, mask + (long)i * len, out + w * d, d,
                        len, scale, scores);
            }
            free(scores);
        }
    }
    return failed ? -2 : 0;
}
