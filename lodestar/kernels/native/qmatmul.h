/* Packed integer matrix products for the CPU: shared definitions.
 *
 * A weight matrix W [n, k] is held as unsigned integer codes u with one fp32 scale d (and
 * optionally one fp32 min m) per block of `gs` weights of a row:  w = d * (u - offset) + m.
 * Rows are grouped in tiles of TILE_ROWS; a tile stores, block after block, the codes of its
 * rows so that one 64-byte vector holds 4 consecutive codes of each of the 16 rows (lane r =
 * row r). 8-bit codes: vector q of a block holds codes 4q..4q+3. 4-bit codes: vector v holds
 * codes 8v..8v+3 in its low nibbles and 8v+4..8v+7 in its high nibbles. Scales (and mins)
 * are fp32 [tile][block][16].
 *
 * x [M, k] is quantized per 32 values to integers Q = rint(x * XLEVELS/amax), d_x =
 * amax/XLEVELS, each held as two int8 digits Q = 254*q1 + q2 (q1 in -127..127, q2 in -127..126), so one
 * byte-wide dot product per digit gives sum(u*Q) = 254*sum(u*q1) + sum(u*q2) exactly. Each
 * output is, for blocks j = 0, 1, ... in order and with every product rounded once:
 *     acc = acc + (float)(sum(u*Q) - offset*sum(Q)) * (d_w * d_x)
 *     acc = acc + m_w * (d_x * (float)sum(Q))               (blocks with a min)
 * The integer sums are exact, so every instruction set gives the same bits, whatever M is,
 * and lodestar.kernels.cpu_quant reproduces them with torch operations. */
#ifndef LODESTAR_QMATMUL_H
#define LODESTAR_QMATMUL_H

#include <stdint.h>
#include <string.h>

#define TILE_ROWS 16
#define XBLOCK 32          /* x is quantized per 32 values */
#define XLEVELS 32384.0f   /* so that Q = 254*q1 + q2 with q1 in -127..127, q2 in -127..126 */
#define M_CHUNK 16         /* rows of x one pass over a tile's codes serves */

typedef struct {
    int64_t m, n, k;
    int gs, bits, code_bits, offset, has_min;   /* bits: 4 or 8 per stored code; code_bits: the codes' range */
    int half;               /* scales and mins are fp16 (else fp32) */
    const uint8_t *codes;   /* [tiles][k/gs][TILE_ROWS*gs*bits/8] */
    const void *scales;     /* [tiles][k/gs][TILE_ROWS] */
    const void *mins;       /* same, or NULL */
    const int8_t *q1, *q2;  /* [m][k] each: the digits of Q */
    const float *dx;        /* [m][k/32] */
    const int32_t *xsum;    /* [m][k/16]: sums of Q per 16 values */
    const float *sx;        /* [m][k/32]: d_x * sum of Q per 32 values */
    float *out;             /* [m][n] */
} qmm_args;

/* One tile (16 output rows) for x rows m0..m1 (at most M_CHUNK of them). */
typedef void (*qmm_tile_fn)(const qmm_args *a, int64_t tile, int64_t m0, int64_t m1);

void qmm_tile_generic(const qmm_args *a, int64_t tile, int64_t m0, int64_t m1);
#if defined(__x86_64__) || defined(_M_X64)
void qmm_tile_avx2(const qmm_args *a, int64_t tile, int64_t m0, int64_t m1);
void qmm_tile_avx512vnni(const qmm_args *a, int64_t tile, int64_t m0, int64_t m1);
#endif

/* An fp16 value widened to fp32 (exact). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    uint32_t bits;
    if (e == 0x1F) {
        bits = sign | 0x7F800000u | (m << 13);
    } else if (e) {
        bits = sign | ((e + 112) << 23) | (m << 13);
    } else if (!m) {
        bits = sign;
    } else {   /* subnormal: normalize */
        int shift = 0;
        uint32_t mm = m;
        while (!(mm & 0x400)) mm <<= 1, shift++;
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mm & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Scale (or min) i of a tile's table, fp16 or fp32. */
static inline float qmm_scale(const void *table, int half, int64_t i) {
    return half ? f16_to_f32(((const uint16_t *)table)[i]) : ((const float *)table)[i];
}

/* The exact per-block float update shared by every kernel (no fused multiply-add:
 * the translation units are built with -ffp-contract=off). */
static inline float qmm_step(float acc, int32_t isum, float dw, float dx) {
    float s = dw * dx;
    float t = (float)isum * s;
    return acc + t;
}

#endif
