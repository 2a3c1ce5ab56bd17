/*
 * float16 <-> float32 for the CPU kernels: F16C's one-instruction conversions where the build has them
 * (-mf16c, -march=native on any AVX2 CPU), else portable C that gives the same bits. float32 -> float16
 * rounds to nearest even, as torch's `.half()` does: overflow to +-inf, float16 subnormals kept, NaN
 * stays NaN. Included by the kernels' .c files (kvmesh_kernels/native.py keys their builds by it too).
 */
#ifndef KVMESH_HALF_H
#define KVMESH_HALF_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else {
        float f = (float)mant * 5.9604644775390625e-08f; /* subnormal: mant * 2^-24, exact */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00 | (uint16_t)((u >> 13) & 0x3ff); /* NaN, quiet */
    if (u >= 0x477ff000u) return sign | 0x7c00; /* 65520 and up round to infinity */
    if (u >= 0x38800000u) { /* a normal float16: rebias the exponent (127 - 15), round 13 bits away */
        u -= 0x38000000u;
        u += 0xfffu + ((u >> 13) & 1);
        return sign | (uint16_t)(u >> 13);
    }
    if (u < 0x33000000u) return sign; /* at most 2^-25: rounds to zero */
    /* A subnormal float16, m * 2^-24: the 24-bit significand shifted right, rounded to nearest even
     * (a carry into 0x400 is the smallest normal, as it should be). */
    const uint32_t mant = (u & 0x7fffffu) | 0x800000u;
    const int shift = 126 - (int)(u >> 23);
    uint32_t h = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    h += rest > half || (rest == half && (h & 1));
    return sign | (uint16_t)h;
#endif
}

#endif
