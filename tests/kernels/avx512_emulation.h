/* Included first by every emulated build (tests/kernels/avx512_emulation.py): SIMDe's AVX-512, and
 * the few intrinsics the kernels use that SIMDe 0.7 lacks, written plainly. What they compute must
 * equal the instructions'; how fast does not matter. */
#include <stdint.h>
#include <string.h>
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

static inline float simde_mm512_reduce_add_ps(simde__m512 v) {
    simde__m256 a = simde_mm256_add_ps(simde_mm512_castps512_ps256(v),
                                       simde_mm256_castpd_ps(simde_mm512_extractf64x4_pd(simde_mm512_castps_pd(v), 1)));
    simde__m128 s = simde_mm_add_ps(simde_mm256_castps256_ps128(a), simde_mm256_extractf128_ps(a, 1));
    s = simde_mm_add_ps(s, simde_mm_movehl_ps(s, s));
    return simde_mm_cvtss_f32(simde_mm_add_ss(s, simde_mm_movehdup_ps(s)));
}

static inline float simde_mm512_reduce_max_ps(simde__m512 v) {
    float f[16];
    simde_mm512_storeu_ps(f, v);
    float m = f[0];
    for (int i = 1; i < 16; i++) m = f[i] > m ? f[i] : m;
    return m;
}

static inline simde__m512 simde_mm512_cvtph_ps(simde__m256i h) {
    simde__m256 lo = simde_mm256_cvtph_ps(simde_mm256_castsi256_si128(h));
    simde__m256 hi = simde_mm256_cvtph_ps(simde_mm256_extracti128_si256(h, 1));
    return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(lo), hi, 1);
}

static inline simde__m512i simde_mm512_cvtepu16_epi32(simde__m256i h) {
    simde__m256i lo = simde_mm256_cvtepu16_epi32(simde_mm256_castsi256_si128(h));
    simde__m256i hi = simde_mm256_cvtepu16_epi32(simde_mm256_extracti128_si256(h, 1));
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(lo), hi, 1);
}

static inline simde__m512 simde_mm512_cvtepi32_ps(simde__m512i v) {
    int32_t a[16];
    float f[16];
    simde_mm512_storeu_si512(a, v);
    for (int i = 0; i < 16; i++) f[i] = (float)a[i];
    return simde_mm512_loadu_ps(f);
}

/* 16 bytes widened to 16 int32 lanes, as signed or unsigned bytes. */
static inline simde__m512i emulated_widen_bytes(simde__m128i v, int is_signed) {
    uint8_t a[16];
    int32_t r[16];
    simde_mm_storeu_si128(a, v);
    for (int i = 0; i < 16; i++) r[i] = is_signed ? (int32_t)(int8_t)a[i] : (int32_t)a[i];
    return simde_mm512_loadu_si512(r);
}
#define simde_mm512_cvtepi8_epi32(v) emulated_widen_bytes(v, 1)
#define simde_mm512_cvtepu8_epi32(v) emulated_widen_bytes(v, 0)

/* VCVTNE2PS2BF16: round to nearest even, NaN kept a (quiet) NaN. */
static inline uint16_t emulated_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline simde__m512bh simde_mm512_cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
    float fa[16], fb[16];
    uint16_t r[32];
    simde__m512bh out;
    simde_mm512_storeu_ps(fa, a);
    simde_mm512_storeu_ps(fb, b);
    for (int i = 0; i < 16; i++) {
        r[i] = emulated_bf16(fb[i]);
        r[16 + i] = emulated_bf16(fa[i]);
    }
    memcpy(&out, r, sizeof r);
    return out;
}

static inline void simde_mm512_mask_storeu_ps(void *p, simde__mmask16 k, simde__m512 v) {
    float f[16];
    simde_mm512_storeu_ps(f, v);
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) ((float *)p)[i] = f[i];
}

static inline simde__m512 simde_mm512_maskz_loadu_ps(simde__mmask16 k, const void *p) {
    float r[16];
    for (int i = 0; i < 16; i++) r[i] = (k >> i & 1) ? ((const float *)p)[i] : 0.f;
    return simde_mm512_loadu_ps(r);
}

static inline simde__m256i simde_mm256_maskz_loadu_epi16(simde__mmask16 k, const void *p) {
    uint16_t r[16];
    for (int i = 0; i < 16; i++) r[i] = (k >> i & 1) ? ((const uint16_t *)p)[i] : 0;
    return simde_mm256_loadu_si256(r);
}

static inline simde__m512 emulated_permute_ps(simde__m512 v, int imm) {
    float f[16], r[16];
    simde_mm512_storeu_ps(f, v);
    for (int lane = 0; lane < 4; lane++)
        for (int i = 0; i < 4; i++) r[4 * lane + i] = f[4 * lane + ((imm >> (2 * i)) & 3)];
    return simde_mm512_loadu_ps(r);
}
#define simde_mm512_permute_ps(v, imm) emulated_permute_ps(v, imm)
