/* Llama-family and Gemma-3 decoder layers in one call (decoder.c). */
#ifndef LODESTAR_DECODER_H
#define LODESTAR_DECODER_H

#include <stdint.h>

/* A packed weight as int64 fields (lodestar.models.cpu_layers builds them); W_HALF: fp16 scales. */
enum { W_CODES, W_SCALES, W_MINS, W_N, W_K, W_GS, W_BITS, W_CODE_BITS, W_OFFSET, W_HALF, WEIGHT_FIELDS };

/* A layer: norm weights, the four projections, the KV caches, and what a Gemma-3 layer adds
 * (0 where absent): q/k norms, the norms after attention and after the MLP, a sliding window,
 * its own rotary tables. */
enum {
    L_ATTN_NORM = 0,
    L_FFN_NORM = 1,
    L_QKV = 2,
    L_O = L_QKV + WEIGHT_FIELDS,
    L_GATE_UP = L_O + WEIGHT_FIELDS,
    L_DOWN = L_GATE_UP + WEIGHT_FIELDS,
    L_K_CACHE = L_DOWN + WEIGHT_FIELDS,
    L_V_CACHE,
    L_Q_NORM,
    L_K_NORM,
    L_POST_ATTN_NORM,
    L_POST_FFN_NORM,
    L_WINDOW,
    L_COS,
    L_SIN,
    L_QKV_PARTS,                /* 1: q|k|v fused in L_QKV; 3: q, k, v in L_QKV, L_QKV_K, L_QKV_V (types differ) */
    L_QKV_K,
    L_QKV_V = L_QKV_K + WEIGHT_FIELDS,
    LAYER_FIELDS = L_QKV_V + WEIGHT_FIELDS
};

typedef struct {
    float *h;                   /* [t][d]: the residual stream, in and out */
    int64_t t, n_layers, d, hq, hk, dim, ffn, rot;
    float eps, scale;
    int act;                    /* GLU_SILU or GLU_GELU_TANH */
    const int64_t *layers;      /* [n_layers][LAYER_FIELDS] */
    const int64_t *positions, *slots;
    int64_t n_rows;
    const int64_t *rows, *seqs, *lens, *tables;   /* the rows that attend: query_rows(None) */
    int64_t table_width, block_size;
} llama_step;

/* 0, or -1 when memory could not be had. */
int llama_layers(const llama_step *s);

/* module.c: out[m, n] = x[m, k] @ W.T through the selected tile kernel. */
int qmm_run(const float *x, int64_t m, int64_t k, float *out, int64_t n, const uint8_t *codes, const void *scales,
            const void *mins, int half, int gs, int bits, int code_bits, int offset);

#endif
