/*
 * y = x @ W^T with W kept in a GGUF file's blocks, x and y float32 (kvmesh_kernels/cpu_quant_matmul.py).
 *
 * Row n of W is K / 32 blocks of one type (ggml's layouts; values are exact in float32):
 *
 *   Q4_1 (type 3, 20 bytes)  f16 d | f16 m | 16 bytes qs    w[j] = d * q[j] + m, q[j] in 0..15:
 *                            q[j] = qs[j] & 15 for j < 16, qs[j - 16] >> 4 for j >= 16
 *   Q8_0 (type 8, 34 bytes)  f16 d | 32 int8 qs             w[j] = d * qs[j]
 *   F16  (type 1, 64 bytes)  32 f16                          w[j] = (float) h[j]
 *   BF16 (type 30, 64 bytes) 32 bf16                         w[j] = (float) h[j]
 *
 * The K-quants hold 256 weights a super-block, eight sub-blocks of 32 ("K-quants" below): a row's
 * K is then a multiple of 256, and its 32-weight block b is sub-block b % 8 of super-block b / 8.
 *
 * d * q is exact in float32 (an 11-bit mantissa times at most 8 bits), so d * q + m rounds once,
 * whether by an FMA or by a multiply and an add: the weights used are bit for bit those of gguf's
 * `dequantize` (what transformers converts a GGUF with). Only the order of the sum over K differs
 * from a float32 matmul over the dequantized weights; the activations are never quantized.
 *
 * The work is cut into panels of NR output rows: a thread dequantizes a panel's rows into a small
 * float32 buffer (L1/L2), then runs one MR x NR tile of dot products per MR rows of x over it. So
 * each weight is read from memory and dequantized once per call, whatever M, and each x chunk
 * loaded serves NR rows; a thread prefetches the panel PF_PANELS ahead of the one it multiplies
 * (a call streams its weights from memory). The vector path is chosen when the file is compiled
 * (AVX-512F, or AVX2 + FMA + F16C; else portable C): `quant_matmul_isa` says which.
 *
 * The layers' Q4_1 weights take another layout and path ("packed Q4_1" below): the tiles here serve
 * the LM head / embedding (Q8_0, looked up by row too) and the other block types.
 *
 * BF16 weights (`--dtype auto`'s copy of a layer's weights for its larger steps) are the exception to
 * "activations never quantized": on a CPU with AVX512_BF16, x is rounded to bfloat16 too and the
 * tiles take vdpbf16ps, two multiply-adds a lane per instruction (twice the float32 FMA's), with no
 * dequantization at all; elsewhere the weights are widened to float32 like the other types. The
 * other exceptions are Q4_1_I8 and Q8_0_I8 (`--dtype auto`'s copies where there are no bfloat16 dot
 * products): a layer's Q4_1 or the LM head's Q8_0 weights in groups of 8 rows against x quantized to
 * int8 ("int8 activations" below).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "half.h"

/* A read-ahead hint (no fault, whatever the address). */
#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)

enum { TYPE_F16 = 1, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14, TYPE_BF16 = 30,
       TYPE_Q4_1_I8 = 1003, TYPE_Q8_0_I8 = 1004, TYPE_Q6_K_I8 = 1005 /* not GGML's: below */ };
#define IS_I8(type) ((type) == TYPE_Q4_1_I8 || (type) == TYPE_Q8_0_I8 || (type) == TYPE_Q6_K_I8)
#define QK 32 /* weights per block (a K-quant's sub-block) */
#define QK_K 256 /* weights per K-quant super-block */
#define IS_K(type) ((type) == TYPE_Q4_K || (type) == TYPE_Q5_K || (type) == TYPE_Q6_K)
#define NR 4  /* output rows per panel */
/* Panels ahead that a thread prefetches its weights (2.9 KB of Q4_1, 4.9 KB of Q8_0 at K = 576):
 * the hardware prefetchers alone left the tiles waiting on memory (the Q8_0 LM head at one row:
 * 7 GB/s on one Zen 5 core, about 30 GB/s with these; docs/benchmarks/log.md). */
#define PF_PANELS 2

#if defined(__AVX512F__)
#define ISA 512
#define VL 16
#define MR 4
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA 256
#define VL 8
#define MR 2
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float VSUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#define ISA 0
#define VL 8 /* eight scalar lanes: the same sum order as a vector path, and room to auto-vectorize */
#define MR 2
typedef struct { float v[VL]; } vec;
static inline vec VZERO(void) { vec r; for (int i = 0; i < VL; i++) r.v[i] = 0.f; return r; }
static inline vec VLOAD(const float *p) { vec r; memcpy(r.v, p, sizeof r.v); return r; }
static inline vec VFMA(vec a, vec b, vec c) { for (int i = 0; i < VL; i++) c.v[i] += a.v[i] * b.v[i]; return c; }
static inline float VSUM(vec v) { float s = 0.f; for (int i = 0; i < VL; i++) s += v.v[i]; return s; }
#endif

int quant_matmul_isa(void) { return ISA; }

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h); /* blocks are 2-byte aligned at best */
    return h;
}

static inline uint32_t read_u32(const uint8_t *p) {
    uint32_t u;
    memcpy(&u, p, sizeof u);
    return u;
}

int64_t quant_block_bytes(int type) {
    switch (type) {
    case TYPE_F16: return 2 * QK;
    case TYPE_BF16: return 2 * QK;
    case TYPE_Q4_1: return 4 + QK / 2;
    case TYPE_Q8_0: return 2 + QK;
    case TYPE_Q4_K: return 144; /* a super-block's */
    case TYPE_Q5_K: return 176;
    case TYPE_Q6_K: return 210;
    case TYPE_Q4_1_I8: return 24; /* a row's share of its group's blocks */
    case TYPE_Q8_0_I8: return 36;
    case TYPE_Q6_K_I8: return 40;
    default: return 0;
    }
}

/* ------------------------------------------------------------------------------ one block */

#define NV (QK / VL) /* vectors a block fills */

/* Block `src` of type `type` as NV vectors of floats, in order. Inlined with a constant type. */
static inline __attribute__((always_inline)) void load_block(vec out[NV], const uint8_t *src, const int type) {
    if (type == TYPE_Q4_1) {
        const uint8_t *qs = src + 4;
#if ISA == 512
        /* d and m converted together; the 16 bytes widened once, then split into nibbles. */
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)read_u32(src)));
        const __m512 vd = _mm512_broadcastss_ps(dm), vm = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        out[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))), vd, vm);
        out[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), vd, vm);
#elif ISA == 256
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)read_u32(src)));
        const __m256 vd = _mm256_broadcastss_ps(dm), vm = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
        const __m256i low = _mm256_set1_epi32(15);
        const __m256i parts[4] = {_mm256_and_si256(b0, low), _mm256_and_si256(b1, low), _mm256_srli_epi32(b0, 4),
                                  _mm256_srli_epi32(b1, 4)};
        for (int i = 0; i < 4; i++) out[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(parts[i]), vd, vm);
#else
        const float d = f16_to_f32(read_u16(src)), m = f16_to_f32(read_u16(src + 2));
        for (int j = 0; j < QK / 2; j++) {
            out[j / VL].v[j % VL] = d * (float)(qs[j] & 15) + m;
            out[(j + QK / 2) / VL].v[j % VL] = d * (float)(qs[j] >> 4) + m;
        }
#endif
    } else if (type == TYPE_Q8_0) {
        const int8_t *qs = (const int8_t *)(src + 2);
#if ISA == 512
        /* d broadcast as f16, then converted: two instructions (a scalar conversion takes three) */
        const __m512 vd = _mm512_cvtph_ps(_mm256_set1_epi16((short)read_u16(src)));
        for (int i = 0; i < 2; i++)
            out[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * i)))), vd);
#elif ISA == 256
        const __m256 vd = _mm256_cvtph_ps(_mm_set1_epi16((short)read_u16(src)));
        for (int i = 0; i < 4; i++)
            out[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * i)))), vd);
#else
        const float d = f16_to_f32(read_u16(src));
        for (int j = 0; j < QK; j++) out[j / VL].v[j % VL] = d * (float)qs[j];
#endif
    } else if (type == TYPE_BF16) { /* bfloat16 -> float32 is a 16-bit shift */
#if ISA == 512
        for (int i = 0; i < 2; i++)
            out[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 32 * i))), 16));
#elif ISA == 256
        for (int i = 0; i < 4; i++)
            out[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 16 * i))), 16));
#else
        for (int j = 0; j < QK; j++) {
            const uint32_t bits = (uint32_t)read_u16(src + 2 * j) << 16;
            memcpy(&out[j / VL].v[j % VL], &bits, sizeof bits);
        }
#endif
    } else { /* TYPE_F16 */
#if ISA == 512
        for (int i = 0; i < 2; i++) out[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 32 * i)));
#elif ISA == 256
        for (int i = 0; i < 4; i++) out[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 16 * i)));
#else
        for (int j = 0; j < QK; j++) out[j / VL].v[j % VL] = f16_to_f32(read_u16(src + 2 * j));
#endif
    }
}

