/* x86 tile kernels, each compiled for its instruction set with a target attribute (the
 * module picks one at run time), so the build needs no -march flag. They must give the
 * bits of qmm_tile_generic. */
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#include "qmatmul.h"

static inline int32_t block_xsum(const qmm_args *a, int64_t m, int64_t j) {
    const int32_t *s = a->xsum + m * (a->k / 16);
    return a->gs == 16 ? s[j] : s[2 * j] + s[2 * j + 1];
}

static inline int32_t x4_at(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* -- AVX-512 with VNNI: one vpdpbusd per 4 codes of 16 rows ------------------------------- */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* 16 scales (or mins) from i on, fp16 widened exactly or fp32. */
AVX512_TARGET
static inline __m512 scales16(const void *table, int half, int64_t i) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)table + i)));
    return _mm512_loadu_ps((const float *)table + i);
}

AVX512_TARGET
void qmm_tile_avx512vnni(const qmm_args *a, int64_t tile, int64_t m0, int64_t m1) {
    const int gs = a->gs, nvec = gs / 4;
    const int64_t nb = a->k / gs;
    const int64_t blk_bytes = (int64_t)TILE_ROWS * gs * a->bits / 8;
    const uint8_t *tc = a->codes + tile * nb * blk_bytes;
    const int64_t t0 = tile * nb * TILE_ROWS;   /* this tile's first scale */
    const int tm = a->has_min;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[M_CHUNK];
    for (int i = 0; i < M_CHUNK; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *blk = tc + j * blk_bytes;
        const int64_t xb = j * gs / XBLOCK;
        __m512i c[8];
        if (a->bits == 4) {
            for (int v = 0; v < gs / 8; v++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(blk + v * 64));
                c[2 * v] = _mm512_and_si512(raw, low);
                c[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
        } else {
            for (int q = 0; q < nvec; q++) c[q] = _mm512_loadu_si512((const void *)(blk + q * 64));
        }
        const __m512 dw = scales16(a->scales, a->half, t0 + j * TILE_ROWS);
        const __m512 mw = tm ? scales16(a->mins, a->half, t0 + j * TILE_ROWS) : _mm512_setzero_ps();
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *x1 = a->q1 + m * a->k + j * gs, *x2 = a->q2 + m * a->k + j * gs;
            __m512i s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
            for (int q = 0; q < nvec; q++) {
                s1 = _mm512_dpbusd_epi32(s1, c[q], _mm512_set1_epi32(x4_at(x1 + 4 * q)));
                s2 = _mm512_dpbusd_epi32(s2, c[q], _mm512_set1_epi32(x4_at(x2 + 4 * q)));
            }
            __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(s1, _mm512_set1_epi32(254)), s2);
            s = _mm512_sub_epi32(s, _mm512_set1_epi32(a->offset * block_xsum(a, m, j)));
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->dx[m * (a->k / XBLOCK) + xb]));
            __m512 *ac = &acc[m - m0];
            *ac = _mm512_add_ps(*ac, _mm512_mul_ps(_mm512_cvtepi32_ps(s), scale));
            if (tm) *ac = _mm512_add_ps(*ac, _mm512_mul_ps(mw, _mm512_set1_ps(a->sx[m * (a->k / XBLOCK) + xb])));
        }
    }
    const int64_t row0 = tile * TILE_ROWS;
    const int64_t rows = a->n - row0 < TILE_ROWS ? a->n - row0 : TILE_ROWS;
    const __mmask16 keep = (__mmask16)((1u << rows) - 1u);
    for (int64_t m = m0; m < m1; m++)
        _mm512_mask_storeu_ps(a->out + m * a->n + row0, keep, acc[m - m0]);
}

/* -- AVX2: vpmaddubsw + vpmaddwd, two 8-row halves ---------------------------------------- */
#define AVX2_TARGET __attribute__((target("avx2,f16c")))

AVX2_TARGET
static inline __m256i dot4(__m256i codes, __m256i x, __m256i ones, int wide) {
    if (!wide)   /* codes < 64: u*x pairs fit int16 */
        return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(codes, low), x), ones);
    const __m256i hi = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(codes, 4), low), x), ones);
    return _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4));
}

