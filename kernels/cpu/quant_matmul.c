/*
 * y = x @ W^T with W kept in a GGUF file's blocks, x and y float32 (kernels/cpu_quant_matmul.py).
 *
 * Row n of W is K / 32 blocks of one type (ggml's layouts; values are exact in float32):
 *
 *   Q4_1 (type 3, 20 bytes)  f16 d | f16 m | 16 bytes qs    w[j] = d * q[j] + m, q[j] in 0..15:
 *                            q[j] = qs[j] & 15 for j < 16, qs[j - 16] >> 4 for j >= 16
 *   Q8_0 (type 8, 34 bytes)  f16 d | 32 int8 qs             w[j] = d * qs[j]
 *   F16  (type 1, 64 bytes)  32 f16                          w[j] = (float) h[j]
 *
 * d * q is exact in float32 (an 11-bit mantissa times at most 8 bits), so d * q + m rounds once,
 * whether by an FMA or by a multiply and an add: the weights used are bit for bit those of gguf's
 * `dequantize` (what transformers converts a GGUF with). Only the order of the sum over K differs
 * from a float32 matmul over the dequantized weights; the activations are never quantized.
 *
 * The work is cut into panels of NR output rows: a thread dequantizes a panel's rows into a small
 * float32 buffer (L1/L2), then runs one MR x NR tile of dot products per MR rows of x over it. So
 * each weight is read from memory and dequantized once per call, whatever M, and each x chunk
 * loaded serves NR rows. The vector path is chosen when the file is compiled (AVX-512F, or AVX2 +
 * FMA + F16C; else portable C): `quant_matmul_isa` says which.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { TYPE_F16 = 1, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8 };
#define QK 32 /* weights per block, all three types */
#define NR 4  /* output rows per panel */

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

int64_t quant_block_bytes(int type) {
    switch (type) {
    case TYPE_F16: return 2 * QK;
    case TYPE_Q4_1: return 4 + QK / 2;
    case TYPE_Q8_0: return 2 + QK;
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
        const float d = f16_to_f32(read_u16(src));
        const int8_t *qs = (const int8_t *)(src + 2);
#if ISA == 512
        const __m512 vd = _mm512_set1_ps(d);
        for (int i = 0; i < 2; i++)
            out[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * i)))), vd);
#elif ISA == 256
        const __m256 vd = _mm256_set1_ps(d);
        for (int i = 0; i < 4; i++)
            out[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * i)))), vd);
#else
        for (int j = 0; j < QK; j++) out[j / VL].v[j % VL] = d * (float)qs[j];
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
    }
}

/* ------------------------------------------------------------------------------ the tiles */

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
        for (int c = 0; c < nr; c++) wv[c] = VLOAD(w + c * k + i);
        for (int r = 0; r < mr; r++) {
            const vec xv = VLOAD(x + r * ldx + i);
            for (int c = 0; c < nr; c++) acc[r][c] = VFMA(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) y[r * ldy + c] = VSUM(acc[r][c]);
}

/* The same tile straight from the blocks (rows row_bytes apart), each block dequantized in
 * registers: for M <= MR, where a panel's weights serve one tile only and a buffer would be a
 * store and a load more per weight. Same sum order as `tile`. */
static inline __attribute__((always_inline)) void tile_blocks(
    float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t k,
    const int mr, const int nr, const int type, const int64_t block_bytes)
{
    vec acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) acc[r][c] = VZERO();
    for (int64_t b = 0; b < k / QK; b++) {
        for (int c = 0; c < nr; c++) {
            vec wv[NV];
            load_block(wv, w + c * row_bytes + b * block_bytes, type);
            for (int i = 0; i < NV; i++)
                for (int r = 0; r < mr; r++) acc[r][c] = VFMA(VLOAD(x + r * ldx + b * QK + i * VL), wv[i], acc[r][c]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) y[r * ldy + c] = VSUM(acc[r][c]);
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
    case 4: tile_blocks(y, ldy, x, ldx, w, row_bytes, k, mr_, 4, type_, bytes_); break; \
    case 3: tile_blocks(y, ldy, x, ldx, w, row_bytes, k, mr_, 3, type_, bytes_); break; \
    case 2: tile_blocks(y, ldy, x, ldx, w, row_bytes, k, mr_, 2, type_, bytes_); break; \
    default: tile_blocks(y, ldy, x, ldx, w, row_bytes, k, mr_, 1, type_, bytes_); break; \
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
                            int64_t k, int mr, int nr, int type) {
    switch (type) {
    case TYPE_Q4_1: BLOCKS_MR(TYPE_Q4_1, 20); break;
    case TYPE_Q8_0: BLOCKS_MR(TYPE_Q8_0, 34); break;
    case TYPE_F16: BLOCKS_MR(TYPE_F16, 64); break;
    }
}

/* ------------------------------------------------------------------------------ entry points */

/* y[m][n] = sum_k x[m][k] * W[n][k] for m < M, n < N. x: [M, K] rows ldx floats apart; y: rows ldy
 * apart; w: N rows of row_bytes; K a multiple of 32. Threads split the panels of NR rows. */
void quant_matmul(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                  int64_t M, int64_t N, int64_t K, int type, int num_threads)
{
    const int64_t panels = (N + NR - 1) / NR;
    if (num_threads > panels) num_threads = (int)panels;
    #pragma omp parallel num_threads(num_threads)
    {
        float *buf = M > MR ? aligned_alloc(64, sizeof(float) * NR * K) : NULL;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = p * NR;
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            if (M <= MR) {
                tile_blocks_any(y + n0, ldy, x, ldx, w + n0 * row_bytes, row_bytes, K, (int)M, nr, type);
                continue;
            }
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
    for (int64_t n = 0; n < N; n++) dequantize_row(out + n * K, w + n * row_bytes, K, type);
}
