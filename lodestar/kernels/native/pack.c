/* GGUF blocks -> the tile layout of qmatmul.h, at load time.
 *
 * Each row is decoded to its codes u, scales and mins exactly as cpu_quant.int_parts forms
 * them (fp16 fields widened exactly, products rounded once in fp32), then scattered into its
 * tile. Tiles are independent, so they are packed in parallel. */
#include <stdlib.h>
#include <string.h>

#include "pack.h"
#include "qmatmul.h"

/* ggml type ids */
enum { GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q6_K = 14 };

static uint16_t raw16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static float f16(const uint8_t *p) { return f16_to_f32(raw16(p)); }

/* The types whose scales (and mins) are fp16 fields, kept fp16 in the tiles. */
int pack_half_scales(int type) { return type != GG_Q4_K && type != GG_Q6_K; }

int pack_block_info(int type, int *block, int *bytes, int *gs, int *has_min) {
    switch (type) {
        case GG_Q4_0: *block = 32, *bytes = 18, *gs = 32, *has_min = 0; return 0;
        case GG_Q4_1: *block = 32, *bytes = 20, *gs = 32, *has_min = 1; return 0;
        case GG_Q5_0: *block = 32, *bytes = 22, *gs = 32, *has_min = 0; return 0;
        case GG_Q5_1: *block = 32, *bytes = 24, *gs = 32, *has_min = 1; return 0;
        case GG_Q8_0: *block = 32, *bytes = 34, *gs = 32, *has_min = 0; return 0;
        case GG_Q4_K: *block = 256, *bytes = 144, *gs = 32, *has_min = 1; return 0;
        case GG_Q6_K: *block = 256, *bytes = 210, *gs = 16, *has_min = 0; return 0;
        default: return -1;
    }
}

static void nibbles32(const uint8_t *qs, uint8_t *u) {
    for (int j = 0; j < 16; j++) u[j] = qs[j] & 0x0F, u[j + 16] = qs[j] >> 4;
}

static void q5_codes(const uint8_t *qh, const uint8_t *qs, uint8_t *u) {
    const uint32_t high = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
    nibbles32(qs, u);
    for (int j = 0; j < 32; j++) u[j] |= (uint8_t)(((high >> j) & 1) << 4);
}

/* One row of k weights: codes u [k], scales [k/gs], mins [k/gs] (when the type has them);
 * for the types with fp16 fields, scales and mins as those fp16 bits (sc16, mn16). */
static void decode_row(int type, const uint8_t *b, int64_t k, uint8_t *u, float *sc, float *mn, uint16_t *sc16,
                       uint16_t *mn16) {
    switch (type) {
        case GG_Q4_0:
            for (int64_t j = 0; j < k / 32; j++, b += 18) sc16[j] = raw16(b), nibbles32(b + 2, u + 32 * j);
            return;
        case GG_Q4_1:
            for (int64_t j = 0; j < k / 32; j++, b += 20)
                sc16[j] = raw16(b), mn16[j] = raw16(b + 2), nibbles32(b + 4, u + 32 * j);
            return;
        case GG_Q5_0:
            for (int64_t j = 0; j < k / 32; j++, b += 22) sc16[j] = raw16(b), q5_codes(b + 2, b + 6, u + 32 * j);
            return;
        case GG_Q5_1:
            for (int64_t j = 0; j < k / 32; j++, b += 24)
                sc16[j] = raw16(b), mn16[j] = raw16(b + 2), q5_codes(b + 4, b + 8, u + 32 * j);
            return;
        case GG_Q8_0:
            for (int64_t j = 0; j < k / 32; j++, b += 34) {
                sc16[j] = raw16(b);
                for (int e = 0; e < 32; e++) u[32 * j + e] = (uint8_t)((int)(int8_t)b[2 + e] + 128);
            }
            return;
        case GG_Q4_K:
            for (int64_t s = 0; s < k / 256; s++, b += 144) {
                const float d = f16(b), dmin = f16(b + 2);
                const uint8_t *q = b + 4, *qs = b + 16;
                for (int j = 0; j < 8; j++) {
                    int scv, mnv;
                    if (j < 4) {
                        scv = q[j] & 0x3F, mnv = q[4 + j] & 0x3F;
                    } else {
                        scv = (q[8 + j - 4] & 0x0F) | ((q[j - 4] >> 2) & 0x30);
                        mnv = (q[8 + j - 4] >> 4) | ((q[4 + j - 4] >> 2) & 0x30);
                    }
                    sc[8 * s + j] = d * (float)scv;
                    mn[8 * s + j] = -(dmin * (float)mnv);
                }
                for (int c = 0; c < 4; c++)    /* 32 bytes: sub-block 2c in the low nibbles, 2c+1 high */
                    for (int l = 0; l < 32; l++) {
                        u[256 * s + 64 * c + l] = qs[32 * c + l] & 0x0F;
                        u[256 * s + 64 * c + 32 + l] = qs[32 * c + l] >> 4;
                    }
            }
            return;
        case GG_Q6_K:
            for (int64_t s = 0; s < k / 256; s++, b += 210) {
                const uint8_t *ql = b, *qh = b + 128;
                const int8_t *scales = (const int8_t *)(b + 192);
                const float d = f16(b + 208);
                for (int j = 0; j < 16; j++) sc[16 * s + j] = d * (float)scales[j];
                for (int h = 0; h < 2; h++)
                    for (int g = 0; g < 4; g++)
                        for (int l = 0; l < 32; l++) {
                            const uint8_t lo = ql[64 * h + 32 * (g & 1) + l];
                            const uint8_t low = g < 2 ? lo & 0x0F : lo >> 4;
                            const uint8_t high = (qh[32 * h + l] >> (2 * g)) & 0x03;
                            u[256 * s + 128 * h + 32 * g + l] = (uint8_t)(low | (high << 4));
                        }
            }
            return;
    }
}

