/* The decoder layers of a Llama-family or Gemma-3 model in one call: for each layer, the
 * operations the Python graph runs (lodestar.models.llama.LlamaBlock, gemma3.Gemma3Block), in
 * the same order through the same kernels, so the bits are the per-operation path's. What it
 * saves is the Python and torch dispatch between them. */
#include <stdlib.h>
#include <string.h>

#include "decoder.h"
#include "ops.h"

static int matmul(const int64_t *w, const float *x, int64_t m, float *out) {
    return qmm_run(x, m, w[W_K], out, w[W_N], (const uint8_t *)(uintptr_t)w[W_CODES],
                   (const void *)(uintptr_t)w[W_SCALES], (const void *)(uintptr_t)w[W_MINS], (int)w[W_HALF],
                   (int)w[W_GS], (int)w[W_BITS], (int)w[W_CODE_BITS], (int)w[W_OFFSET]);
}

static const float *fptr(const int64_t *L, int field) { return (const float *)(uintptr_t)L[field]; }

/* Each of t rows' heads (heads of dim floats, rows stride floats apart) normalized in place. */
static void head_norm(float *x, int64_t t, int64_t stride, int64_t heads, int64_t dim, const float *w, float eps) {
    for (int64_t r = 0; r < t; r++) ops_rms_norm(x + r * stride, NULL, NULL, x + r * stride, w, heads, dim, eps);
}

int llama_layers(const llama_step *s) {
    const int64_t t = s->t, d = s->d, nq = s->hq * s->dim, nkv = s->hk * s->dim, wide = nq + 2 * nkv;
    const size_t floats = (size_t)t * (size_t)(d + wide + nq + d + 2 * s->ffn + s->ffn + d);
    float *buf = malloc(floats * sizeof(float));
    int64_t *first = malloc((size_t)(s->n_rows > 0 ? s->n_rows : 1) * sizeof(int64_t));
    if (!buf || !first) {
        free(buf);
        free(first);
        return -1;
    }
    float *xn = buf, *qkv = xn + t * d, *att = qkv + t * wide, *o = att + t * nq, *gu = o + t * d,
          *act = gu + t * 2 * s->ffn, *mlp = act + t * s->ffn;
    float *h = s->h;
    int rc = 0;
    for (int64_t l = 0; l < s->n_layers && rc == 0; l++) {
        const int64_t *L = s->layers + l * LAYER_FIELDS;
        float *k_cache = (float *)(uintptr_t)L[L_K_CACHE], *v_cache = (float *)(uintptr_t)L[L_V_CACHE];
        const int64_t window = L[L_WINDOW];
        ops_rms_norm(h, NULL, NULL, xn, fptr(L, L_ATTN_NORM), t, d, s->eps);
        if (L[L_QKV_PARTS] == 1) {
            rc |= matmul(L + L_QKV, xn, t, qkv);
        } else {                       /* q, k, v of different types: each into its columns */
            const int fields[3] = {L_QKV, L_QKV_K, L_QKV_V};
            int64_t col = 0;
            for (int part = 0; part < 3; part++) {
                const int64_t *w = L + fields[part], n = w[W_N];
                rc |= matmul(w, xn, t, att);
                for (int64_t r = 0; r < t; r++) memcpy(qkv + r * wide + col, att + r * n, (size_t)n * sizeof(float));
                col += n;
            }
        }
        if (L[L_Q_NORM]) {
            head_norm(qkv, t, wide, s->hq, s->dim, fptr(L, L_Q_NORM), s->eps);
            head_norm(qkv + nq, t, wide, s->hk, s->dim, fptr(L, L_K_NORM), s->eps);
        }
        rope_args r = {.q = qkv, .k = qkv + nq, .v = qkv + nq + nkv, .q_stride = wide, .k_stride = wide,
                       .v_stride = wide, .rows = t, .hq = s->hq, .hk = s->hk, .dim = s->dim, .rot = s->rot,
                       .positions = s->positions, .slots = s->slots, .cos = fptr(L, L_COS), .sin = fptr(L, L_SIN),
                       .k_cache = k_cache, .v_cache = v_cache};
        ops_rope_store(&r);
        for (int64_t p = 0; p < s->n_rows; p++)
            first[p] = window > 0 && s->lens[p] > window ? s->lens[p] - window : 0;
        attend_args a = {.q = qkv, .q_stride = wide, .hq = s->hq, .hk = s->hk, .dim = s->dim, .k_cache = k_cache,
                         .v_cache = v_cache, .out = att, .scale = s->scale, .n = s->n_rows, .rows = s->rows,
                         .seqs = s->seqs, .lens = s->lens, .starts = first, .tables = s->tables,
                         .table_width = s->table_width, .block_size = s->block_size};
        rc |= ops_attend(&a);
        rc |= matmul(L + L_O, att, t, o);
        if (L[L_POST_ATTN_NORM]) {     /* Gemma-3: h += post_norm(o), then the MLP's norm */
            ops_rms_norm(o, NULL, NULL, mlp, fptr(L, L_POST_ATTN_NORM), t, d, s->eps);
            for (int64_t i = 0; i < t * d; i++) h[i] = h[i] + mlp[i];
            ops_rms_norm(h, NULL, NULL, xn, fptr(L, L_FFN_NORM), t, d, s->eps);
        } else {                       /* Llama: h += o inside the MLP's norm */
            ops_rms_norm(h, o, h, xn, fptr(L, L_FFN_NORM), t, d, s->eps);
        }
        rc |= matmul(L + L_GATE_UP, xn, t, gu);
        ops_glu(gu, act, t, s->ffn, s->act);
        rc |= matmul(L + L_DOWN, act, t, mlp);
        if (L[L_POST_FFN_NORM]) {
            ops_rms_norm(mlp, NULL, NULL, o, fptr(L, L_POST_FFN_NORM), t, d, s->eps);
            for (int64_t i = 0; i < t * d; i++) h[i] = h[i] + o[i];
        } else {
            for (int64_t i = 0; i < t * d; i++) h[i] = h[i] + mlp[i];
        }
    }
    free(first);
    free(buf);
    return rc ? -1 : 0;
}