/* 8 scales (or mins) from i on, fp16 widened exactly or fp32. */
AVX2_TARGET
static inline __m256 scales8(const void *table, int half, int64_t i) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)table + i)));
    return _mm256_loadu_ps((const float *)table + i);
}

AVX2_TARGET
void qmm_tile_avx2(const qmm_args *a, int64_t tile, int64_t m0, int64_t m1) {
    const int gs = a->gs, nvec = gs / 4, wide = a->code_bits > 6;
    const int64_t nb = a->k / gs;
    const int64_t blk_bytes = (int64_t)TILE_ROWS * gs * a->bits / 8;
    const uint8_t *tc = a->codes + tile * nb * blk_bytes;
    const int64_t t0 = tile * nb * TILE_ROWS;   /* this tile's first scale */
    const int tm = a->has_min;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[M_CHUNK][2];
    for (int i = 0; i < M_CHUNK; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *blk = tc + j * blk_bytes;
        const int64_t xb = j * gs / XBLOCK;
        __m256i c[8][2];
        for (int h = 0; h < 2; h++) {
            if (a->bits == 4) {
                for (int v = 0; v < gs / 8; v++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + v * 64 + h * 32));
                    c[2 * v][h] = _mm256_and_si256(raw, low);
                    c[2 * v + 1][h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                }
            } else {
                for (int q = 0; q < nvec; q++)
                    c[q][h] = _mm256_loadu_si256((const __m256i *)(blk + q * 64 + h * 32));
            }
        }
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *x1 = a->q1 + m * a->k + j * gs, *x2 = a->q2 + m * a->k + j * gs;
            __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();   /* digit q1, halves 0 and 1 */
            __m256i b0 = _mm256_setzero_si256(), b1 = _mm256_setzero_si256();   /* digit q2 */
            for (int q = 0; q < nvec; q++) {
                const __m256i xa = _mm256_set1_epi32(x4_at(x1 + 4 * q)), xb2 = _mm256_set1_epi32(x4_at(x2 + 4 * q));
                a0 = _mm256_add_epi32(a0, dot4(c[q][0], xa, ones, wide));
                a1 = _mm256_add_epi32(a1, dot4(c[q][1], xa, ones, wide));
                b0 = _mm256_add_epi32(b0, dot4(c[q][0], xb2, ones, wide));
                b1 = _mm256_add_epi32(b1, dot4(c[q][1], xb2, ones, wide));
            }
            const __m256i k254 = _mm256_set1_epi32(254);
            const __m256i s0 = _mm256_add_epi32(_mm256_mullo_epi32(a0, k254), b0);
            const __m256i s1 = _mm256_add_epi32(_mm256_mullo_epi32(a1, k254), b1);
            const __m256i corr = _mm256_set1_epi32(a->offset * block_xsum(a, m, j));
            const __m256 dxv = _mm256_set1_ps(a->dx[m * (a->k / XBLOCK) + xb]);
            const __m256 sxv = _mm256_set1_ps(tm ? a->sx[m * (a->k / XBLOCK) + xb] : 0.0f);
            __m256i s[2] = {_mm256_sub_epi32(s0, corr), _mm256_sub_epi32(s1, corr)};
            for (int h = 0; h < 2; h++) {
                const __m256 scale = _mm256_mul_ps(scales8(a->scales, a->half, t0 + j * TILE_ROWS + 8 * h), dxv);
                __m256 *ac = &acc[m - m0][h];
                *ac = _mm256_add_ps(*ac, _mm256_mul_ps(_mm256_cvtepi32_ps(s[h]), scale));
                if (tm) *ac = _mm256_add_ps(*ac, _mm256_mul_ps(scales8(a->mins, a->half, t0 + j * TILE_ROWS + 8 * h), sxv));
            }
        }
    }
    const int64_t row0 = tile * TILE_ROWS;
    const int64_t rows = a->n - row0 < TILE_ROWS ? a->n - row0 : TILE_ROWS;
    for (int64_t m = m0; m < m1; m++) {
        float buf[TILE_ROWS];
        _mm256_storeu_ps(buf, acc[m - m0][0]);
        _mm256_storeu_ps(buf + 8, acc[m - m0][1]);
        memcpy(a->out + m * a->n + row0, buf, (size_t)rows * sizeof(float));
    }
}
#endif