int pack_tiles(int type, const uint8_t *data, int64_t n, int64_t k, uint8_t *codes, void *scales, void *mins) {
    int block, bytes, gs, has_min;
    if (pack_block_info(type, &block, &bytes, &gs, &has_min) || k % block) return -1;
    const int four = type == GG_Q4_0 || type == GG_Q4_1 || type == GG_Q4_K;   /* 4-bit codes, two to a byte */
    const int half = pack_half_scales(type);
    const int64_t g = k / gs, tiles = (n + TILE_ROWS - 1) / TILE_ROWS, row_bytes = k / block * bytes;
    const int64_t blk = four ? TILE_ROWS * gs / 2 : TILE_ROWS * gs;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        uint8_t *u = malloc((size_t)k);
        float *sc = malloc((size_t)g * sizeof(float)), *mn = malloc((size_t)g * sizeof(float));
        uint16_t *sc16 = malloc((size_t)g * sizeof(uint16_t)), *mn16 = malloc((size_t)g * sizeof(uint16_t));
        if (!u || !sc || !mn || !sc16 || !mn16) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (failed) continue;
            uint8_t *tc = codes + t * g * blk;
            const int64_t at = t * g * TILE_ROWS;
            for (int r = 0; r < TILE_ROWS; r++) {
                const int64_t row = t * TILE_ROWS + r;
                if (row < n) {
                    decode_row(type, data + row * row_bytes, k, u, sc, mn, sc16, mn16);
                } else {   /* the last tile's missing rows: zero codes, scales and mins */
                    memset(u, 0, (size_t)k);
                    memset(sc, 0, (size_t)g * sizeof(float)), memset(mn, 0, (size_t)g * sizeof(float));
                    memset(sc16, 0, (size_t)g * sizeof(uint16_t)), memset(mn16, 0, (size_t)g * sizeof(uint16_t));
                }
                for (int64_t j = 0; j < g; j++) {
                    uint8_t *dst = tc + j * blk;
                    const uint8_t *src = u + j * gs;
                    const int64_t i = at + j * TILE_ROWS + r;
                    if (half) {
                        ((uint16_t *)scales)[i] = sc16[j];
                        if (mins) ((uint16_t *)mins)[i] = mn16[j];
                    } else {
                        ((float *)scales)[i] = sc[j];
                        if (mins) ((float *)mins)[i] = mn[j];
                    }
                    if (four)   /* byte (v, r, b): code 8v+b low nibble, code 8v+4+b high */
                        for (int v = 0; v < gs / 8; v++)
                            for (int e = 0; e < 4; e++)
                                dst[(v * TILE_ROWS + r) * 4 + e] = (uint8_t)(src[8 * v + e] | (src[8 * v + 4 + e] << 4));
                    else        /* byte (q, r, b): code 4q+b */
                        for (int q = 0; q < gs / 4; q++) memcpy(dst + (q * TILE_ROWS + r) * 4, src + 4 * q, 4);
                }
            }
        }
        free(u), free(sc), free(mn), free(sc16), free(mn16);
    }
    return failed ? -2 : 0;
}
