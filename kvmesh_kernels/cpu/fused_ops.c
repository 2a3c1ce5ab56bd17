/*
 * Small fused CPU ops for the model's per-layer glue: each replaces several torch ops (and their
 * dispatch, temporaries and passes over memory) with one call, at the same rounding as the torch
 * code it replaces: every intermediate that torch rounds to bfloat16 or float16 is rounded here too,
 * and float32 products are never contracted into FMAs (this file is built with -ffp-contract=off).
 * dtype: 0 = float32, 1 = bfloat16, 2 = float16 (bfloat16 and float16: "half" below).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* The half types by dtype (1: bfloat16, 2: float16); the loops below test a loop-invariant dtype, which
 * the compiler hoists out of them. */
static inline float half_to_f32(uint16_t h, int dtype) { return dtype == 2 ? f16_to_f32(h) : bf16_to_f32(h); }
static inline uint16_t f32_to_half(float f, int dtype) { return dtype == 2 ? f32_to_f16(f) : f32_to_bf16(f); }
static inline float round_half(float f, int dtype) { return half_to_f32(f32_to_half(f, dtype), dtype); }

/* KV-cache write: row i of k and v goes to slot slots[i] of each cache ([num_slots, row] rows);
 * slot < 0 is padding, skipped. Plain copies: exact in any dtype. */
void kv_write(char *k_cache, char *v_cache, const char *k, const char *v, const int64_t *slots,
              int64_t num_tokens, int64_t row_bytes, int64_t k_stride_bytes, int64_t v_stride_bytes)
{
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, k + i * k_stride_bytes, row_bytes);
        memcpy(v_cache + slot * row_bytes, v + i * v_stride_bytes, row_bytes);
    }
}

/* Neox-style RoPE in place on `num_heads` consecutive heads of each token's row of x (q and k
 * side by side in the qkv projection): (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), with c | s the
 * token's row of cos_sin (head_size values: cos then sin). */
void rope_inplace(void *x, int64_t x_stride, const void *cos_sin, int64_t cs_stride, int64_t num_tokens,
                  int num_heads, int head_size, int dtype, int num_threads)
{
    const int half = head_size / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens >= 64)
    for (int64_t t = 0; t < num_tokens; t++) {
        if (dtype == 0) {
            const float *c = (const float *)cos_sin + t * cs_stride, *s = c + half;
            for (int h = 0; h < num_heads; h++) {
                float *x1 = (float *)x + t * x_stride + (int64_t)h * head_size, *x2 = x1 + half;
                for (int i = 0; i < half; i++) {
                    const float a = x1[i], b = x2[i];
                    const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
                    x1[i] = ac - bs;
                    x2[i] = bc + as;
                }
            }
        } else {
            const uint16_t *c = (const uint16_t *)cos_sin + t * cs_stride, *s = c + half;
            for (int h = 0; h < num_heads; h++) {
                uint16_t *x1 = (uint16_t *)x + t * x_stride + (int64_t)h * head_size, *x2 = x1 + half;
                for (int i = 0; i < half; i++) {
                    const float a = half_to_f32(x1[i], dtype), b = half_to_f32(x2[i], dtype);
                    const float ci = half_to_f32(c[i], dtype), si = half_to_f32(s[i], dtype);
                    x1[i] = f32_to_half(round_half(a * ci, dtype) - round_half(b * si, dtype), dtype);
                    x2[i] = f32_to_half(round_half(b * ci, dtype) + round_half(a * si, dtype), dtype);
                }
            }
        }
    }
}

/* float32 RMSNorm of one row as transformers computes it: x * (1 / sqrt(mean(x^2) + eps)), then
 * weight * that (two roundings, no FMA: this file is built with -ffp-contract=off). Only the sum's
 * order differs. */
static inline void rms_norm_row_f32(float *dst, const float *row, const float *weight, int hidden, float eps) {
    float sum = 0.f;
    for (int i = 0; i < hidden; i++) sum += row[i] * row[i];
    const float inv = 1.f / sqrtf(sum / hidden + eps);
    for (int i = 0; i < hidden; i++) dst[i] = weight[i] * (row[i] * inv);
}

/* bfloat16 or float16 RMSNorm of one row as the model's reference computes it: normalise in float32,
 * round to the half type, then scale by the weight of that type (rounded again). */