/* ------------------------------------------------------------------------------ K-quants
 *
 * A super-block of 256 weights, eight sub-blocks s of 32 (ggml's layouts, gguf-py's dequantizers):
 *
 *   Q4_K (type 12, 144 bytes)  f16 d | f16 dmin | 12 bytes scales | 128 bytes qs
 *       w = (d * sc[s]) * q - dmin * m[s], 6-bit sc and m packed in scales (`k_scales`);
 *       q = qs[32 * (s / 2) + j] >> (4 * (s % 2)) & 15
 *   Q5_K (type 13, 176 bytes)  f16 d | f16 dmin | 12 bytes scales | 32 bytes qh | 128 bytes qs
 *       as Q4_K, q gaining bit 4 from qh[j] >> s & 1
 *   Q6_K (type 14, 210 bytes)  128 bytes ql | 64 bytes qh | 16 int8 scales | f16 d
 *       w = (d * scales[2s + j / 16]) * (q - 32), q of 6 bits: with h = s / 4, t = s % 4,
 *       ql[64h + 32 (t % 2) + j] >> (4 (t / 2)) & 15 | (qh[32h + j] >> 2t & 3) << 4
 *
 * Every product is exact in float32 (d's 11 bits times at most 6 + 5, or 7 + 5 bits), so the one
 * rounding is Q4_K's and Q5_K's subtraction, whether fused or not: gguf's weights bit for bit. */

/* A super-block's scales, decoded once for its eight sub-blocks: Q4_K's and Q5_K's d * sc[s] and
 * dmin * m[s] (s < 8), Q6_K's d * scales[i] (i < 16, a scale per 16 weights; dm unused). */
static inline __attribute__((always_inline)) void k_scales(const uint8_t *sb, const int type, float dsc[16], float dm[8]) {
    if (type == TYPE_Q6_K) {
        const float d = f16_to_f32(read_u16(sb + 208));
#if ISA
        const __m256 vd = _mm256_set1_ps(d);
        for (int i = 0; i < 2; i++)
            _mm256_storeu_ps(dsc + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(sb + 192 + 8 * i)))), vd));
#else
        const int8_t *scales = (const int8_t *)(sb + 192);
        for (int i = 0; i < 16; i++) dsc[i] = d * (float)scales[i];
#endif
        return;
    }
    /* The twelve bytes as llama.cpp unpacks them: u[0..1] the eight 6-bit scales, u[2..3] the mins. */
    uint32_t u[4];
    memcpy(u, sb + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t mins_low = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins_low;
    u[0] &= 0x3f3f3f3fu;
    const float d = f16_to_f32(read_u16(sb)), dmin = f16_to_f32(read_u16(sb + 2));
#if ISA
    const __m128i bytes = _mm_loadu_si128((const __m128i *)u);
    _mm256_storeu_ps(dsc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_set1_ps(d)));
    _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))),
                                       _mm256_set1_ps(dmin)));
#else
    uint8_t b[16];
    memcpy(b, u, sizeof b);
    for (int s = 0; s < 8; s++) {
        dsc[s] = d * (float)b[s];
        dm[s] = dmin * (float)b[8 + s];
    }
#endif
}

/* A super-block's 256 quants as bytes, in weight order: Q4_K's and Q5_K's q (0..31), Q6_K's q - 32
 * (-32..31, signed). The vector paths take 32 bytes an instruction; shifts run in 16-bit lanes and the
 * masks drop what crosses between a lane's two bytes. */
static inline __attribute__((always_inline)) void k_quants(uint8_t q[QK_K], const uint8_t *sb, const int type) {
#if ISA
    const __m256i low = _mm256_set1_epi8(15);
    if (type == TYPE_Q6_K) {
        const __m256i top = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) { /* weights 128h ..: sub-blocks t = 0..3 of ql's and qh's halves */
            const __m256i a = _mm256_loadu_si256((const __m256i *)(sb + 64 * h));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));
            const __m256i t[4] = {
                _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top)),
                _mm256_or_si256(_mm256_and_si256(b, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(hb, top)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low),
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), top))};
            for (int i = 0; i < 4; i++)
                _mm256_storeu_si256((__m256i *)(q + 128 * h + 32 * i), _mm256_sub_epi8(t[i], bias));
        }
        return;
    }
    const int with_high = type == TYPE_Q5_K;
    const uint8_t *qs = sb + (with_high ? 48 : 16);
    const __m256i hb = with_high ? _mm256_loadu_si256((const __m256i *)(sb + 16)) : _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) { /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        if (with_high) { /* qh's bit s of byte j is bit 4 of sub-block s's q[j]: a compare makes it 16 or 0 */
            const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * p))), b1 = _mm256_set1_epi8((char)(2 << (2 * p)));
            const __m256i sixteen = _mm256_set1_epi8(16);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, b0), b0), sixteen));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, b1), b1), sixteen));
        }
        _mm256_storeu_si256((__m256i *)(q + 64 * p), lo);
        _mm256_storeu_si256((__m256i *)(q + 64 * p + 32), hi);
    }
#else
    if (type == TYPE_Q6_K) {
        for (int s = 0; s < 8; s++) {
            const int h = s >> 2, t = s & 3;
            const uint8_t *ql = sb + 64 * h + 32 * (t & 1), *qh = sb + 128 + 32 * h;
            for (int j = 0; j < QK; j++)
                q[QK * s + j] = (uint8_t)((((ql[j] >> (4 * (t >> 1))) & 15) | (((qh[j] >> (2 * t)) & 3) << 4)) - 32);
        }
        return;
    }
    const int with_high = type == TYPE_Q5_K;
    const uint8_t *qh = sb + 16, *qs = sb + (with_high ? 48 : 16);
    for (int s = 0; s < 8; s++)
        for (int j = 0; j < QK; j++)
            q[QK * s + j] = (uint8_t)(((qs[32 * (s >> 1) + j] >> (4 * (s & 1))) & 15) |
                                      (with_high ? ((qh[j] >> s) & 1) << 4 : 0));
#endif
}

/* Weights 32 s + VL i .. + VL of a super-block as one vector, from its `k_quants` and `k_scales`. */
static inline __attribute__((always_inline)) vec k_weights(const uint8_t *q, int s, int i, const int type,
                                                           const float *dsc, const float *dm) {
    const int j = QK * s + VL * i;
#if ISA == 512
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + j));
    if (type == TYPE_Q6_K)
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), _mm512_set1_ps(dsc[j / 16]));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), _mm512_set1_ps(dsc[s]), _mm512_set1_ps(-dm[s]));
#elif ISA == 256
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + j));
    if (type == TYPE_Q6_K)
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_set1_ps(dsc[j / 16]));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_set1_ps(dsc[s]), _mm256_set1_ps(-dm[s]));
#else
    vec r;
    for (int l = 0; l < VL; l++)
        r.v[l] = type == TYPE_Q6_K ? dsc[(j + l) / 16] * (float)(int8_t)q[j + l] : dsc[s] * (float)q[j + l] - dm[s];
    return r;
#endif
}

/* Keeps v in a register: the compiler would otherwise fold its load into every FMA that reads it
 * (vfmadd231ps mem), loading the same vector once per row of x. */
#if ISA
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

static inline void vstore(float *p, vec v) {
#if ISA == 512
    _mm512_storeu_ps(p, v);
#elif ISA == 256
    _mm256_storeu_ps(p, v);
#else
    memcpy(p, v.v, sizeof v.v);
#endif
}

static inline __attribute__((always_inline)) void dequantize_row_t(float *dst, const uint8_t *src, int64_t k,
                                                                   const int type, const int64_t block_bytes) {
    if (IS_K(type)) { /* block_bytes: a super-block's */
        for (int64_t sb = 0; sb < k / QK_K; sb++) {
            float scales[16], mins[8];
            uint8_t q[QK_K] __attribute__((aligned(32)));
            k_scales(src + sb * block_bytes, type, scales, mins);
            k_quants(q, src + sb * block_bytes, type);
            for (int s = 0; s < QK_K / QK; s++)
                for (int i = 0; i < NV; i++) vstore(dst + sb * QK_K + s * QK + i * VL, k_weights(q, s, i, type, scales, mins));
        }
        return;
    }
    for (int64_t b = 0; b < k / QK; b++) {
        vec v[NV];
        load_block(v, src + b * block_bytes, type);
        for (int i = 0; i < NV; i++) vstore(dst + b * QK + i * VL, v[i]);
    }
}

static void dequantize_row(float *dst, const uint8_t *src, int64_t k, int type) {
    switch (type) {
    case TYPE_Q4_1: dequantize_row_t(dst, src, k, TYPE_Q4_1, 20); break;
    case TYPE_Q8_0: dequantize_row_t(dst, src, k, TYPE_Q8_0, 34); break;
    case TYPE_F16: dequantize_row_t(dst, src, k, TYPE_F16, 64); break;
    case TYPE_BF16: dequantize_row_t(dst, src, k, TYPE_BF16, 64); break;
    case TYPE_Q4_K: dequantize_row_t(dst, src, k, TYPE_Q4_K, 144); break;
    case TYPE_Q5_K: dequantize_row_t(dst, src, k, TYPE_Q5_K, 176); break;
    case TYPE_Q6_K: dequantize_row_t(dst, src, k, TYPE_Q6_K, 210); break;
    }
}

/* ------------------------------------------------------------------------------ the tiles */

