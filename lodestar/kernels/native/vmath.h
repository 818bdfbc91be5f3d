/* exp for the CPU kernels, in plain float arithmetic that compilers vectorize (libm's expf
 * is a scalar call). The same operations in every build, without fused multiply-adds
 * (-ffp-contract=off), so every instruction set gives the same bits.
 *
 * exp(x) = 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, so r is
 * exact to a few ulps), p Cephes' degree-7 polynomial on |r| <= ln 2 / 2: within 2 ulps of
 * exp over the clamped range. Below -87.3 the result is exp(-87.3) (1.2e-38, not 0), above
 * 88.3 exp(88.3); NaN gives exp(-87.3). */
#ifndef LODESTAR_VMATH_H
#define LODESTAR_VMATH_H

#include <stdint.h>
#include <string.h>

static inline float vexp(float x) {
    x = x >= -87.3f ? x : -87.3f;   /* NaN fails the test too */
    x = x <= 88.3f ? x : 88.3f;
    const float magic = 12582912.0f;   /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504088896341f + magic) - magic;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
