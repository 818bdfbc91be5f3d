/* Per-layer CPU operations of a decode step (ops.c). fp32 throughout. */
#ifndef LODESTAR_OPS_H
#define LODESTAR_OPS_H

#include <stdint.h>

#define GLU_SILU 0
#define GLU_GELU_TANH 1

/* out = w * (h * rsqrt(mean(h^2) + eps)) per row, h = x (+ res, then stored to h). */
void ops_rms_norm(const float *x, const float *res, float *h, float *out, const float *w, int64_t rows, int64_t dim,
                  float eps);

/* out[r] = act(gate[r]) * up[r] with gate_up [rows, 2*ffn] (gate first). */
void ops_glu(const float *gate_up, float *out, int64_t rows, int64_t ffn, int kind);

typedef struct {
    float *q, *k;               /* rotated in place: rows of q_stride / k_stride floats, heads of dim */
    const float *v;
    int64_t q_stride, k_stride, v_stride;
    int64_t rows, hq, hk, dim, rot;
    const int64_t *positions;   /* [rows] */
    const int64_t *slots;       /* [rows]: KV cache slot of each row */
    const float *cos, *sin;     /* [positions][rot] */
    float *k_cache, *v_cache;   /* [slots][hk][dim] */
} rope_args;

void ops_rope_store(const rope_args *a);

typedef struct {
    const float *q;             /* rows of q_stride floats, hq heads of dim */
    int64_t q_stride, hq, hk, dim;
    const float *k_cache, *v_cache;
    float *out;                 /* [rows][hq][dim] */
    float scale;
    int64_t n;                  /* query rows to compute */
    const int64_t *rows, *seqs, *lens, *starts;   /* per row: q row, sequence, context length, first visible */
    const int64_t *tables;      /* [sequences][table_width] block ids */
    int64_t table_width, block_size;
} attend_args;

/* 0, or -1 when scratch memory could not be had. */
int ops_attend(const attend_args *a);

#endif