/* y[c] = VSUM(acc[c]) for c < nr (<= NR = 4). On AVX-512 the four vectors are summed side by side,
 * in the very tree of _mm512_reduce_add_ps (lanes i + 8, then i + 4, i + 2, i + 1): 9 shuffles
 * and 5 adds for four sums where one at a time takes 16 of each, the same floats. Both tiles
 * store through it, so a row's sums do not depend on M. */
static inline __attribute__((always_inline)) void store_sums(float *y, const vec acc[NR], const int nr) {
#if ISA == 512
    const __m512 a = acc[0], b = nr > 1 ? acc[1] : a, c = nr > 2 ? acc[2] : a, d = nr > 3 ? acc[3] : a;
    /* [a's lanes i + (i + 8) | b's], [c's | d's] */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    /* a 128-bit quarter per vector: lanes i + (i + 4) */
    __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2))); /* i + (i + 2) */
    t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1))); /* i + (i + 1) */
    const __m512 sums = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t);
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << nr) - 1), sums);
#else
    for (int c = 0; c < nr; c++) y[c] = VSUM(acc[c]);
#endif
}

/* y[r][c] (r < mr, c < nr) = x[r] . w[c] over k, w dequantized rows k floats apart; inlined with
 * constant mr, nr so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(
    float *y, int64_t ldy, const float *x, int64_t ldx, const float *w, int64_t k, const int mr, const int nr)
{
    vec acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) acc[r][c] = VZERO();
    for (int64_t i = 0; i < k; i += VL) {
        vec wv[NR];
        for (int c = 0; c < nr; c++) {
            wv[c] = VLOAD(w + c * k + i);
            IN_REGISTER(wv[c]);
        }
        for (int r = 0; r < mr; r++) {
            vec xv = VLOAD(x + r * ldx + i);
            IN_REGISTER(xv);
            for (int c = 0; c < nr; c++) acc[r][c] = VFMA(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < mr; r++)
        store_sums(y + r * ldy, acc[r], nr);
}

/* The K-quant tile for M <= MR (M > MR: `dequantize_row`, then `tile`). A panel's super-block is
 * unpacked once for its nr rows (`k_unpack`: bytes and scales), then dequantized in registers a
 * vector at a time, the nr rows' vectors alternating. Each lane sums its products in k order, as
 * `tile` does over `dequantize_row`: the same floats whatever M. */
typedef struct {
    uint8_t q[NR][QK_K];          /* `k_quants` of each row */
    float dsc[NR][16], dm[NR][8]; /* `k_scales` of each row */
} ksuper;

static inline __attribute__((always_inline)) void k_unpack(ksuper *u, const uint8_t *w, int64_t row_bytes, const int nr,
                                                           const int type) {
    for (int c = 0; c < nr; c++) {
        k_scales(w + c * row_bytes, type, u->dsc[c], u->dm[c]);
        k_quants(u->q[c], w + c * row_bytes, type);
    }
}

/* `tile_blocks` for the K-quants (block_bytes: a super-block's), M <= MR. */
static inline __attribute__((always_inline)) void ktile_direct(
    float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t k,
    const int mr, const int nr, const int type, const int64_t block_bytes, const uint8_t *pf)
{
    vec acc[MR][NR];
    ksuper u __attribute__((aligned(32)));
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) acc[r][c] = VZERO();
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        for (int64_t o = 0; o < NR * block_bytes; o += 64) PREFETCH(pf + sb * NR * block_bytes + o);
        k_unpack(&u, w + sb * block_bytes, row_bytes, nr, type);
        const float *xs = x + sb * QK_K;
        for (int s = 0; s < QK_K / QK; s++)
            for (int i = 0; i < NV; i++) {
                vec xv[MR];
                for (int r = 0; r < mr; r++) {
                    xv[r] = VLOAD(xs + r * ldx + s * QK + i * VL);
                    IN_REGISTER(xv[r]);
                }
                for (int c = 0; c < nr; c++) {
                    const vec wv = k_weights(u.q[c], s, i, type, u.dsc[c], u.dm[c]);
                    for (int r = 0; r < mr; r++) acc[r][c] = VFMA(xv[r], wv, acc[r][c]);
                }
            }
    }
    for (int r = 0; r < mr; r++)
        store_sums(y + r * ldy, acc[r], nr);
}

/* The same tile straight from the blocks (rows row_bytes apart), each block dequantized in
 * registers: for M <= MR, where a panel's weights serve one tile only and a buffer would be a
 * store and a load more per weight. Same sum order as `tile`. While it reads block b of its rows,
 * it prefetches the same share (NR blocks' bytes) of the panel at `pf`, PF_PANELS ahead. */
static inline __attribute__((always_inline)) void tile_blocks(
    float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t k,
    const int mr, const int nr, const int type, const int64_t block_bytes, const uint8_t *pf)
{
    if (IS_K(type)) {
        ktile_direct(y, ldy, x, ldx, w, row_bytes, k, mr, nr, type, block_bytes, pf);
        return;
    }
    vec acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) acc[r][c] = VZERO();
    for (int64_t b = 0; b < k / QK; b++) {
        for (int64_t o = 0; o < NR * block_bytes; o += 64) PREFETCH(pf + b * NR * block_bytes + o);
#if ISA == 512
        /* the block's x loaded once for the nr rows (32 registers hold them beside 16 accumulators) */
        vec xv[MR][NV];
        for (int r = 0; r < mr; r++)
            for (int i = 0; i < NV; i++) {
                xv[r][i] = VLOAD(x + r * ldx + b * QK + i * VL);
                IN_REGISTER(xv[r][i]);
            }
#define XV(r, i) xv[r][i]
#else
#define XV(r, i) VLOAD(x + (r) * ldx + b * QK + (i) * VL)
#endif
        for (int c = 0; c < nr; c++) {
            vec wv[NV];
            load_block(wv, w + c * row_bytes + b * block_bytes, type);
            for (int i = 0; i < NV; i++)
                for (int r = 0; r < mr; r++) acc[r][c] = VFMA(XV(r, i), wv[i], acc[r][c]);
        }
#undef XV
    }
    for (int r = 0; r < mr; r++)
        store_sums(y + r * ldy, acc[r], nr);
}

#define TILE_NR(mr_, nr_) \
    switch (nr_) { \
    case 4: tile(y, ldy, x, ldx, w, k, mr_, 4); break; \
    case 3: tile(y, ldy, x, ldx, w, k, mr_, 3); break; \
    case 2: tile(y, ldy, x, ldx, w, k, mr_, 2); break; \
    default: tile(y, ldy, x, ldx, w, k, mr_, 1); break; \
    }

static void tile_any(float *y, int64_t ldy, const float *x, int64_t ldx, const float *w, int64_t k, int mr, int nr) {
#if MR == 4
    if (mr == 4) { TILE_NR(4, nr); return; }
    if (mr == 3) { TILE_NR(3, nr); return; }
#endif
    if (mr == 2) { TILE_NR(2, nr); return; }
    TILE_NR(1, nr);
}

#define BLOCKS_NR(mr_, type_, bytes_) \
    switch (nr) { \
    case 4: tile_blocks(y, ldy, x, ldx, w, row_bytes, k, mr_, 4, type_, bytes_, pf); break; \
    case 3: tile_blocks(y, ldy, x, ldx, w, row_bytes, k, mr_, 3, type_, bytes_, pf); break; \
    case 2: tile_blocks(y, ldy, x, ldx, w, row_bytes, k, mr_, 2, type_, bytes_, pf); break; \
    default: tile_blocks(y, ldy, x, ldx, w, row_bytes, k, mr_, 1, type_, bytes_, pf); break; \
    }

#if MR == 4
#define BLOCKS_MR(type_, bytes_) \
    switch (mr) { \
    case 4: BLOCKS_NR(4, type_, bytes_); break; \
    case 3: BLOCKS_NR(3, type_, bytes_); break; \
    case 2: BLOCKS_NR(2, type_, bytes_); break; \
    default: BLOCKS_NR(1, type_, bytes_); break; \
    }
#else
#define BLOCKS_MR(type_, bytes_) \
    switch (mr) { \
    case 2: BLOCKS_NR(2, type_, bytes_); break; \
    default: BLOCKS_NR(1, type_, bytes_); break; \
    }
#endif

static void tile_blocks_any(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                            int64_t k, int mr, int nr, int type, const uint8_t *pf) {
    switch (type) {
    case TYPE_Q4_1: BLOCKS_MR(TYPE_Q4_1, 20); break;
    case TYPE_Q8_0: BLOCKS_MR(TYPE_Q8_0, 34); break;
    case TYPE_F16: BLOCKS_MR(TYPE_F16, 64); break;
    case TYPE_BF16: BLOCKS_MR(TYPE_BF16, 64); break;
    case TYPE_Q4_K: BLOCKS_MR(TYPE_Q4_K, 144); break;
    case TYPE_Q5_K: BLOCKS_MR(TYPE_Q5_K, 176); break;
    case TYPE_Q6_K: BLOCKS_MR(TYPE_Q6_K, 210); break;
    }
}

/* ------------------------------------------------------------------------------ bfloat16 dot products */

