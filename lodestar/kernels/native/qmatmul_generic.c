/* Portable C tile kernel: the reference every instruction-set kernel must match bit for bit. */
#include <string.h>

#include "qmatmul.h"

static inline int32_t block_xsum(const qmm_args *a, int64_t m, int64_t j) {
    const int32_t *s = a->xsum + m * (a->k / 16);
    return a->gs == 16 ? s[j] : s[2 * j] + s[2 * j + 1];
}

void qmm_tile_generic(const qmm_args *a, int64_t tile, int64_t m0, int64_t m1) {
    const int gs = a->gs;
    const int64_t nb = a->k / gs;
    const int64_t blk_bytes = (int64_t)TILE_ROWS * gs * a->bits / 8;
    const uint8_t *tc = a->codes + tile * nb * blk_bytes;
    const int64_t t0 = tile * nb * TILE_ROWS;   /* this tile's first scale */
    float acc[M_CHUNK][TILE_ROWS];
    memset(acc, 0, sizeof(acc));
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *blk = tc + j * blk_bytes;
        const int64_t xb = j * gs / XBLOCK;
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *x1 = a->q1 + m * a->k + j * gs, *x2 = a->q2 + m * a->k + j * gs;
            int32_t s1[TILE_ROWS] = {0}, s2[TILE_ROWS] = {0};
            if (a->bits == 4) {
                for (int v = 0; v < gs / 8; v++) {
                    const uint8_t *vec = blk + v * 64;
                    for (int r = 0; r < TILE_ROWS; r++)
                        for (int b = 0; b < 4; b++) {
                            const int byte = vec[r * 4 + b], lo = byte & 15, hi = byte >> 4;
                            s1[r] += lo * x1[8 * v + b] + hi * x1[8 * v + 4 + b];
                            s2[r] += lo * x2[8 * v + b] + hi * x2[8 * v + 4 + b];
                        }
                }
            } else {
                for (int q = 0; q < gs / 4; q++) {
                    const uint8_t *vec = blk + q * 64;
                    for (int r = 0; r < TILE_ROWS; r++)
                        for (int b = 0; b < 4; b++) {
                            s1[r] += vec[r * 4 + b] * x1[4 * q + b];
                            s2[r] += vec[r * 4 + b] * x2[4 * q + b];
                        }
                }
            }
            int32_t isum[TILE_ROWS];
            for (int r = 0; r < TILE_ROWS; r++) isum[r] = 254 * s1[r] + s2[r];
            const int32_t corr = a->offset * block_xsum(a, m, j);
            const float dxv = a->dx[m * (a->k / XBLOCK) + xb];
            float *ac = acc[m - m0];
            for (int r = 0; r < TILE_ROWS; r++)
                ac[r] = qmm_step(ac[r], isum[r] - corr, qmm_scale(a->scales, a->half, t0 + j * TILE_ROWS + r), dxv);
            if (a->has_min) {
                const float sxv = a->sx[m * (a->k / XBLOCK) + xb];
                for (int r = 0; r < TILE_ROWS; r++) {
                    const float t = qmm_scale(a->mins, a->half, t0 + j * TILE_ROWS + r) * sxv;
                    ac[r] = ac[r] + t;
                }
            }
        }
    }
    const int64_t row0 = tile * TILE_ROWS;
    const int64_t rows = a->n - row0 < TILE_ROWS ? a->n - row0 : TILE_ROWS;
    for (int64_t m = m0; m < m1; m++)
        memcpy(a->out + m * a->n + row0, acc[m - m0], (size_t)rows * sizeof(float));
}
