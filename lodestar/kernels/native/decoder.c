/* The decoder layers of a Llama-family model in one call: for each layer, the operations the
 * Python graph runs (lodestar.models.llama.LlamaBlock), in the same order through the same
 * kernels, so the bits are the per-operation path's. What it saves is the Python and torch
 * dispatch between them. */
#include <stdlib.h>
#include <string.h>

#include "decoder.h"
#include "ops.h"

static int matmul(const int64_t *w, const float *x, int64_t m, float *out) {
    return qmm_run(x, m, w[W_K], out, w[W_N], (const uint8_t *)(uintptr_t)w[W_CODES],
                   (const float *)(uintptr_t)w[W_SCALES], (const float *)(uintptr_t)w[W_MINS], (int)w[W_GS],
                   (int)w[W_BITS], (int)w[W_CODE_BITS], (int)w[W_OFFSET]);
}

int llama_layers(const llama_step *s) {
    const int64_t t = s->t, d = s->d, nq = s->hq * s->dim, nkv = s->hk * s->dim, wide = nq + 2 * nkv;
    const size_t floats = (size_t)t * (size_t)(d + wide + nq + d + 2 * s->ffn + s->ffn + d);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -1;
    float *xn = buf, *qkv = xn + t * d, *att = qkv + t * wide, *o = att + t * nq, *gu = o + t * d,
          *act = gu + t * 2 * s->ffn, *mlp = act + t * s->ffn;
    float *h = s->h;
    int rc = 0;
    for (int64_t l = 0; l < s->n_layers && rc == 0; l++) {
        const int64_t *L = s->layers + l * LAYER_FIELDS;
        float *k_cache = (float *)(uintptr_t)L[L_K_CACHE], *v_cache = (float *)(uintptr_t)L[L_V_CACHE];
        ops_rms_norm(h, NULL, NULL, xn, (const float *)(uintptr_t)L[L_ATTN_NORM], t, d, s->eps);
        rc |= matmul(L + L_QKV, xn, t, qkv);
        rope_args r = {.q = qkv, .k = qkv + nq, .v = qkv + nq + nkv, .q_stride = wide, .k_stride = wide,
                       .v_stride = wide, .rows = t, .hq = s->hq, .hk = s->hk, .dim = s->dim, .rot = s->rot,
                       .positions = s->positions, .slots = s->slots, .cos = s->cos, .sin = s->sin,
                       .k_cache = k_cache, .v_cache = v_cache};
        ops_rope_store(&r);
        attend_args a = {.q = qkv, .q_stride = wide, .hq = s->hq, .hk = s->hk, .dim = s->dim, .k_cache = k_cache,
                         .v_cache = v_cache, .out = att, .scale = s->scale, .n = s->n_rows, .rows = s->rows,
                         .seqs = s->seqs, .lens = s->lens, .starts = s->starts, .tables = s->tables,
                         .table_width = s->table_width, .block_size = s->block_size};
        rc |= ops_attend(&a);
        rc |= matmul(L + L_O, att, t, o);
        ops_rms_norm(h, o, h, xn, (const float *)(uintptr_t)L[L_FFN_NORM], t, d, s->eps);   /* h += o */
        rc |= matmul(L + L_GATE_UP, xn, t, gu);
        ops_glu(gu, act, t, s->ffn, GLU_SILU);
        rc |= matmul(L + L_DOWN, act, t, mlp);
        for (int64_t i = 0; i < t * d; i++) h[i] = h[i] + mlp[i];
    }
    free(buf);
    return rc ? -1 : 0;
}