#if defined(__AVX512BF16__) && ISA == 512
#define BF16_DOT 1
/* y[r][c] (r < mr, c < nr) = xb[r] . w[c] over k, both bfloat16 (rows ldx and ldw elements apart):
 * 32 products per vdpbf16ps, pairs summed in float32 in each lane; then `store_sums`. */
static inline __attribute__((always_inline)) void tile_bf16(
    float *y, int64_t ldy, const uint16_t *xb, int64_t ldx, const uint16_t *w, int64_t ldw, int64_t k,
    const int mr, const int nr, const uint16_t *pf)
{
    vec acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) acc[r][c] = VZERO();
    for (int64_t i = 0; i < k; i += 2 * VL) {
        if (pf != NULL)
            for (int c = 0; c < NR; c++) PREFETCH(pf + c * ldw + i);
        __m512bh wv[NR];
        for (int c = 0; c < nr; c++) {
            wv[c] = (__m512bh)_mm512_loadu_si512(w + c * ldw + i);
            IN_REGISTER(wv[c]);
        }
        for (int r = 0; r < mr; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * ldx + i);
            IN_REGISTER(xv);
            for (int c = 0; c < nr; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < mr; r++)
        store_sums(y + r * ldy, acc[r], nr);
}

#define TILE_BF16_NR(mr_) \
    switch (nr) { \
    case 4: tile_bf16(y, ldy, xb, ldx, w, ldw, k, mr_, 4, pf); break; \
    case 3: tile_bf16(y, ldy, xb, ldx, w, ldw, k, mr_, 3, pf); break; \
    case 2: tile_bf16(y, ldy, xb, ldx, w, ldw, k, mr_, 2, pf); break; \
    default: tile_bf16(y, ldy, xb, ldx, w, ldw, k, mr_, 1, pf); break; \
    }

static void tile_bf16_any(float *y, int64_t ldy, const uint16_t *xb, int64_t ldx, const uint16_t *w, int64_t ldw,
                          int64_t k, int mr, int nr, const uint16_t *pf) {
    switch (mr) {
    case 4: TILE_BF16_NR(4); break;
    case 3: TILE_BF16_NR(3); break;
    case 2: TILE_BF16_NR(2); break;
    default: TILE_BF16_NR(1); break;
    }
}

/* quant_matmul for BF16 weights: x rounded to bfloat16 once (to nearest even), then the tiles.
 * Returns 0, or -1 where x's copy could not be allocated (the caller takes the float32 path). */
static int matmul_bf16(float *y, int64_t ldy, const float *x, int64_t ldx, const uint16_t *w,
                       int64_t M, int64_t N, int64_t K, int num_threads)
{
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * M * K + 64);
    if (xb == NULL) return -1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < K; i += 2 * VL) {
            const __m512 lo = _mm512_loadu_ps(x + m * ldx + i), hi = _mm512_loadu_ps(x + m * ldx + i + VL);
            _mm512_storeu_si512(xb + m * K + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    const int64_t panels = (N + NR - 1) / NR;
    if (num_threads > panels) num_threads = (int)panels;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * NR;
        const int nr = N - n0 < NR ? (int)(N - n0) : NR;
        const uint16_t *pf = p + PF_PANELS < panels ? w + (n0 + PF_PANELS * NR) * K : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR;
            /* the next panels' weights are read ahead while the first rows of x go through this one */
            tile_bf16_any(y + m0 * ldy + n0, ldy, xb + m0 * K, K, w + n0 * K, K, K, mr, nr, m0 == 0 ? pf : NULL);
        }
    }
    free(xb);
    return 0;
}
#endif

/* Whether BF16 weights meet x rounded to bfloat16 in dot-product instructions (1) or float32 x (0). */
int quant_matmul_bf16_dot(void) {
#if defined(BF16_DOT)
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------------ int8 activations
 *
 * Q4_1_I8 and Q8_0_I8 (types 1003 and 1004, never a file's): `--dtype auto`'s copies of a layer's Q4_1
 * or Q4_K weights and of Q8_0 ones (the LM head's, and layers') for the larger steps, where a probe at
 * start-up measures them the fastest (AVX2-only CPUs; Zen 4, whose VNNI beats its bfloat16 dot products).
 * The weights are the file's, exactly; x is quantized per 32-block the way llama.cpp quantizes
 * activations for its dot products (q8_1 for Q4_1, q8_0 for Q8_0):
 *
 *   dx = amax(|x|) * (1/127), qx = round(x / dx) (to nearest even) in -127..127, sx = dx * sum(qx)
 *
 * and a block's x . w = d_w dx (q_w . qx) (+ m_w sx for Q4_1), its 32 products summed in integers:
 * vpmaddubsw multiplies 32 unsigned-by-signed byte pairs and adds neighbours (four times the products
 * of an 8-wide FMA), vpdpbusd with VNNI does four a lane. Q4_1's weights are unsigned (0..15); Q8_0's
 * are signed, so they enter as |q_w| against qx with q_w's sign (vpsignb: products up to 128 * 127, two
 * of them in a 16-bit lane without saturating). The integer sums are exact, so every path gives the
 * same floats.
 *
 * Q6_K_I8 (1005) is the same for Q6_K weights, whose scales go by 16 weights: a block of 32 has two,
 * d0 for its first 16 weights (vectors t < 4) and d1 for the rest, each half summed apart. Its weights
 * are small (|q| <= 32), so four products of a half add up in 16-bit lanes before one widening.
 *
 * Layout: rows in groups of I8_ROWS = 8, each group's blocks in order:
 *
 *   Q4_1_I8, 192 bytes a block:  float d[8] | float m[8] | 4 vectors t of 32 bytes:
 *                                byte 4r + i = q_r[8t + i] | q_r[8t + 4 + i] << 4
 *   Q8_0_I8, 288 bytes a block:  float d[8] | 8 vectors t of 32 bytes: byte 4r + i = q_r[4t + i]
 *   Q6_K_I8, 320 bytes a block:  float d0[8] | float d1[8] | 8 vectors t as Q8_0_I8's (q - 32)
 *
 * so a Q4_1 vector's low nibbles are the 8 rows' weights at columns 8t .. 8t + 3 and its high ones at
 * 8t + 4 .. 8t + 7 (a Q8_0 vector's bytes those at 4t .. 4t + 3): one multiply-add against x's four
 * bytes broadcast gives each row's partial sum in its own lane, no shuffles and no horizontal sums.
 * Per row 24 bytes a block (Q4_1: 20), 36 (Q8_0: 34). */

#define I8_ROWS 8
#if defined(__AVX2__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define I8_ZMM 1 /* the 512-bit tiles below; Q8_0_I8 bytes are then q + 128 (see there) */
#endif
#define I8_MR 4 /* rows of x per tile: 4 float + 4 integer accumulators beside the weights and x */

/* With I8_ZMM, Q8_0_I8 keeps q + 128 (q ^ 0x80) and Q6_K_I8 q - 32 + 32 (0..63) as unsigned bytes,
 * so that vpdpbusd takes them as they are, where signed ones would cost a negation of x a product;
 * a block's (or half block's) sum then drops 128 (32) times the sum of its qx, in integers: the same
 * sums as the signed bytes give, bit for bit. x's quantization returns those sums (IX). */
#if defined(I8_ZMM)
#define Q8_OFFSET 0x80
#define Q6_OFFSET 32
#else
#define Q8_OFFSET 0
#define Q6_OFFSET 0
#endif
/* Integer sums of x's quantized block b of row r (ix: 3 a block): 128 * sum(qx), then 32 * the sum of
 * its first 16 and of its last 16 values. */
#define IX(ix, r, nb, b, k) ((ix)[3 * ((r) * (nb) + (b)) + (k)])

static inline int64_t i8_block_bytes(const int type) {
    return I8_ROWS * (type == TYPE_Q4_1_I8 ? 24 : type == TYPE_Q8_0_I8 ? 36 : 40);
}

/* Sub-block b (of 32 weights) of a K-quant row: its quants (as k_quants) and its super-block's scales. */
static void k_sub_block(uint8_t q[QK], float dsc[16], float dm[8], const uint8_t *row, int64_t b, const int type) {
    const uint8_t *sb = row + b / 8 * quant_block_bytes(type);
    uint8_t all[QK_K];
    k_scales(sb, type, dsc, dm);
    k_quants(all, sb, type);
    memcpy(q, all + QK * (b % 8), QK);
}

/* src: N (a multiple of 8) rows of Q4_1 or Q4_K (-> Q4_1_I8), Q8_0 (-> Q8_0_I8) or Q6_K (-> Q6_K_I8) blocks
 * of `src_type`, row_bytes apart -> dst: N * K / 32 * 24 (36, 40) bytes. A Q4_K sub-block of 32 is a
 * Q4_1 block with float32 scales, w = (d sc) q - dmin m, and a Q6_K one two halves of (d sc) (q - 32):
 * every product exact in float32 (the K-quants' note above). */
void quant_pack_i8(uint8_t *dst, const uint8_t *src, int64_t row_bytes, int64_t N, int64_t K, int src_type) {
    if (src_type != TYPE_Q4_1 && src_type != TYPE_Q4_K && src_type != TYPE_Q8_0 && src_type != TYPE_Q6_K) return;
    const int type = src_type == TYPE_Q8_0 ? TYPE_Q8_0_I8 : src_type == TYPE_Q6_K ? TYPE_Q6_K_I8 : TYPE_Q4_1_I8;
    const int64_t nb = K / QK, bytes = i8_block_bytes(type);
    for (int64_t g = 0; g < N / I8_ROWS; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + (g * nb + b) * bytes;
            for (int r = 0; r < I8_ROWS; r++) {
                const uint8_t *row = src + (g * I8_ROWS + r) * row_bytes;
                float dsc[16], dm[8];
                uint8_t q[QK];
                if (type == TYPE_Q6_K_I8) {
                    k_sub_block(q, dsc, dm, row, b, TYPE_Q6_K);
                    memcpy(out + 4 * r, &dsc[2 * (b % 8)], 4);
                    memcpy(out + 32 + 4 * r, &dsc[2 * (b % 8) + 1], 4);
                    for (int j = 0; j < QK; j++) out[64 + 32 * (j / 4) + 4 * r + j % 4] = (uint8_t)(q[j] + Q6_OFFSET);
                    continue;
                }
                if (type == TYPE_Q8_0_I8) {
                    const uint8_t *blk = row + b * 34;
                    const float d = f16_to_f32(read_u16(blk));
                    memcpy(out + 4 * r, &d, 4);
                    for (int t = 0; t < 8; t++)
                        for (int i = 0; i < 4; i++) out[32 + 32 * t + 4 * r + i] = (uint8_t)(blk[2 + 4 * t + i] ^ Q8_OFFSET);
                    continue;
                }
                float d, m;
                if (src_type == TYPE_Q4_K) {
                    k_sub_block(q, dsc, dm, row, b, TYPE_Q4_K);
                    d = dsc[b % 8];
                    m = -dm[b % 8];
                } else {
                    const uint8_t *blk = row + b * 20;
                    d = f16_to_f32(read_u16(blk));
                    m = f16_to_f32(read_u16(blk + 2));
                    for (int j = 0; j < 16; j++) {
                        q[j] = blk[4 + j] & 15;
                        q[j + 16] = blk[4 + j] >> 4;
                    }
                }
                memcpy(out + 4 * r, &d, 4);
                memcpy(out + 32 + 4 * r, &m, 4);
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 4; i++) out[64 + 32 * t + 4 * r + i] = (uint8_t)(q[8 * t + i] | q[8 * t + 4 + i] << 4);
            }
        }
}

/* Row n of an I8 weight (groups of rows row_bytes * 8 bytes apart) as float32: the file's weights. */
static void i8_dequantize_row(float *dst, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t K, int type) {
    const uint8_t *group = w + (n / I8_ROWS) * I8_ROWS * row_bytes;
    const int r = (int)(n % I8_ROWS);
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *blk = group + b * i8_block_bytes(type);
        float d, m;
        memcpy(&d, blk + 4 * r, 4);
        if (type == TYPE_Q8_0_I8) {
            for (int j = 0; j < QK; j++)
                dst[b * QK + j] = d * (float)(int8_t)(blk[32 + 32 * (j / 4) + 4 * r + j % 4] ^ Q8_OFFSET);
            continue;
        }
        if (type == TYPE_Q6_K_I8) {
            memcpy(&m, blk + 32 + 4 * r, 4); /* d1 */
            for (int j = 0; j < QK; j++)
                dst[b * QK + j] = (j < 16 ? d : m) * (float)(int8_t)(uint8_t)(blk[64 + 32 * (j / 4) + 4 * r + j % 4] - Q6_OFFSET);
            continue;
        }
        memcpy(&m, blk + 32 + 4 * r, 4);
        for (int t = 0; t < 4; t++)
            for (int i = 0; i < 4; i++) {
                const uint8_t byte = blk[64 + 32 * t + 4 * r + i];
                dst[b * QK + 8 * t + i] = d * (float)(byte & 15) + m;
                dst[b * QK + 8 * t + 4 + i] = d * (float)(byte >> 4) + m;
            }
    }
}