static inline void rms_norm_row_half(uint16_t *dst, const uint16_t *row, const uint16_t *weight, int hidden,
                                     float eps, int dtype) {
    float sum = 0.f;
    for (int i = 0; i < hidden; i++) {
        const float v = half_to_f32(row[i], dtype);
        sum += v * v;
    }
    const float inv = 1.f / sqrtf(sum / hidden + eps);
    for (int i = 0; i < hidden; i++)
        dst[i] = f32_to_half(half_to_f32(weight[i], dtype) * round_half(half_to_f32(row[i], dtype) * inv, dtype),
                             dtype);
}

/* RMSNorm of each of num_tokens rows of x ([num_tokens, hidden], contiguous). */
void rms_norm(void *out, const void *x, const void *weight, int64_t num_tokens, int hidden, float eps, int dtype,
              int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens >= 64)
    for (int64_t t = 0; t < num_tokens; t++) {
        if (dtype == 0)
            rms_norm_row_f32((float *)out + t * hidden, (const float *)x + t * hidden, weight, hidden, eps);
        else
            rms_norm_row_half((uint16_t *)out + t * hidden, (const uint16_t *)x + t * hidden, weight, hidden, eps,
                              dtype);
    }
}

/* The decoder layer's residual add and the next RMSNorm in one pass: residual_out = x + residual
 * (rounded to the dtype, as torch's add), out = RMSNorm(residual_out). */
void add_rms_norm(void *out, void *residual_out, const void *x, const void *residual, const void *weight,
                  int64_t num_tokens, int hidden, float eps, int dtype, int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens >= 64)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t o = t * hidden;
        if (dtype == 0) {
            float *r = (float *)residual_out + o;
            const float *a = (const float *)x + o, *b = (const float *)residual + o;
            for (int i = 0; i < hidden; i++) r[i] = a[i] + b[i];
            rms_norm_row_f32((float *)out + o, r, weight, hidden, eps);
        } else {
            uint16_t *r = (uint16_t *)residual_out + o;
            const uint16_t *a = (const uint16_t *)x + o, *b = (const uint16_t *)residual + o;
            for (int i = 0; i < hidden; i++)
                r[i] = f32_to_half(half_to_f32(a[i], dtype) + half_to_f32(b[i], dtype), dtype);
            rms_norm_row_half((uint16_t *)out + o, r, weight, hidden, eps, dtype);
        }
    }
}

/* e^x for float32 without a libm call, so that the loop below vectorizes (glibc's vector expf is only
 * declared under -ffast-math): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p Cephes' degree-6
 * polynomial (~1 ulp); 0 below -87.3 and +inf above 88.7, as expf. */
static inline float exp_f32(float x) {
    const float xc = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = rintf(xc * 1.44269504088896341f);
    const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    const float e = p * scale.f;
    return x < -87.3f ? 0.f : (x > 88.7f ? __builtin_inff() : e);
}

/* The MLP's activation over its fused gate|up projection: out[t][i] = silu(x[t][i]) * x[t][inter + i],
 * silu(g) = g / (1 + e^-g). float32, rows `inter` apart in out and 2 * inter in x. */
void silu_and_mul(float *out, const float *x, int64_t num_tokens, int64_t inter, int num_threads)
{
    /* a parallel region costs more than ~1 M exps save on a loaded machine */
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * inter >= (1 << 20))
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *g = x + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.f + exp_f32(-g[i])) * u[i];
    }
}

/* Gemma's MLP activation over its fused gate|up projection: out[t][i] = gelu_tanh(g) * u, with g, u =
 * x[t][i], x[t][inter + i] and gelu_tanh(g) = g / 2 (1 + tanh(z / 2)), z = 2 sqrt(2 / pi) (g + 0.044715 g^3),
 * computed as g / (1 + e^-z): the same function without 1 + tanh's cancellation for negative g (there
 * it is closer to the exact value than torch's). float32, rows `inter` apart in out and 2 * inter in x. */
void gelu_tanh_and_mul(float *out, const float *x, int64_t num_tokens, int64_t inter, int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * inter >= (1 << 20))
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *g = x + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float z = g[i] * (1.59576912160573f + 0.0713548162726f * (g[i] * g[i]));
            o[i] = g[i] / (1.f + exp_f32(-z)) * u[i];
        }
    }
}
