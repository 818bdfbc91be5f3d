/* The small per-layer operations of a CPU decode step, each one call instead of several
 * torch operations: RMSNorm (with the residual add), the gated activations, rotary
 * embedding with the KV-cache store, and attention of single query rows over the paged
 * cache. Every row is computed on its own, in a fixed order, so a row's result does not
 * depend on the batch around it. Rotary embedding gives torch's bits (the same products
 * and sums, no fused multiply-add); the norm's mean, the activations' exp/tanh and the
 * attention's sums round differently from torch's kernels, in the last bits. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "vmath.h"

/* Built for several instruction sets, picked at load time (no -march flag needed). Every
 * sum keeps its written order, so each build gives the same bits. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef CLONES
#define CLONES
#endif

CLONES void ops_rms_norm(const float *x, const float *res, float *h, float *out, const float *w, int64_t rows, int64_t dim,
                  float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *hr = h ? h + r * dim : NULL;
        if (res) {
            const float *rr = res + r * dim;
            for (int64_t i = 0; i < dim; i++) hr[i] = xr[i] + rr[i];
            xr = hr;
        }
        double ss = 0.0;
        for (int64_t i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        const float scale = 1.0f / sqrtf((float)(ss / (double)dim) + eps);
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * scale);
    }
}

CLONES void ops_glu(const float *gate_up, float *out, int64_t rows, int64_t ffn, int kind) {
#pragma omp parallel for schedule(static) if (rows * ffn >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * ffn, *u = g + ffn;
        float *o = out + r * ffn;
        if (kind == GLU_SILU) {
            for (int64_t i = 0; i < ffn; i++) o[i] = g[i] / (1.0f + vexp(-g[i])) * u[i];
        } else {   /* gelu, tanh approximation: 0.5 v (1 + tanh(y)) = v / (1 + exp(-2y)) */
            const float c2 = 1.5957691216057308f;   /* 2 sqrt(2/pi) */
            for (int64_t i = 0; i < ffn; i++) {
                const float v = g[i];
                o[i] = v / (1.0f + vexp(-c2 * (v + 0.044715f * (v * v * v)))) * u[i];
            }
        }
    }
}

/* x[i] for i < rot/2: x1*cos - x2*sin; for i in rot/2..rot: x2*cos + x1*sin (torch's
 * (x * cos) + (rotate_half(x) * sin), same products, same sums). */
static inline void rotate(float *x, const float *cs, const float *sn, int64_t rot) {
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        const float a = x1 * cs[i], b = -x2 * sn[i];
        const float c = x2 * cs[i + half], d = x1 * sn[i + half];
        x[i] = a + b;
        x[i + half] = c + d;
    }
}

void ops_rope_store(const rope_args *a) {
    for (int64_t t = 0; t < a->rows; t++) {
        const int64_t pos = a->positions[t];
        const float *cs = a->cos + pos * a->rot, *sn = a->sin + pos * a->rot;
        for (int64_t h = 0; h < a->hq; h++) rotate(a->q + t * a->q_stride + h * a->dim, cs, sn, a->rot);
        float *kc = a->k_cache + a->slots[t] * a->hk * a->dim, *vc = a->v_cache + a->slots[t] * a->hk * a->dim;
        for (int64_t h = 0; h < a->hk; h++) {
            float *k = a->k + t * a->k_stride + h * a->dim;
            rotate(k, cs, sn, a->rot);
            memcpy(kc + h * a->dim, k, (size_t)a->dim * sizeof(float));
            memcpy(vc + h * a->dim, a->v + t * a->v_stride + h * a->dim, (size_t)a->dim * sizeof(float));
        }
    }
}

/* q . k over d values in 8 lanes, then a fixed tree (short heads: less to reduce). */
static inline float dot8(const float *a, const float *b, int64_t n) {
    float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) p[l] += a[i + l] * b[i + l];
    for (; i < n; i++) p[i & 7] += a[i] * b[i];
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

/* q . k over d values in 16 lanes (lane l sums elements l, l+16, ...), then a fixed tree:
 * the same bits whether a build does the lanes as one vector, two or sixteen scalars. */
static inline float dot16(const float *q, const float *k, int64_t d) {
    float p[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        for (int l = 0; l < 16; l++) p[l] += q[i + l] * k[i + l];
    for (; i < d; i++) p[i & 15] += q[i] * k[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) p[l] = p[l] + p[l + w];
    return p[0];
}

/* One query row of one head over context positions j0..lk-1 of a sequence's block table,
 * walked block by block (no division per position): scores (16 lanes for heads of 128 and
 * more, else 8), softmax, then the values summed in position order. */
CLONES static void attend_one(const attend_args *a, int64_t p, int64_t h, float *scores) {
    const int64_t d = a->dim, g = h / (a->hq / a->hk), stride = a->hk * d;
    const int64_t lk = a->lens[p], j0 = a->starts[p], bs = a->block_size, len = lk - j0;
    const int64_t *table = a->tables + a->seqs[p] * a->table_width;
    const float *q = a->q + a->rows[p] * a->q_stride + h * d;
    float *o = a->out + a->rows[p] * a->hq * d + h * d;
    float mx = -INFINITY;
    for (int64_t j = j0; j < lk;) {
        const int64_t blk = j / bs, end = (blk + 1) * bs < lk ? (blk + 1) * bs : lk;
        const float *k = a->k_cache + (table[blk] * bs + (j - blk * bs)) * stride + g * d;
        for (; j < end; j++, k += stride) {
            const float s = (d >= 128 ? dot16(q, k, d) : dot8(q, k, d)) * a->scale;
            scores[j - j0] = s;
            mx = s > mx ? s : mx;
        }
    }
    for (int64_t j = 0; j < len; j++) scores[j] = vexp(scores[j] - mx);
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j8 = 0;
    for (; j8 + 8 <= len; j8 += 8)
        for (int l = 0; l < 8; l++) part[l] += scores[j8 + l];
    for (; j8 < len; j8++) part[j8 & 7] += scores[j8];
    const float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
    for (int64_t j = j0; j < lk;) {
        const int64_t blk = j / bs, end = (blk + 1) * bs < lk ? (blk + 1) * bs : lk;
        const float *v = a->v_cache + (table[blk] * bs + (j - blk * bs)) * stride + g * d;
        for (; j < end; j++, v += stride) {
            const float pj = scores[j - j0];
            for (int64_t i = 0; i < d; i++) o[i] += pj * v[i];
        }
    }
    for (int64_t i = 0; i < d; i++) o[i] = o[i] / sum;
}

int ops_attend(const attend_args *a) {
    int64_t longest = 1;
    for (int64_t p = 0; p < a->n; p++) longest = a->lens[p] > longest ? a->lens[p] : longest;
    const int64_t items = a->n * a->hq;
    int failed = 0;
#pragma omp parallel if (items > 1 && longest * a->dim * items >= 16384)
    {
        float *scores = malloc((size_t)longest * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++)
            if (scores) attend_one(a, it / a->hq, it % a->hq, scores);
        free(scores);
    }
    return failed ? -1 : 0;
}