static inline int32_t read_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define I8_INV127 (1.0f / 127.0f)

/* x's row (K floats) -> qx (K bytes), dx and sx (K / 32 floats each), as above, and ix (3 * K / 32
 * integers: IX, the offsets' corrections). */
static void quantize_row_q8(int8_t *qx, float *dx, float *sx, int32_t *ix, const float *x, int64_t K) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        int8_t *qb = qx + b * QK;
#if defined(__AVX2__)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
        const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float d = _mm_cvtss_f32(h) * I8_INV127, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid)), lim), nlim);
        /* the two halves' sums side by side: lanes 0 .. 3 the first 16 values', 4 .. 7 the last 16's */
        const __m256i s01 = _mm256_add_epi32(q[0], q[1]), s23 = _mm256_add_epi32(q[2], q[3]);
        __m256i hs = _mm256_hadd_epi32(s01, s23); /* per 128-bit half: s01 pairs, s23 pairs */
        hs = _mm256_hadd_epi32(hs, hs);
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(hs), _mm256_extracti128_si256(hs, 1));
        const int32_t first16 = _mm_cvtsi128_si32(s), last16 = _mm_extract_epi32(s, 1);
        /* packs interleave the 128-bit halves: 32-bit groups come out as q0 q1 q2 q3 (low halves), then
         * the high halves; the permutation puts them back in order */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)qb,
                            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        dx[b] = d;
        sx[b] = d * (float)(first16 + last16);
        ix[3 * b] = 128 * (first16 + last16);
        ix[3 * b + 1] = 32 * first16;
        ix[3 * b + 2] = 32 * last16;
#else
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        const float d = amax * I8_INV127, id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0, first16 = 0;
        for (int j = 0; j < QK; j++) {
            long v = lrintf(xb[j] * id);
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            qb[j] = (int8_t)v;
            sum += (int32_t)v;
            if (j < 16) first16 += (int32_t)v;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
        ix[3 * b] = 128 * sum;
        ix[3 * b + 1] = 32 * first16;
        ix[3 * b + 2] = 32 * (sum - first16);
#endif
    }
}

#if defined(__AVX2__)
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define I8_VNNI 1
#endif
/* acc += a (unsigned bytes) . b (signed bytes), four products a 32-bit lane */
static inline __m256i i8_dot(__m256i acc, __m256i a, __m256i b) {
#if defined(I8_VNNI)
    return _mm256_dpbusd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}

/* y[r][0..8) (r < mr) = the group's 8 rows (blocks at wg) . x's quantized rows r; pf: bytes to read
 * ahead (the next group's), or NULL. */
static inline __attribute__((always_inline)) void i8_tile(
    float *y, int64_t ldy, const int8_t *qx, const float *dx, const float *sx, const int32_t *ix, int64_t K,
    const uint8_t *wg, const int mr, const uint8_t *pf, const int type)
{
    const int64_t nb = K / QK, bytes = i8_block_bytes(type);
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256 acc[I8_MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * bytes;
        if (pf != NULL)
            for (int o = 0; o < bytes; o += 64) PREFETCH(pf + b * bytes + o);
        __m256i isum[I8_MR];
        if (type == TYPE_Q6_K_I8) {
            for (int h = 0; h < 2; h++) { /* the block's halves, a scale each */
                for (int r = 0; r < mr; r++) isum[r] = _mm256_setzero_si256();
                for (int t = 4 * h; t < 4 * h + 4; t++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * t));
#if defined(I8_ZMM)
                    for (int r = 0; r < mr; r++) /* q + 32, unsigned */
                        isum[r] = _mm256_dpbusd_epi32(isum[r], v, _mm256_set1_epi32(read_i32(qx + r * K + b * QK + 4 * t)));
#else
                    const __m256i mag = _mm256_sign_epi8(v, v);
                    for (int r = 0; r < mr; r++) {
                        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(read_i32(qx + r * K + b * QK + 4 * t)), v);
#if defined(I8_VNNI)
                        isum[r] = _mm256_dpbusd_epi32(isum[r], mag, xs);
#else
                        isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(mag, xs)); /* 4 * 2 * 32 * 127 */
#endif
                    }
#endif
                }
#if defined(I8_ZMM)
                for (int r = 0; r < mr; r++)
                    isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(IX(ix, r, nb, b, 1 + h)));
#endif
                const __m256 d = _mm256_loadu_ps((const float *)(blk + 32 * h));
                for (int r = 0; r < mr; r++) {
#if !defined(I8_VNNI)
                    isum[r] = _mm256_madd_epi16(isum[r], _mm256_set1_epi16(1));
#endif
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])),
                                             acc[r]);
                }
            }
            continue;
        }
        for (int r = 0; r < mr; r++) isum[r] = _mm256_setzero_si256();
        if (type == TYPE_Q8_0_I8) {
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * t));
#if defined(I8_ZMM)
                for (int r = 0; r < mr; r++) /* q + 128, unsigned */
                    isum[r] = _mm256_dpbusd_epi32(isum[r], v, _mm256_set1_epi32(read_i32(qx + r * K + b * QK + 4 * t)));
#else
                const __m256i mag = _mm256_sign_epi8(v, v); /* |q|; -128 stays 0x80, 128 unsigned */
                for (int r = 0; r < mr; r++) {
                    const __m256i xs = _mm256_set1_epi32(read_i32(qx + r * K + b * QK + 4 * t));
                    isum[r] = i8_dot(isum[r], mag, _mm256_sign_epi8(xs, v));
                }
#endif
            }
#if defined(I8_ZMM)
            for (int r = 0; r < mr; r++) isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(IX(ix, r, nb, b, 0)));
#else
            (void)ix;
#endif
        } else {
            for (int t = 0; t < 4; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * t));
                const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                for (int r = 0; r < mr; r++) {
                    const int8_t *xr = qx + r * K + b * QK + 8 * t;
                    const __m256i xlo = _mm256_set1_epi32(read_i32(xr)), xhi = _mm256_set1_epi32(read_i32(xr + 4));
#if defined(I8_VNNI)
                    isum[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(isum[r], lo, xlo), hi, xhi);
#else
                    /* 4-bit weights: 8 sums of two products fit a 16-bit lane, widened once a block */
                    isum[r] = _mm256_add_epi16(isum[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo),
                                                                         _mm256_maddubs_epi16(hi, xhi)));
#endif
                }
            }
#if !defined(I8_VNNI)
            for (int r = 0; r < mr; r++) isum[r] = _mm256_madd_epi16(isum[r], _mm256_set1_epi16(1));
#endif
        }
        const __m256 d = _mm256_loadu_ps((const float *)blk);
        const __m256 m = type == TYPE_Q4_1_I8 ? _mm256_loadu_ps((const float *)(blk + 32)) : _mm256_setzero_ps();
        for (int r = 0; r < mr; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
            if (type == TYPE_Q4_1_I8) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

#if defined(I8_ZMM)
/* Two neighbouring groups in one 512-bit vector: group g's 8 rows in the low half, g + 1's in the high
 * one, so each vpdpbusd sums 16 rows against x's four bytes, broadcast once. The layout stays the
 * 8-row groups of every build; a lone last group takes i8_tile. On a 256-bit datapath (Zen 4) the
 * gain is in instructions: the AVX2 tile spends two of its three vector instructions on broadcasts,
 * unpacking and scales, and runs out of issue slots before the dot-product units are busy. */
static inline __m512i i8_pair(const uint8_t *lo, const uint8_t *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}

static inline __m512 i8_pair_ps(const uint8_t *lo, const uint8_t *hi) {
    return _mm512_castsi512_ps(i8_pair(lo, hi));
}

/* y[r][0..16) (r < mr) = the two groups' 16 rows (blocks at wg and wg + gbytes) . x's quantized rows r;
 * pf: the next pair's first group, or NULL. Signed weights (Q8_0, Q6_K) enter as |q| against x
 * negated where q < 0 (AVX-512 has no vpsignb; where q is 0 its magnitude zeroes the product). */
static inline __attribute__((always_inline)) void i8_tile16(
    float *y, int64_t ldy, const int8_t *qx, const float *dx, const float *sx, const int32_t *ix, int64_t K,
    const uint8_t *wg, const int64_t gbytes, const int mr, const uint8_t *pf, const int type)
{
    const int64_t nb = K / QK, bytes = i8_block_bytes(type);
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 acc[I8_MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * bytes, *blk2 = blk + gbytes;
        if (pf != NULL)
            for (int o = 0; o < bytes; o += 64) {
                PREFETCH(pf + b * bytes + o);
                PREFETCH(pf + gbytes + b * bytes + o);
            }
        __m512i isum[I8_MR];
        if (type == TYPE_Q4_1_I8) {
            for (int r = 0; r < mr; r++) isum[r] = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
                const __m512i v = i8_pair(blk + 64 + 32 * t, blk2 + 64 + 32 * t);
                const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                for (int r = 0; r < mr; r++) {
                    const int8_t *xr = qx + r * K + b * QK + 8 * t;
                    isum[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(read_i32(xr))), hi,
                                                  _mm512_set1_epi32(read_i32(xr + 4)));
                }
            }
            const __m512 d = i8_pair_ps(blk, blk2), m = i8_pair_ps(blk + 32, blk2 + 32);
            for (int r = 0; r < mr; r++) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])),
                                         acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), acc[r]);
            }
            continue;
        }
        if (type == TYPE_Q8_0_I8) { /* q + 128, unsigned: the sums drop 128 * sum(qx) */
            for (int r = 0; r < mr; r++) isum[r] = _mm512_setzero_si512();
            for (int t = 0; t < 8; t++) {
                const __m512i v = i8_pair(blk + 32 + 32 * t, blk2 + 32 + 32 * t);
                for (int r = 0; r < mr; r++)
                    isum[r] = _mm512_dpbusd_epi32(isum[r], v, _mm512_set1_epi32(read_i32(qx + r * K + b * QK + 4 * t)));
            }
            const __m512 d = i8_pair_ps(blk, blk2);
            for (int r = 0; r < mr; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r], _mm512_set1_epi32(IX(ix, r, nb, b, 0)))),
                                         _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
            continue;
        }
        /* Q6_K_I8: two scales, a half of four vectors each; q + 32, unsigned */
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < mr; r++) isum[r] = _mm512_setzero_si512();
            for (int t = 4 * h; t < 4 * h + 4; t++) {
                const __m512i v = i8_pair(blk + 64 + 32 * t, blk2 + 64 + 32 * t);
                for (int r = 0; r < mr; r++)
                    isum[r] = _mm512_dpbusd_epi32(isum[r], v, _mm512_set1_epi32(read_i32(qx + r * K + b * QK + 4 * t)));
            }
            const __m512 d = i8_pair_ps(blk + 32 * h, blk2 + 32 * h);
            for (int r = 0; r < mr; r++)
                acc[r] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r], _mm512_set1_epi32(IX(ix, r, nb, b, 1 + h)))),
                    _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#endif
#else
static inline void i8_tile(float *y, int64_t ldy, const int8_t *qx, const float *dx, const float *sx,
                           const int32_t *ix, int64_t K, const uint8_t *wg, const int mr, const uint8_t *pf,
                           const int type) {
    (void)pf;
    (void)ix;
    const int64_t nb = K / QK, bytes = i8_block_bytes(type);
    for (int r = 0; r < mr; r++)
        for (int lane = 0; lane < I8_ROWS; lane++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = wg + b * bytes;
                const int8_t *xb = qx + r * K + b * QK;
                int32_t isum = 0;
                float d;
                memcpy(&d, blk + 4 * lane, 4);
                if (type == TYPE_Q8_0_I8) {
                    for (int j = 0; j < QK; j++) isum += (int8_t)blk[32 + 32 * (j / 4) + 4 * lane + j % 4] * xb[j];
                    acc += (float)isum * (d * dx[r * nb + b]);
                    continue;
                }
                if (type == TYPE_Q6_K_I8) { /* two halves of 16, a scale each (d0, then d1) */
                    for (int h = 0; h < 2; h++) {
                        isum = 0;
                        for (int j = 16 * h; j < 16 * h + 16; j++)
                            isum += (int8_t)blk[64 + 32 * (j / 4) + 4 * lane + j % 4] * xb[j];
                        memcpy(&d, blk + 32 * h + 4 * lane, 4);
                        acc += (float)isum * (d * dx[r * nb + b]);
                    }
                    continue;
                }
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = blk[64 + 32 * t + 4 * lane + i];
                        isum += (byte & 15) * xb[8 * t + i] + (byte >> 4) * xb[8 * t + 4 + i];
                    }
                float m;
                memcpy(&m, blk + 32 + 4 * lane, 4);
                acc += (float)isum * (d * dx[r * nb + b]);
                acc += m * sx[r * nb + b];
            }
            y[r * ldy + lane] = acc;
        }
}
#endif

#define I8_TILE_MR(mr_) \
    i8_tile(y + m0 * ldy, ldy, qx + m0 * K, dx + m0 * nb, sx + m0 * nb, ix + 3 * m0 * nb, K, wg, mr_, pf, type)
#define I8_TILE16_MR(mr_)                                                                                  \
    i8_tile16(y + m0 * ldy, ldy, qx + m0 * K, dx + m0 * nb, sx + m0 * nb, ix + 3 * m0 * nb, K, wg,              \
              nb * i8_block_bytes(type), mr_, pf, type)

/* The 8 columns of y (from y) of `pair` = 1 group, or the 16 of `pair` = 2 neighbouring ones (with
 * I8_ZMM), for all M rows of x; inlined with a constant type (an OpenMP region's body gets its
 * arguments as variables: the type is made a constant again inside it). */
static inline __attribute__((always_inline)) void i8_group(float *y, int64_t ldy, const int8_t *qx, const float *dx,
                                                          const float *sx, const int32_t *ix, int64_t M, int64_t K,
                                                          const uint8_t *wg, const int pair, const uint8_t *next,
                                                          const int type)
{
    const int64_t nb = K / QK;
    for (int64_t m0 = 0; m0 < M; m0 += I8_MR) {
        /* the next groups' weights are read ahead while the first rows of x go through these */
        const uint8_t *pf = m0 == 0 ? next : NULL;
        const int mr = M - m0 < I8_MR ? (int)(M - m0) : I8_MR;
#if defined(I8_ZMM)
        if (pair == 2) {
            switch (mr) {
            case 4: I8_TILE16_MR(4); break;
            case 3: I8_TILE16_MR(3); break;
            case 2: I8_TILE16_MR(2); break;
            default: I8_TILE16_MR(1); break;
            }
            continue;
        }
#endif
        (void)pair;
        switch (mr) {
        case 4: I8_TILE_MR(4); break;
        case 3: I8_TILE_MR(3); break;
        case 2: I8_TILE_MR(2); break;
        default: I8_TILE_MR(1); break;
        }
    }
}

/* quant_matmul for Q4_1_I8 / Q8_0_I8 / Q6_K_I8 weights (N a multiple of 8). Returns 0, or -1 where x's quantized
 * copy could not be allocated. */
static int matmul_i8(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *w, int64_t M, int64_t N,
                     int64_t K, int num_threads, int type)
{
    const int64_t nb = K / QK, groups = N / I8_ROWS, bytes = i8_block_bytes(type);
    int8_t *qx = aligned_alloc(64, (size_t)(M * K + 64));
    float *dx = aligned_alloc(64, sizeof(float) * (size_t)(5 * M * nb + 16));
    if (qx == NULL || dx == NULL) {
        free(qx);
        free(dx);
        return -1;
    }
    float *sx = dx + M * nb;
    int32_t *ix = (int32_t *)(sx + M * nb);
#if defined(I8_ZMM)
    const int per_unit = 2; /* groups a tile takes: a pair, and the last one alone where they are odd */
#else
    const int per_unit = 1;
#endif
    const int64_t units = (groups + per_unit - 1) / per_unit;
    if (num_threads > units) num_threads = (int)units;
    #pragma omp parallel num_threads(num_threads)
    {
    /* x's rows quantized by the same threads first (a step's worth is ~1.5 ms on one AVX2 core at 32
     * rows), then the groups of weights */
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_row_q8(qx + m * K, dx + m * nb, sx + m * nb, ix + 3 * m * nb, x + m * ldx, K);
    #pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const int64_t g = u * per_unit;
        const int pair = g + per_unit <= groups ? per_unit : 1;
        const uint8_t *wg = w + g * nb * bytes, *next = g + pair < groups ? wg + pair * nb * bytes : NULL;
        if (type == TYPE_Q8_0_I8)
            i8_group(y + g * I8_ROWS, ldy, qx, dx, sx, ix, M, K, wg, pair, next, TYPE_Q8_0_I8);
        else if (type == TYPE_Q6_K_I8)
            i8_group(y + g * I8_ROWS, ldy, qx, dx, sx, ix, M, K, wg, pair, next, TYPE_Q6_K_I8);
        else
            i8_group(y + g * I8_ROWS, ldy, qx, dx, sx, ix, M, K, wg, pair, next, TYPE_Q4_1_I8);
    }
    }
    free(qx);
    free(dx);
    return 0;
}

/* Whether the build's I8 sums take VNNI's vpdpbusd (1), AVX2's vpmaddubsw (2) or plain C (0). */
int quant_matmul_i8_path(void) {
#if defined(I8_ZMM)
    return 3;
#elif defined(I8_VNNI)
    return 1;
#elif defined(__AVX2__)
    return 2;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------------ entry points */

/* y[m][n] = sum_k x[m][k] * W[n][k] for m < M, n < N. x: [M, K] rows ldx floats apart; y: rows ldy
 * apart; w: N rows of row_bytes; K a multiple of 32. Threads split the panels of NR rows. */
void quant_matmul(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                  int64_t M, int64_t N, int64_t K, int type, int num_threads)
{
    if (IS_I8(type)) {
        if (matmul_i8(y, ldy, x, ldx, w, M, N, K, num_threads, type) == 0) return;
        /* no memory for x's quantized copy: the float32 products over the exact weights, a row at a time */
        float *row = aligned_alloc(64, sizeof(float) * (size_t)K);
        for (int64_t n = 0; n < N && row != NULL; n++) {
            i8_dequantize_row(row, w, row_bytes, n, K, type);
            for (int64_t m = 0; m < M; m++) {
                float sum = 0.0f;
                for (int64_t k = 0; k < K; k++) sum += x[m * ldx + k] * row[k];
                y[m * ldy + n] = sum;
            }
        }
        free(row);
        return;
    }
#if defined(BF16_DOT)
    if (type == TYPE_BF16 && row_bytes == 2 * K && matmul_bf16(y, ldy, x, ldx, (const uint16_t *)w, M, N, K,
                                                                num_threads) == 0)
        return;
#endif
    const int64_t panels = (N + NR - 1) / NR;
    if (num_threads > panels) num_threads = (int)panels;
    #pragma omp parallel num_threads(num_threads)
    {
        float *buf = M > MR ? aligned_alloc(64, sizeof(float) * NR * K) : NULL;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = p * NR;
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            /* the panel PF_PANELS ahead, or this one near the end (a prefetch never faults, but
             * one past the last panel would only waste a read) */
            const uint8_t *pf = w + (p + PF_PANELS < panels ? n0 + PF_PANELS * NR : n0) * row_bytes;
            if (M <= MR) {
                tile_blocks_any(y + n0, ldy, x, ldx, w + n0 * row_bytes, row_bytes, K, (int)M, nr, type, pf);
                continue;
            }
            for (int64_t o = 0; o < NR * row_bytes; o += 64) PREFETCH(pf + o);
            for (int c = 0; c < nr; c++) dequantize_row(buf + c * K, w + (n0 + c) * row_bytes, K, type);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int mr = M - m0 < MR ? (int)(M - m0) : MR;
                tile_any(y + m0 * ldy + n0, ldy, x + m0 * ldx, ldx, buf, K, mr, nr);
            }
        }
        free(buf);
    }
}

/* out[n][k] = W[n][k] as float32, out rows K floats apart: for large M, where a float32 GEMM
 * over the dequantized weight beats the tiles. */
void quant_dequantize(float *out, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, int type,
                      int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        if (IS_I8(type))
            i8_dequantize_row(out + n * K, w, row_bytes, n, K, type);
        else
            dequantize_row(out + n * K, w + n * row_bytes, K, type);
    }
}

/* ------------------------------------------------------------------------------ packed Q4_1
 *
 * The layers' Q4_1 weights repacked at load so that a vector's lanes are output rows, not weights
 * of one row (llama.cpp repacks its weights for the same reason). A panel is PANEL = 16 rows; for
 * each block b of 32 columns it holds 320 bytes, the same as its 16 rows' file blocks:
 *
 *   16 f16 d (row r at r) | 16 f16 m | 16 groups j < 16 of 16 bytes: byte r = the file's qs[j] of row r
 *
 * so a group's byte r carries row r's weights j (low nibble) and j + 16 (high nibble). One vector
 * then dequantizes the weight at column 32b + j of 16 (or 8) rows with one FMA, exactly as in
 * file order (d * q + m rounded once), and every x value is one broadcast: no horizontal sums, no
 * shuffles within a row, and the nibble-to-float step is one table lookup (vpermps) on AVX-512.
 * Panels are padded to a whole number of GROUP_ROWS rows with zero rows (d = m = 0).
 *
 * Each output row sums its products in one fixed order, whatever M and whichever path: columns
 * 32b + j (j < 16) into one accumulator, 32b + j + 16 into another, for b and j ascending, then
 * the two added. So a request's logits do not depend on the batch it is in. */

#define PANEL 16
#define PANEL_BLOCK_BYTES (PANEL * 20)
#define GROUP_VECS 2                       /* vectors of rows a group computes at once */
#define GROUP_ROWS (GROUP_VECS * VL)       /* 32 rows (AVX-512), 16 (AVX2, portable) */
#define PMR 4                              /* rows of x per register tile */

#define PACK_ROWS 32 /* every build pads to the widest group, so one packing serves them all */
int64_t quant_packed_rows(int64_t n) { return (n + PACK_ROWS - 1) / PACK_ROWS * PACK_ROWS; }

int64_t quant_packed_bytes(int64_t n, int64_t k) { return quant_packed_rows(n) / PANEL * (k / QK) * PANEL_BLOCK_BYTES; }

/* src: N rows of Q4_1 blocks (row_bytes apart) -> dst: quant_packed_bytes(N, K) bytes. */
void quant_pack_q4_1(uint8_t *dst, const uint8_t *src, int64_t row_bytes, int64_t N, int64_t K) {
    const int64_t nb = K / QK, panels = quant_packed_rows(N) / PANEL;
    memset(dst, 0, (size_t)quant_packed_bytes(N, K));
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + (p * nb + b) * PANEL_BLOCK_BYTES;
            for (int r = 0; r < PANEL && p * PANEL + r < N; r++) {
                const uint8_t *blk = src + (p * PANEL + r) * row_bytes + b * 20;
                memcpy(out + 2 * r, blk, 2);
                memcpy(out + 32 + 2 * r, blk + 2, 2);
                for (int j = 0; j < 16; j++) out[64 + 16 * j + r] = blk[4 + j];
            }
        }
}

/* Where the group's vector u (rows GROUP_ROWS * g + VL * u ..) reads block b: its d at D(), its m
 * at M(), its bytes of group j at Q(j); a vector covers lanes `off` .. off + VL of a panel. */
typedef struct { const uint8_t *panel; int off; } unit_ptr;
static inline unit_ptr unit_at(const uint8_t *packed, int64_t nb, int64_t g, int u, int64_t b) {
    const int64_t row0 = g * GROUP_ROWS + (int64_t)u * VL;
    unit_ptr p = {packed + ((row0 / PANEL) * nb + b) * PANEL_BLOCK_BYTES, (int)(row0 % PANEL)};
    return p;
}
#define UNIT_D(p) ((p).panel + 2 * (p).off)
#define UNIT_M(p) ((p).panel + 32 + 2 * (p).off)
#define UNIT_Q(p, j) ((p).panel + 64 + 16 * (j) + (p).off)

#if ISA == 512
static inline vec load_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* lanes' weights at columns j and j + 16 from the VL bytes at p */
static inline void unit_weights(vec *lo, vec *hi, const uint8_t *p, vec d, vec m) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(bytes, iota), d, m); /* vpermps reads the low 4 bits */
    *hi = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), iota), d, m);
}
static inline vec VBCAST(const float *p) { return _mm512_set1_ps(*p); }
static inline vec VADD(vec a, vec b) { return _mm512_add_ps(a, b); }
#elif ISA == 256
static inline vec load_f16(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void unit_weights(vec *lo, vec *hi, const uint8_t *p, vec d, vec m) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))), d, m);
    *hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), d, m);
}
static inline vec VBCAST(const float *p) { return _mm256_set1_ps(*p); }
static inline vec VADD(vec a, vec b) { return _mm256_add_ps(a, b); }
#else
static inline vec load_f16(const uint8_t *p) {
    vec r;
    for (int i = 0; i < VL; i++) r.v[i] = f16_to_f32(read_u16(p + 2 * i));
    return r;
}
static inline void unit_weights(vec *lo, vec *hi, const uint8_t *p, vec d, vec m) {
    for (int i = 0; i < VL; i++) {
        lo->v[i] = d.v[i] * (float)(p[i] & 15) + m.v[i];
        hi->v[i] = d.v[i] * (float)(p[i] >> 4) + m.v[i];
    }
}
static inline vec VBCAST(const float *p) { vec r; for (int i = 0; i < VL; i++) r.v[i] = *p; return r; }
static inline vec VADD(vec a, vec b) { for (int i = 0; i < VL; i++) a.v[i] += b.v[i]; return a; }
#endif

/* Rows GROUP_ROWS * g .. of y for mr (<= PMR) rows of x, dequantizing in registers (small M). */
static inline __attribute__((always_inline)) void packed_tile_direct(
    float out[PMR][GROUP_ROWS], const float *x, int64_t ldx, const uint8_t *packed, int64_t nb, int64_t g, const int mr)
{
    vec lo_acc[PMR][GROUP_VECS], hi_acc[PMR][GROUP_VECS];
    for (int r = 0; r < mr; r++)
        for (int u = 0; u < GROUP_VECS; u++) lo_acc[r][u] = hi_acc[r][u] = VZERO();
    for (int64_t b = 0; b < nb; b++) {
        unit_ptr at[GROUP_VECS];
        vec d[GROUP_VECS], m[GROUP_VECS];
        for (int u = 0; u < GROUP_VECS; u++) {
            at[u] = unit_at(packed, nb, g, u, b);
            d[u] = load_f16(UNIT_D(at[u]));
            m[u] = load_f16(UNIT_M(at[u]));
        }
        const float *xb = x + b * QK;
        for (int j = 0; j < 16; j++)
            for (int u = 0; u < GROUP_VECS; u++) {
                vec lo, hi;
                unit_weights(&lo, &hi, UNIT_Q(at[u], j), d[u], m[u]);
                for (int r = 0; r < mr; r++) {
                    lo_acc[r][u] = VFMA(VBCAST(xb + r * ldx + j), lo, lo_acc[r][u]);
                    hi_acc[r][u] = VFMA(VBCAST(xb + r * ldx + j + 16), hi, hi_acc[r][u]);
                }
            }
    }
    for (int r = 0; r < mr; r++)
        for (int u = 0; u < GROUP_VECS; u++) vstore(out[r] + u * VL, VADD(lo_acc[r][u], hi_acc[r][u]));
}

/* The group's weights as float32, column-major: buf[k][GROUP_ROWS] (for M > PMR: once per group). */
static void packed_group_dequantize(float *buf, const uint8_t *packed, int64_t nb, int64_t g) {
    for (int64_t b = 0; b < nb; b++)
        for (int u = 0; u < GROUP_VECS; u++) {
            const unit_ptr at = unit_at(packed, nb, g, u, b);
            const vec d = load_f16(UNIT_D(at)), m = load_f16(UNIT_M(at));
            for (int j = 0; j < 16; j++) {
                vec lo, hi;
                unit_weights(&lo, &hi, UNIT_Q(at, j), d, m);
                vstore(buf + (b * QK + j) * GROUP_ROWS + u * VL, lo);
                vstore(buf + (b * QK + j + 16) * GROUP_ROWS + u * VL, hi);
            }
        }
}

/* The same sums as packed_tile_direct, over the group's dequantized weights in buf. */
static inline __attribute__((always_inline)) void packed_tile_buffered(
    float out[PMR][GROUP_ROWS], const float *x, int64_t ldx, const float *buf, int64_t nb, const int mr)
{
    vec lo_acc[PMR][GROUP_VECS], hi_acc[PMR][GROUP_VECS];
    for (int r = 0; r < mr; r++)
        for (int u = 0; u < GROUP_VECS; u++) lo_acc[r][u] = hi_acc[r][u] = VZERO();
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK, *wb = buf + b * QK * GROUP_ROWS;
        for (int j = 0; j < 16; j++)
            for (int u = 0; u < GROUP_VECS; u++) {
                const vec lo = VLOAD(wb + j * GROUP_ROWS + u * VL), hi = VLOAD(wb + (j + 16) * GROUP_ROWS + u * VL);
                for (int r = 0; r < mr; r++) {
                    lo_acc[r][u] = VFMA(VBCAST(xb + r * ldx + j), lo, lo_acc[r][u]);
                    hi_acc[r][u] = VFMA(VBCAST(xb + r * ldx + j + 16), hi, hi_acc[r][u]);
                }
            }
    }
    for (int r = 0; r < mr; r++)
        for (int u = 0; u < GROUP_VECS; u++) vstore(out[r] + u * VL, VADD(lo_acc[r][u], hi_acc[r][u]));
}

#define PACKED_MR(fn, ...) \
    switch (mr) { \
    case 4: fn(__VA_ARGS__, 4); break; \
    case 3: fn(__VA_ARGS__, 3); break; \
    case 2: fn(__VA_ARGS__, 2); break; \
    default: fn(__VA_ARGS__, 1); break; \
    }

/* y[m][n] = sum_k x[m][k] * W[n][k], W packed by quant_pack_q4_1 (N rows, K columns). Threads split
 * the groups of GROUP_ROWS rows. */
void quant_matmul_packed(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *packed,
                         int64_t M, int64_t N, int64_t K, int num_threads)
{
    const int64_t nb = K / QK, groups = (N + GROUP_ROWS - 1) / GROUP_ROWS; /* of the packing's padding, only what N needs */
    if (num_threads > groups) num_threads = (int)groups;
    #pragma omp parallel num_threads(num_threads)
    {
        float *buf = M > PMR ? aligned_alloc(64, sizeof(float) * GROUP_ROWS * K) : NULL;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * GROUP_ROWS;
            const int nr = N - n0 < GROUP_ROWS ? (int)(N - n0) : GROUP_ROWS;
            if (M > PMR) packed_group_dequantize(buf, packed, nb, g);
            for (int64_t m0 = 0; m0 < M; m0 += PMR) {
                const int mr = M - m0 < PMR ? (int)(M - m0) : PMR;
                float out[PMR][GROUP_ROWS] __attribute__((aligned(64)));
                if (M > PMR) {
                    PACKED_MR(packed_tile_buffered, out, x + m0 * ldx, ldx, buf, nb);
                } else {
                    PACKED_MR(packed_tile_direct, out, x + m0 * ldx, ldx, packed, nb, g);
                }
                for (int r = 0; r < mr; r++) memcpy(y + (m0 + r) * ldy + n0, out[r], sizeof(float) * nr);
            }
        }
        free(buf);
    }
}

/* out[n][k] = W[n][k] as float32 (rows K floats apart) from the packed weight: for large M. */
void quant_dequantize_packed(float *out, const uint8_t *packed, int64_t N, int64_t K, int num_threads) {
    const int64_t nb = K / QK, groups = (N + GROUP_ROWS - 1) / GROUP_ROWS; /* of the packing's padding, only what N needs */
    if (num_threads > groups) num_threads = (int)groups;
    #pragma omp parallel num_threads(num_threads)
    {
        float *buf = aligned_alloc(64, sizeof(float) * GROUP_ROWS * K);
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            packed_group_dequantize(buf, packed, nb, g);
            const int64_t n0 = g * GROUP_ROWS;
            for (int64_t n = n0; n < N && n < n0 + GROUP_ROWS; n++)
                for (int64_t k = 0; k < K; k++) out[n * K + k] = buf[k * GROUP_ROWS + (n - n0)];
        }
        free(buf);
    }
}
