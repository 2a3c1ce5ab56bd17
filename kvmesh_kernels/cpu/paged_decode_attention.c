/*
 * Paged attention for the CPU, one query token per row against its context in the paged KV cache:
 * a decode, or one token of a prefill chunk (its context ends at its own position: causal), so that
 * a step's decodes and prefill chunks are attended in one call, with no per-request loop.
 *
 * Cache layout (services/worker/kv_cache.py): K and V are each [num_blocks, block_size, Hkv, D].
 * Row b attends the first seq_lens[b] tokens of request r = seq_of_row ? seq_of_row[b] : b, whose
 * token t lives in block block_table[r][t / block_size], row t % block_size.
 * Work is split over (kv head, tile), a tile being one row or, in the vector path, a run of one
 * request's consecutive prefill rows or a few decodes whose requests share their first blocks (a
 * prompt prefix from the prefix cache: cascade attention, the prefix read once for them all); each
 * item reads its context once and serves the H / Hkv query heads that share that kv head (GQA) in
 * each of its rows, with an online softmax in float32. Items of one kv head are handed out together.
 * dtype: 0 = float32, 1 = bfloat16, 2 = float16 (q, cache and out share it); the arithmetic is float32
 * in all three, a bfloat16 or float16 row made float32 as it is loaded. prefill_bf16 (where the build
 * has AVX512_BF16: prefill_bf16_built) multiplies prefill tiles' operands in bfloat16 instead.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

#define MAX_GROUP 16
#define MAX_HEAD 256
#define MAX_BLOCK 128
/* (row, query head) pairs of one vector-path tile: a prefill tile takes MAX_ROWS / group rows. */
#define MAX_ROWS 32
/* Below this many K/V rows to read, a call runs on one thread. Reading the cache is bound by one core's
 * memory bandwidth: eight decodes of ~150 tokens (1,200 rows) took 5.4 ms a step on one thread, 3.1 on two. */
#define PARALLEL_MIN_KV_ROWS 1024
/* Decodes of different requests share a tile from this many common full blocks at the start of their
 * block tables (a prompt prefix the prefix cache gave them all). */
#define MIN_SHARED_BLOCKS 4

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

static inline void load_row(const void *base, int64_t index, int dtype, int d, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + index, sizeof(float) * d);
    } else if (dtype == 2) {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int i = 0; i < d; i++) dst[i] = f16_to_f32(src[i]);
    } else {
        /* bf16 -> f32 is a 16-bit shift; written on integers so the compiler vectorizes it. */
        const uint16_t *src = (const uint16_t *)base + index;
        uint32_t *bits = (uint32_t *)dst;
        for (int i = 0; i < d; i++) bits[i] = ((uint32_t)src[i]) << 16;
    }
}

/* Row `o` of out from float32 values: rounded to nearest even for bfloat16 and float16. */
static inline void store_row(void *out, int64_t o, int dtype, int d, const float *values, float scale) {
    if (dtype == 0) {
        for (int i = 0; i < d; i++) ((float *)out)[o + i] = values[i] * scale;
    } else if (dtype == 2) {
        for (int i = 0; i < d; i++) ((uint16_t *)out)[o + i] = f32_to_f16(values[i] * scale);
    } else {
        for (int i = 0; i < d; i++) ((uint16_t *)out)[o + i] = f32_to_bf16(values[i] * scale);
    }
}

/* Element index of position t's K (or V) row for kv head kvh, in a cache of [blocks, block_size, Hkv, D]. */
static inline int64_t kv_row(const int32_t *blocks, int t, int block_size, int64_t row_stride, int kvh, int head_size)
{
    return ((int64_t)blocks[t / block_size] * block_size + t % block_size) * row_stride + (int64_t)kvh * head_size;
}

/* kv_row of positions t0 .. t0 + n - 1, one division for them all (a division per row was a tenth of
 * a prefill tile's own loop). */
static inline void kv_rows(int64_t *index, const int32_t *blocks, int t0, int n, int block_size, int64_t row_stride,
                           int kvh, int head_size)
{
    int b = t0 / block_size, o = t0 % block_size;
    for (int t = 0; t < n; t++) {
        index[t] = ((int64_t)blocks[b] * block_size + o) * row_stride + (int64_t)kvh * head_size;
        if (++o == block_size) {
            o = 0;
            b++;
        }
    }
}

/* Asks for the K and V rows at element index `index` (elem bytes an element) ahead of their use. */
static inline void prefetch_kv_row(const void *k_cache, const void *v_cache, int64_t index, int head_size, int elem)
{
    for (int64_t o = 0; o < (int64_t)head_size * elem; o += 64) {
        __builtin_prefetch((const char *)k_cache + index * elem + o, 0, 3);
        __builtin_prefetch((const char *)v_cache + index * elem + o, 0, 3);
    }
}

/* One (sequence, kv head) item. Inlined with a constant head_size so the loops over it vectorize. */
static inline __attribute__((always_inline)) void attend_item(
    void *out, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *blocks, int seq_len, int b, int kvh, int group, const int head_size,
    int block_size, float scale, int sliding_window, float soft_cap, int dtype,
    int64_t q_stride, int64_t out_stride, int64_t row_stride)
{
    float qv[MAX_GROUP][MAX_HEAD], acc[MAX_GROUP][MAX_HEAD], kv[MAX_HEAD];
    float m[MAX_GROUP], l[MAX_GROUP];
    const int start = sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
    for (int g = 0; g < group; g++) {
        load_row(q, b * q_stride + (int64_t)(kvh * group + g) * head_size, dtype, head_size, qv[g]);
        m[g] = -INFINITY;
        l[g] = 0.f;
        for (int i = 0; i < head_size; i++) acc[g][i] = 0.f;
    }
    /* A block's positions at a time: scores first, then one rescale of the running sums. */
    for (int t0 = start; t0 < seq_len; t0 = (t0 / block_size + 1) * block_size) {
        const int t1 = (t0 / block_size + 1) * block_size < seq_len ? (t0 / block_size + 1) * block_size : seq_len;
        const int64_t block_base = (int64_t)blocks[t0 / block_size] * block_size;
        float s[MAX_BLOCK][MAX_GROUP];
        float block_max[MAX_GROUP];
        for (int g = 0; g < group; g++) block_max[g] = -INFINITY;
        for (int t = t0; t < t1; t++) {
            load_row(k_cache, (block_base + t % block_size) * row_stride + (int64_t)kvh * head_size,
                     dtype, head_size, kv);
            for (int g = 0; g < group; g++) {
                float dot = 0.f;
                for (int i = 0; i < head_size; i++) dot += qv[g][i] * kv[i];
                dot *= scale;
                if (soft_cap > 0.f) dot = soft_cap * tanhf(dot / soft_cap);
                s[t - t0][g] = dot;
                block_max[g] = dot > block_max[g] ? dot : block_max[g];
            }
        }
        for (int g = 0; g < group; g++) {
            if (block_max[g] > m[g]) {
                const float correction = expf(m[g] - block_max[g]);
                l[g] *= correction;
                for (int i = 0; i < head_size; i++) acc[g][i] *= correction;
                m[g] = block_max[g];
            }
        }
        for (int t = t0; t < t1; t++) {
            load_row(v_cache, (block_base + t % block_size) * row_stride + (int64_t)kvh * head_size,
                     dtype, head_size, kv);
            for (int g = 0; g < group; g++) {
                const float p = expf(s[t - t0][g] - m[g]);
                l[g] += p;
                for (int i = 0; i < head_size; i++) acc[g][i] += p * kv[i];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        store_row(out, b * out_stride + (int64_t)(kvh * group + g) * head_size, dtype, head_size, acc[g], inv);
    }
}

/*
 * The vector path, one body for two instruction sets chosen when the library is built (the build
 * is for the CPU it runs on, kvmesh_kernels/native.py): AVX-512 (W = 16 lanes) or AVX2 + FMA (W = 8), the
 * latter being what most cloud x86 VMs offer. Each (tile, kv head) item walks its context in
 * chunks of up to W positions (never across a block), asking for the next chunk's rows while it
 * computes one (they are strided: a miss at a time otherwise): bfloat16 K and V rows of a chunk are
 * made float32 once (a 16-bit shift) into buffers that stay in L1, float32 ones are read where they
 * lie; then the query heads of a row take, side by side, their W scores (the W dot products summed
 * across lanes together) and one vector exp each for the chunk, then their P·V accumulation in
 * registers, as many heads at once as the registers hold (V rows loaded once for them). The scalar
 * path above spends most of its time in one expf call per (position, head) and in accumulators that
 * live in memory. One layer of eight decodes at 1,550 tokens of context on one Zen 5 core: 1.15 ->
 * 0.71 ms; with a 1,500-token shared prefix 0.65 -> 0.34 ms; the AVX2 build 0.67 -> 0.55 ms since
 * its heads' scores went side by side too (docs/benchmarks/log.md).
 */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VECTOR_PATH 1
#include <immintrin.h>

#if defined(__AVX512F__)
#define W 16
#define ACC_REGS 16
typedef __m512 vf;
typedef __mmask16 vlive; /* the chunk's live lanes */
#define v_load _mm512_load_ps
#define v_loadu _mm512_loadu_ps
#define v_store _mm512_store_ps
#define v_storeu _mm512_storeu_ps
#define v_set1 _mm512_set1_ps
#define v_zero _mm512_setzero_ps
#define v_mul _mm512_mul_ps
#define v_sub _mm512_sub_ps
#define v_add _mm512_add_ps
#define v_max _mm512_max_ps
#define v_fmadd _mm512_fmadd_ps
#define v_fnmadd _mm512_fnmadd_ps
#define v_sum _mm512_reduce_add_ps
#define v_hmax _mm512_reduce_max_ps
#define v_round(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define v_scale2(p, n) _mm512_scalef_ps(p, n) /* p * 2^n */
static inline vlive v_live(int n) { return (vlive)((1u << n) - 1); }
static inline vf v_select(vlive live, vf v, vf fill) { return _mm512_mask_blend_ps(live, fill, v); }
/* Lanes where lo <= x < hi. */
static inline vlive v_within(vf x, vf lo, vf hi) {
    return _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(x, hi, _CMP_LT_OQ);
}
static inline vf v_load_row(const void *base, int64_t index, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + index);
    if (dtype == 2) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index)));
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#else
#define W 8
#define ACC_REGS 8
typedef __m256 vf;
typedef __m256 vlive; /* all-ones lanes where live */
#define v_load _mm256_load_ps
#define v_loadu _mm256_loadu_ps
#define v_store _mm256_store_ps
#define v_storeu _mm256_storeu_ps
#define v_set1 _mm256_set1_ps
#define v_zero _mm256_setzero_ps
#define v_mul _mm256_mul_ps
#define v_sub _mm256_sub_ps
#define v_add _mm256_add_ps
#define v_max _mm256_max_ps
#define v_fmadd _mm256_fmadd_ps
#define v_fnmadd _mm256_fnmadd_ps
#define v_round(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline float v_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float v_hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
/* p * 2^n for integral n in [-127, 127] (exp's argument is clamped above -87.3): n goes into the
 * exponent field of a float. */
static inline vf v_scale2(vf p, vf n) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline vlive v_live(int n) {
    const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    return _mm256_cmp_ps(lane, _mm256_set1_ps((float)n), _CMP_LT_OQ);
}
static inline vf v_select(vlive live, vf v, vf fill) { return _mm256_blendv_ps(fill, v, live); }
static inline vlive v_within(vf x, vf lo, vf hi) {
    return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), _mm256_cmp_ps(x, hi, _CMP_LT_OQ));
}
static inline vf v_load_row(const void *base, int64_t index, int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)base + index);
    if (dtype == 2) {
#if defined(__F16C__)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + index)));
#else
        float row[W] __attribute__((aligned(32)));
        load_row(base, index, dtype, W, row);
        return _mm256_load_ps(row);
#endif
    }
    const __m128i bits = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

/* exp(x) for x <= 0 (scores minus their running max): Cephes' expf polynomial, range-reduced by
 * ln 2 and scaled back by 2^n; relative error ~1e-7, exact 0 is not needed (masked). */
static inline vf v_exp(vf x) {
    x = v_max(x, v_set1(-87.3f));
    const vf n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
    vf r = v_fnmadd(n, v_set1(0.693359375f), x);
    r = v_fnmadd(n, v_set1(-2.12194440e-4f), r);
    vf p = v_set1(1.9875691500e-4f);
    p = v_fmadd(p, r, v_set1(1.3981999507e-3f));
    p = v_fmadd(p, r, v_set1(8.3334519073e-3f));
    p = v_fmadd(p, r, v_set1(4.1665795894e-2f));
    p = v_fmadd(p, r, v_set1(1.6666665459e-1f));
    p = v_fmadd(p, r, v_set1(5.0000001201e-1f));
    p = v_fmadd(v_mul(p, r), r, v_add(r, v_set1(1.f)));
    return v_scale2(p, n);
}

/* Lanes a <= lane < b of a chunk (0 <= a < b <= W). */
#if W == 16
static inline vlive v_live_range(int a, int b) { return (vlive)(((1u << b) - 1) & ~((1u << a) - 1)); }
#else
static inline vlive v_live_range(int a, int b) {
    const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    return _mm256_and_ps(_mm256_cmp_ps(lane, _mm256_set1_ps((float)a), _CMP_GE_OQ),
                         _mm256_cmp_ps(lane, _mm256_set1_ps((float)b), _CMP_LT_OQ));
}
#endif

/* The scores q . k of chunk positions a <= t < e as one vector (other lanes: anything finite or not,
 * the caller masks them); position t's K row starts at kb + t * ks. The W dot products are summed
 * across lanes together, a transpose-and-add tree: AVX2 ~11 instructions for 8 positions, AVX-512
 * 45 for 16, against ~6 and ~10 a position summed one at a time. */
/* d[t] = q * k_t lane by lane for the chunk's positions a <= t < e, zero elsewhere. AVX2 takes a vector
 * of q at a time against every position's, so the W sums are W independent FMA chains and q one
 * register (its 16 hold the W sums beside it; q whole beside them spilled); AVX-512 keeps q in
 * registers. Each sum is q_0 k_0 + q_1 k_1 + ... in that order either way (an FMA onto zero is the
 * product). */
static inline __attribute__((always_inline)) void v_dots(vf d[W], const float *q, const float *kb, int64_t ks, int a,
                                                         int e, const int C) {
#if W == 8
    for (int t = 0; t < W; t++) d[t] = v_zero();
    if (a == 0 && e == W) { /* a whole chunk (all but a prefill's diagonal and a context's ends): no tests */
        for (int c = 0; c < C; c++) {
            const vf qc = v_load(q + W * c);
            for (int t = 0; t < W; t++) d[t] = v_fmadd(qc, v_loadu(kb + t * ks + W * c), d[t]);
        }
        return;
    }
    for (int c = 0; c < C; c++) {
        const vf qc = v_load(q + W * c);
        for (int t = 0; t < W; t++)
            if (t >= a && t < e) d[t] = v_fmadd(qc, v_loadu(kb + t * ks + W * c), d[t]);
    }
#else
    vf qr[MAX_HEAD / W];
    for (int c = 0; c < C; c++) qr[c] = v_load(q + W * c);
    for (int t = 0; t < W; t++) {
        if (t < a || t >= e) { d[t] = v_zero(); continue; }
        const float *k = kb + t * ks;
        d[t] = v_mul(qr[0], v_loadu(k));
        for (int c = 1; c < C; c++) d[t] = v_fmadd(qr[c], v_loadu(k + W * c), d[t]);
    }
#endif
}

#if W == 8
static inline __attribute__((always_inline)) vf v_scores(const float *q, const float *kb, int64_t ks, int a, int e, const int C) {
    vf d[8];
    v_dots(d, q, kb, ks, a, e, C);
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
    /* s0123 = [sums of the low halves of d0..d3 | of their high halves], likewise s4567. */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#else
/* Two vectors' 128-bit quarters combined: lanes 0-1 of the result from a, 2-3 from b, each the sum
 * of a pair of quarters (0+1, 2+3). */
static inline vf v_sum_quarters(vf a, vf b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
static inline __attribute__((always_inline)) vf v_scores(const float *q, const float *kb, int64_t ks, int a, int e, const int C) {
    vf d[16];
    v_dots(d, q, kb, ks, a, e, C);
    /* In each quarter: pairs (t, t + 1) interleaved, then quads (4j .. 4j + 3) holding their four
     * partial sums in order; then the quarters of four quads summed, in position order. */
    vf quad[4];
    for (int j = 0; j < 4; j++) {
        vf pair[2];
        for (int h = 0; h < 2; h++) {
            const vf x = d[4 * j + 2 * h], y = d[4 * j + 2 * h + 1];
            pair[h] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
        }
        const __m512d p0 = _mm512_castps_pd(pair[0]), p1 = _mm512_castps_pd(pair[1]);
        quad[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p0, p1)),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p1)));
    }
    return v_sum_quarters(v_sum_quarters(quad[0], quad[1]), v_sum_quarters(quad[2], quad[3]));
}
#endif

/* Query heads r0 .. r0 + hb - 1 of one row against chunk positions a <= t < e (K and V rows at kp, vp,
 * ks floats apart): scores, one rescale of each head's running sums, P.V. The heads' scores and exps
 * go side by side (independent chains: one head at a time waits on its own exp polynomial), then their
 * P.V in runs of as many heads as ACC_REGS accumulators hold (each V row loaded once for a run): on
 * AVX-512 the hb heads at once, on AVX2 (a head of 64 takes 8 of its 16 registers) one by one. A
 * head's softmax denominator is kept lane by lane and summed across lanes once, at the end: a
 * horizontal sum per chunk was a serial chain beside every 8 positions' 128 FMAs on AVX2. */
static inline __attribute__((always_inline)) void attend_heads(
    const float *kp, const float *vp, int64_t ks, int a, int e, vlive live, int r0, const int hb, const int C,
    float soft_cap, float (*qf)[MAX_HEAD], float (*acc)[MAX_HEAD], float *m, float (*l)[W])
{
    float ps[4][W] __attribute__((aligned(64)));
    float correction[4];
    for (int h = 0; h < hb; h++) {
        const int r = r0 + h;
        vf sv = v_scores(qf[r], kp, ks, a, e, C);
        if (soft_cap > 0.f) {
            v_store(ps[h], sv);
            for (int t = a; t < e; t++) ps[h][t] = soft_cap * tanhf(ps[h][t] / soft_cap);
            sv = v_load(ps[h]);
        }
        sv = v_select(live, sv, v_set1(-INFINITY));
        const float chunk_max = v_hmax(sv);
        correction[h] = 1.f;
        if (chunk_max > m[r]) {
            correction[h] = expf(m[r] - chunk_max);
            v_store(l[r], v_mul(v_load(l[r]), v_set1(correction[h])));
            m[r] = chunk_max;
        }
        const vf p = v_select(live, v_exp(v_sub(sv, v_set1(m[r]))), v_zero());
        v_store(l[r], v_add(v_load(l[r]), p)); /* lane by lane: summed across lanes once, at the end */
        v_store(ps[h], p);
    }
    const int run = ACC_REGS / C < 1 ? 1 : ACC_REGS / C;
    for (int h0 = 0; h0 < hb; h0 += run) {
        const int h1 = h0 + run < hb ? h0 + run : hb;
        vf ar[4][MAX_HEAD / W];
        for (int h = h0; h < h1; h++)
            for (int c = 0; c < C; c++) {
                ar[h - h0][c] = v_load(acc[r0 + h] + W * c);
                if (correction[h] != 1.f) ar[h - h0][c] = v_mul(ar[h - h0][c], v_set1(correction[h]));
            }
        for (int t = a; t < e; t++) {
            vf vr[MAX_HEAD / W];
            for (int c = 0; c < C; c++) vr[c] = v_loadu(vp + t * ks + W * c);
            for (int h = h0; h < h1; h++) {
                const vf pt = v_set1(ps[h][t]);
                for (int c = 0; c < C; c++) ar[h - h0][c] = v_fmadd(pt, vr[c], ar[h - h0][c]);
            }
        }
        for (int h = h0; h < h1; h++)
            for (int c = 0; c < C; c++) v_store(acc[r0 + h] + W * c, ar[h - h0][c]);
    }
}

/* The chunk of n positions from t0 (K and V rows at kp, vp, ks floats apart) for tile rows
 * i0 .. i1 - 1 and every query head of the group. */
static inline __attribute__((always_inline)) void attend_chunk(
    const float *kp, const float *vp, int64_t ks, int t0, int n, int i0, int i1, int group, const int C,
    float soft_cap, const int *lo, const int *hi, float (*qf)[MAX_HEAD], float (*acc)[MAX_HEAD], float *m, float (*l)[W])
{
    /* up to four heads' scores side by side (their P.V in runs that fit the registers: attend_heads) */
    const int most = 4;
    for (int i = i0; i < i1; i++) {
        if (hi[i] <= t0 || lo[i] >= t0 + n) continue; /* this chunk is outside the row's context */
        const int a = lo[i] > t0 ? lo[i] - t0 : 0, e = hi[i] - t0 < n ? hi[i] - t0 : n;
        const vlive live = v_live_range(a, e);
        for (int r = i * group; r < (i + 1) * group;) {
            const int left = (i + 1) * group - r;
            const int hb = left < most ? left : most;
            switch (hb) {
            case 4: attend_heads(kp, vp, ks, a, e, live, r, 4, C, soft_cap, qf, acc, m, l); break;
            case 3: attend_heads(kp, vp, ks, a, e, live, r, 3, C, soft_cap, qf, acc, m, l); break;
            case 2: attend_heads(kp, vp, ks, a, e, live, r, 2, C, soft_cap, qf, acc, m, l); break;
            default: attend_heads(kp, vp, ks, a, e, live, r, 1, C, soft_cap, qf, acc, m, l); break;
            }
            r += hb;
        }
    }
}

/*
 * One tile against one kv head: rows b0 .. b0 + nt - 1, either one request's consecutive tokens (a
 * prefill chunk's; a decode is a tile of one) or decodes of requests whose block tables hold the
 * same blocks for their first `shared` positions (a shared prompt prefix, from the prefix cache);
 * C = head_size / W, a constant where inlined. Row i attends positions [lo[i], hi[i]),
 * hi[i] = row_lens[b0 + i], through its own table row_blocks[i]. Positions below `shared` are read
 * once, a chunk at a time, for all the tile's rows and query heads while the chunk is in L1; the
 * rest row by row. Each row's chunks come in position order either way, so its sums do not depend
 * on its tile.
 */
static inline __attribute__((always_inline)) void attend_tile_vector(
    void *out, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *const *row_blocks, int shared, const int32_t *row_lens, int b0, int nt, int kvh, int group,
    const int C, int block_size, float scale, int sliding_window, float soft_cap, int dtype,
    int64_t q_stride, int64_t out_stride, int64_t row_stride)
{
    const int head_size = C * W;
    float qf[MAX_ROWS][MAX_HEAD] __attribute__((aligned(64)));
    float acc[MAX_ROWS][MAX_HEAD] __attribute__((aligned(64)));
    /* Rows packed at head_size apart: a chunk's K and V take 8 KB at head size 64 (W = 16). */
    float kb[W * MAX_HEAD] __attribute__((aligned(64)));
    float vb[W * MAX_HEAD] __attribute__((aligned(64)));
    float m[MAX_ROWS];
    float l[MAX_ROWS][W] __attribute__((aligned(64))); /* each (row, head)'s softmax denominator, by lane */
    int lo[MAX_ROWS], hi[MAX_ROWS];
    int first = INT32_MAX, last = 0;
    for (int i = 0; i < nt; i++) {
        hi[i] = row_lens[b0 + i];
        lo[i] = sliding_window > 0 && hi[i] > sliding_window ? hi[i] - sliding_window : 0;
        first = lo[i] < first ? lo[i] : first;
        last = hi[i] > last ? hi[i] : last;
    }
    for (int r = 0; r < nt * group; r++) {
        const int64_t qi = (int64_t)(b0 + r / group) * q_stride + (int64_t)(kvh * group + r % group) * head_size;
        for (int c = 0; c < C; c++) {
            v_store(qf[r] + W * c, v_mul(v_load_row(q, qi + W * c, dtype), v_set1(scale)));
            v_store(acc[r] + W * c, v_zero());
        }
        m[r] = -INFINITY;
        v_store(l[r], v_zero());
    }
    /* Pass 0: [first, shared) for all rows through the first row's table; pass 1 + i: row i's own
     * positions from `shared` on. */
    for (int pass = 0; pass <= (shared < last ? nt : 0); pass++) {
        const int i0 = pass == 0 ? 0 : pass - 1, i1 = pass == 0 ? nt : pass;
        const int32_t *blocks = row_blocks[i0];
        const int from = pass == 0 ? first : (lo[i0] > shared ? lo[i0] : shared);
        const int to = pass == 0 ? (shared < last ? shared : last) : hi[i0];
        for (int t0 = from; t0 < to;) {
            const int block_end = (t0 / block_size + 1) * block_size;
            int n = (block_end < to ? block_end : to) - t0;
            if (n > W) n = W;
            const int64_t row0 = kv_row(blocks, t0, block_size, row_stride, kvh, head_size);
            /* The next chunk's rows are requested now: they come from memory (or another core's cache)
             * while this one is computed, where the strided rows would wait on each miss in turn. */
            if (t0 + n < to) {
                const int t1 = t0 + n;
                const int64_t next = kv_row(blocks, t1, block_size, row_stride, kvh, head_size);
                const int next_end = (t1 / block_size + 1) * block_size < to ? (t1 / block_size + 1) * block_size : to;
                const int nn = next_end - t1 < W ? next_end - t1 : W;
                const int elem = dtype == 0 ? 4 : 2;
                for (int t = 0; t < nn; t++) prefetch_kv_row(k_cache, v_cache, next + t * row_stride, head_size, elem);
            }
            /* float32 rows are read where they lie; bfloat16 and float16 ones are made float32 once for
             * the tile. */
            const float *kp = (const float *)k_cache + row0, *vp = (const float *)v_cache + row0;
            int64_t ks = row_stride;
            if (dtype != 0) {
                for (int t = 0; t < n; t++)
                    for (int c = 0; c < C; c++) {
                        v_store(kb + t * head_size + W * c, v_load_row(k_cache, row0 + t * row_stride + W * c, dtype));
                        v_store(vb + t * head_size + W * c, v_load_row(v_cache, row0 + t * row_stride + W * c, dtype));
                    }
                kp = kb;
                vp = vb;
                ks = head_size;
            }
            attend_chunk(kp, vp, ks, t0, n, i0, i1, group, C, soft_cap, lo, hi, qf, acc, m, l);
            t0 += n;
        }
    }
    for (int r = 0; r < nt * group; r++) {
        const float sum = v_sum(v_load(l[r])), inv = sum > 0.f ? 1.f / sum : 0.f;
        const int64_t o = (int64_t)(b0 + r / group) * out_stride + (int64_t)(kvh * group + r % group) * head_size;
        if (dtype == 0) {
            for (int c = 0; c < C; c++)
                v_storeu((float *)out + o + W * c, v_mul(v_load(acc[r] + W * c), v_set1(inv)));
        } else {
            store_row(out, o, dtype, head_size, acc[r], inv);
        }
    }
}

/*
 * A prefill run (one request's consecutive rows, at least PREFILL_MIN_ROWS of them) as two small
 * matrix products per chunk of PREFILL_CHUNK positions, with the (row, query head) pairs of the tile
 * across the lanes instead of positions: S = Q K^T a broadcast K element times a vector of query
 * values at a time, then P V likewise, each K and V element loaded once for all the tile's heads.
 * The per-row path above sums every position's W-lane dot product across lanes and runs a max, an
 * exp and a rescale per (row, head) per W positions; here the softmax runs down whole vectors of
 * (row, head) pairs and the loads per FMA halve. One 4,000-token prompt's attention, SmolLM2's
 * heads, two AVX2 cores (Zen 3): 250 -> 155 ms.
 * A row's sums depend only on its own query and context (chunks start at multiples of
 * PREFILL_CHUNK), not on the rows beside it; they differ from the per-row path's by rounding, so
 * shorter runs (a speculative step's few drafted tokens) keep the per-row path and speculation
 * gives the very tokens plain decoding gives. Soft-capped scores (a tanh each) take the per-row path.
 */
#define PREFILL_MIN_ROWS 8
#define PREFILL_CHUNK 32
#if W == 16 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PREFILL_BF16 1
/* (row, head) pairs of a tile: MAX_ROWS in float32, twice that in bfloat16, whose products cost half
 * as much against the same K and V rows read and converted per chunk. */
#define PREFILL_LANES (2 * MAX_ROWS)
#else
#define PREFILL_LANES MAX_ROWS
#endif
#define PREFILL_RV (PREFILL_LANES / W) /* their vectors, at most */

/* A value the compiler must hold in a register: loaded once and used by several FMAs, where GCC
 * would otherwise fold the load into each of them (a load per FMA, and loads are the bound). */
#define in_register(x) __asm__("" : "+x"(x))

/* Broadcast values held in registers beside the RV-vector accumulators of a block: with FMA's
 * 4-cycle latency two FMA pipes need 12 or more independent sums in flight (8 ran at two thirds of
 * the peak here), and AVX2's 16 registers hold TB x RV sums + TB broadcasts + the streamed vector. */
#if W == 8
#define HELD(RV) ((RV) == 4 ? 3 : (RV) == 3 ? 3 : (RV) == 2 ? 5 : 7)
#else
#define HELD(RV) 8 /* 32 registers: 16 or 8 sums; a chunk of 32 positions and head sizes split evenly */
#endif

/* S[t0 .. t0 + TB) = Q . K_t, RV vectors of (row, head) lanes; qt is Q^T [d][lanes]. */
static inline __attribute__((always_inline)) void scores_block(
    float (*sc)[PREFILL_LANES], const float (*qt)[PREFILL_LANES], const float *const *krow, int t0, int head_size,
    const int TB, const int RV)
{
    vf acc[12][PREFILL_RV];
    for (int t = 0; t < TB; t++)
        for (int r = 0; r < RV; r++) acc[t][r] = v_zero();
    for (int d = 0; d < head_size; d++) {
        vf k[12];
        for (int t = 0; t < TB; t++) k[t] = v_set1(krow[t0 + t][d]);
        for (int r = 0; r < RV; r++) {
            vf qv = v_load(qt[d] + W * r);
            in_register(qv);
            for (int t = 0; t < TB; t++) acc[t][r] = v_fmadd(qv, k[t], acc[t][r]);
        }
    }
    for (int t = 0; t < TB; t++)
        for (int r = 0; r < RV; r++) v_store(sc[t0 + t] + W * r, acc[t][r]);
}

static inline __attribute__((always_inline)) void prefill_scores_body(
    float (*sc)[PREFILL_LANES], const float (*qt)[PREFILL_LANES], const float *const *krow, int n, int head_size,
    const int RV)
{
    const int TB = HELD(RV);
    int t = 0;
    for (; t + TB <= n; t += TB) scores_block(sc, qt, krow, t, head_size, TB, RV);
    switch (n - t) { /* the rest as one block of fewer positions: one at a time would have too few sums in flight */
        case 0: break;
        case 1: scores_block(sc, qt, krow, t, head_size, 1, RV); break;
        case 2: scores_block(sc, qt, krow, t, head_size, 2, RV); break;
        case 3: scores_block(sc, qt, krow, t, head_size, 3, RV); break;
        case 4: scores_block(sc, qt, krow, t, head_size, 4, RV); break;
        case 5: scores_block(sc, qt, krow, t, head_size, 5, RV); break;
        case 6: scores_block(sc, qt, krow, t, head_size, 6, RV); break;
        default: for (; t < n; t++) scores_block(sc, qt, krow, t, head_size, 1, RV); break;
    }
}

/* ot[d0 .. d0 + DB) = ot * corr + sum_t P[t] V_t[d], the DB sums of each lane vector in registers over the chunk. */
static inline __attribute__((always_inline)) void values_block(
    float (*ot)[PREFILL_LANES], const float (*pr)[PREFILL_LANES], const float *const *vrow, int n, int d0,
    const vf *corr, const int DB, const int RV)
{
    vf acc[12][PREFILL_RV];
    for (int j = 0; j < DB; j++)
        for (int r = 0; r < RV; r++) acc[j][r] = v_mul(v_load(ot[d0 + j] + W * r), corr[r]);
    for (int t = 0; t < n; t++) {
        vf v[12];
        for (int j = 0; j < DB; j++) v[j] = v_set1(vrow[t][d0 + j]);
        for (int r = 0; r < RV; r++) {
            vf p = v_load(pr[t] + W * r);
            in_register(p);
            for (int j = 0; j < DB; j++) acc[j][r] = v_fmadd(p, v[j], acc[j][r]);
        }
    }
    for (int j = 0; j < DB; j++)
        for (int r = 0; r < RV; r++) v_store(ot[d0 + j] + W * r, acc[j][r]);
}

static inline __attribute__((always_inline)) void prefill_values_body(
    float (*ot)[PREFILL_LANES], const float (*pr)[PREFILL_LANES], const float *const *vrow, int n, int head_size,
    const vf *corr, const int RV)
{
    const int DB = HELD(RV);
    int d0 = 0;
    for (; d0 + DB <= head_size; d0 += DB) values_block(ot, pr, vrow, n, d0, corr, DB, RV);
    switch (head_size - d0) {
        case 0: break;
        case 1: values_block(ot, pr, vrow, n, d0, corr, 1, RV); break;
        case 2: values_block(ot, pr, vrow, n, d0, corr, 2, RV); break;
        case 3: values_block(ot, pr, vrow, n, d0, corr, 3, RV); break;
        case 4: values_block(ot, pr, vrow, n, d0, corr, 4, RV); break;
        case 5: values_block(ot, pr, vrow, n, d0, corr, 5, RV); break;
        case 6: values_block(ot, pr, vrow, n, d0, corr, 6, RV); break;
        default: for (; d0 < head_size; d0++) values_block(ot, pr, vrow, n, d0, corr, 1, RV); break;
    }
}

/* The two products per vector count, each its own small function: inlined into the big parallel
 * loop, GCC kept their accumulators on the stack (1.7x slower). */
#define PREFILL_KERNELS(RV)                                                                                        \
    static __attribute__((noinline)) void prefill_scores_##RV(float (*sc)[PREFILL_LANES],                          \
                                                              const float (*qt)[PREFILL_LANES],                    \
                                                              const float *const *krow, int n, int head_size) {    \
        prefill_scores_body(sc, qt, krow, n, head_size, RV);                                                       \
    }                                                                                                              \
    static __attribute__((noinline)) void prefill_values_##RV(float (*ot)[PREFILL_LANES],                          \
                                                              const float (*pr)[PREFILL_LANES],                    \
                                                              const float *const *vrow, int n, int head_size,      \
                                                              const vf *corr) {                                    \
        prefill_values_body(ot, pr, vrow, n, head_size, corr, RV);                                                 \
    }
PREFILL_KERNELS(1)
PREFILL_KERNELS(2)
#if W == 8
PREFILL_KERNELS(3)
PREFILL_KERNELS(4)
#endif

static inline void prefill_scores(float (*sc)[PREFILL_LANES], const float (*qt)[PREFILL_LANES], const float *const *krow,
                                  int n, int head_size, int rv) {
    switch (rv) {
        case 1: prefill_scores_1(sc, qt, krow, n, head_size); break;
#if W == 8
        case 3: prefill_scores_3(sc, qt, krow, n, head_size); break;
        case 4: prefill_scores_4(sc, qt, krow, n, head_size); break;
#endif
        default: prefill_scores_2(sc, qt, krow, n, head_size); break;
    }
}

static inline void prefill_values(float (*ot)[PREFILL_LANES], const float (*pr)[PREFILL_LANES], const float *const *vrow,
                                  int n, int head_size, const vf *corr, int rv) {
    switch (rv) {
        case 1: prefill_values_1(ot, pr, vrow, n, head_size, corr); break;
#if W == 8
        case 3: prefill_values_3(ot, pr, vrow, n, head_size, corr); break;
        case 4: prefill_values_4(ot, pr, vrow, n, head_size, corr); break;
#endif
        default: prefill_values_2(ot, pr, vrow, n, head_size, corr); break;
    }
}

/*
 * The same two products with bfloat16 operands where the CPU has AVX512_BF16 (`bf16` set by the
 * caller: `--dtype auto`, whose linear layers already round their activations): vdpbf16ps takes
 * two multiply-adds a lane per instruction, twice the float32 FMA's, summing each pair in float32.
 * The operands are rounded to nearest even once per chunk (K, V) or tile (Q) and laid out in pairs
 * along the summed index: Q^T and the K rows pair head-size elements (d, d + 1), P and the V rows
 * pair positions (t, t + 1), V's pairs built by interleaving two converted rows (a 16-bit permute).
 * The running max, the exps and the softmax sums stay float32.
 */
#if defined(PREFILL_BF16)
/* The bfloat16 tiles' broadcasts held beside their TB x RV sums (vdpbf16ps: 6 cycles' latency). */
#define HELD_BF16(RV) ((RV) <= 2 ? 8 : (RV) == 3 ? 5 : 4)

static inline __m512bh bf16_pair(const void *p) {
    int32_t bits;
    memcpy(&bits, p, sizeof bits);
    return (__m512bh)_mm512_set1_epi32(bits);
}

/* Two float32 vectors as 16 bfloat16 pairs (a[i], b[i]), a in the low half of each 32-bit lane. */
static inline __m512i bf16_interleave(__m512 a, __m512 b) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

static inline __attribute__((always_inline)) void scores_block_bf16(
    float (*sc)[PREFILL_LANES], const uint32_t (*qp)[PREFILL_LANES], const uint16_t *kb, int t0,
    int head_size, const int TB, const int RV)
{
    vf acc[12][PREFILL_RV];
    for (int t = 0; t < TB; t++)
        for (int r = 0; r < RV; r++) acc[t][r] = v_zero();
    for (int d = 0; d < head_size; d += 2) {
        __m512bh k[12];
        for (int t = 0; t < TB; t++) k[t] = bf16_pair(kb + (int64_t)(t0 + t) * head_size + d);
        for (int r = 0; r < RV; r++) {
            __m512bh qv = (__m512bh)_mm512_load_si512(qp[d / 2] + W * r);
            in_register(qv);
            for (int t = 0; t < TB; t++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], qv, k[t]);
        }
    }
    for (int t = 0; t < TB; t++)
        for (int r = 0; r < RV; r++) v_store(sc[t0 + t] + W * r, acc[t][r]);
}

/* ot[d0 .. d0 + DB) = ot * corr + sum over position pairs of P V, as values_block. */
static inline __attribute__((always_inline)) void values_block_bf16(
    float (*ot)[PREFILL_LANES], const uint32_t (*pp)[PREFILL_LANES], const uint32_t *vp, int head_size, int pairs,
    int d0, const vf *corr, const int DB, const int RV)
{
    vf acc[12][PREFILL_RV];
    for (int j = 0; j < DB; j++)
        for (int r = 0; r < RV; r++) acc[j][r] = v_mul(v_load(ot[d0 + j] + W * r), corr[r]);
    for (int t = 0; t < pairs; t++) {
        __m512bh v[12];
        for (int j = 0; j < DB; j++) v[j] = bf16_pair(vp + (int64_t)t * head_size + d0 + j);
        for (int r = 0; r < RV; r++) {
            __m512bh p = (__m512bh)_mm512_load_si512(pp[t] + W * r);
            in_register(p);
            for (int j = 0; j < DB; j++) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], p, v[j]);
        }
    }
    for (int j = 0; j < DB; j++)
        for (int r = 0; r < RV; r++) v_store(ot[d0 + j] + W * r, acc[j][r]);
}

#define PREFILL_BF16_KERNELS(RV)                                                                                   \
    static __attribute__((noinline)) void prefill_scores_bf16_##RV(                                                \
        float (*sc)[PREFILL_LANES], const uint32_t (*qp)[PREFILL_LANES], const uint16_t *kb, int n,                \
        int head_size) {                                                                                           \
        const int TB = HELD_BF16(RV);                                                                              \
        int t = 0;                                                                                                 \
        for (; t + TB <= n; t += TB) scores_block_bf16(sc, qp, kb, t, head_size, TB, RV);                          \
        for (; t + 4 <= n; t += 4) scores_block_bf16(sc, qp, kb, t, head_size, 4, RV);                             \
        for (; t < n; t++) scores_block_bf16(sc, qp, kb, t, head_size, 1, RV);                                     \
    }                                                                                                              \
    static __attribute__((noinline)) void prefill_values_bf16_##RV(                                                \
        float (*ot)[PREFILL_LANES], const uint32_t (*pp)[PREFILL_LANES], const uint32_t *vp, int n,                \
        int head_size, const vf *corr) {                                                                           \
        const int DB = HELD_BF16(RV);                                                                              \
        int d0 = 0;                                                                                                \
        for (; d0 + DB <= head_size; d0 += DB) values_block_bf16(ot, pp, vp, head_size, (n + 1) / 2, d0, corr, DB, RV); \
        for (; d0 < head_size; d0++) values_block_bf16(ot, pp, vp, head_size, (n + 1) / 2, d0, corr, 1, RV);      \
    }
PREFILL_BF16_KERNELS(1)
PREFILL_BF16_KERNELS(2)
PREFILL_BF16_KERNELS(3)
PREFILL_BF16_KERNELS(4)

static inline void prefill_scores_bf16(float (*sc)[PREFILL_LANES], const uint32_t (*qp)[PREFILL_LANES],
                                       const uint16_t *kb, int n, int head_size, int rv) {
    switch (rv) {
        case 1: prefill_scores_bf16_1(sc, qp, kb, n, head_size); break;
        case 2: prefill_scores_bf16_2(sc, qp, kb, n, head_size); break;
        case 3: prefill_scores_bf16_3(sc, qp, kb, n, head_size); break;
        default: prefill_scores_bf16_4(sc, qp, kb, n, head_size); break;
    }
}

static inline void prefill_values_bf16(float (*ot)[PREFILL_LANES], const uint32_t (*pp)[PREFILL_LANES],
                                       const uint32_t *vp, int n, int head_size, const vf *corr, int rv) {
    switch (rv) {
        case 1: prefill_values_bf16_1(ot, pp, vp, n, head_size, corr); break;
        case 2: prefill_values_bf16_2(ot, pp, vp, n, head_size, corr); break;
        case 3: prefill_values_bf16_3(ot, pp, vp, n, head_size, corr); break;
        default: prefill_values_bf16_4(ot, pp, vp, n, head_size, corr); break;
    }
}

/* K rows as bfloat16 and V rows as position pairs (t, t + 1) from an even t, of positions
 * first .. last - 1 (first even), for one kv head, into k [last - first][head_size] and
 * v [(last - first + 1) / 2][head_size]: a prompt run's context, made once for all its tiles (each
 * would otherwise convert every row of its context itself). */
static void convert_rows(uint16_t *k, uint32_t *v, const void *k_cache, const void *v_cache, const int32_t *blocks,
                         int first, int last, int block_size, int64_t row_stride, int kvh, int head_size, int dtype)
{
    int64_t rows[PREFILL_CHUNK + 1];
    for (int t0 = first; t0 < last; t0 += PREFILL_CHUNK) {
        const int n = last - t0 < PREFILL_CHUNK ? last - t0 : PREFILL_CHUNK;
        kv_rows(rows, blocks, t0, n, block_size, row_stride, kvh, head_size);
        rows[n] = -1;
        for (int t = 0; t < n; t++) {
            uint16_t *kt = k + (int64_t)(t0 - first + t) * head_size;
            uint32_t *vt = v + (int64_t)(t0 - first + t) / 2 * head_size;
            for (int c = 0; c < head_size; c += W) {
                const __m512i kr = (__m512i)_mm512_cvtne2ps_pbh(v_zero(), v_load_row(k_cache, rows[t] + c, dtype));
                _mm256_storeu_si256((__m256i *)(kt + c), _mm512_castsi512_si256(kr));
                if (t % 2 == 0)
                    _mm512_storeu_si512(vt + c, bf16_interleave(v_load_row(v_cache, rows[t] + c, dtype),
                                                                rows[t + 1] >= 0 ? v_load_row(v_cache, rows[t + 1] + c, dtype)
                                                                                 : v_zero()));
            }
        }
    }
}
#endif

static inline __attribute__((always_inline)) void attend_prefill_tile(
    void *out, const void *q, const void *k_cache, const void *v_cache, const int32_t *blocks,
    const int32_t *row_lens, int b0, int nt, int kvh, int group, int head_size, int block_size, float scale,
    int sliding_window, int dtype, int64_t q_stride, int64_t out_stride, int64_t row_stride, const int RV,
    const int BF, const uint16_t *kconv, const uint32_t *vconv, int conv_first)
/* BF: kconv, vconv hold the run's bfloat16 copy of positions from conv_first on (convert_rows). */
{
    float qt[MAX_HEAD][PREFILL_LANES] __attribute__((aligned(64)));
    float ot[MAX_HEAD][PREFILL_LANES] __attribute__((aligned(64)));
    float sc[PREFILL_CHUNK][PREFILL_LANES] __attribute__((aligned(64)));
    float kb[PREFILL_CHUNK][MAX_HEAD] __attribute__((aligned(64)));
    float vb[PREFILL_CHUNK][MAX_HEAD] __attribute__((aligned(64)));
    float lo_f[PREFILL_LANES] __attribute__((aligned(64))), hi_f[PREFILL_LANES] __attribute__((aligned(64)));
    const float *krow[PREFILL_CHUNK], *vrow[PREFILL_CHUNK];
    float row[MAX_HEAD];
    const int lanes = nt * group;
    int first = INT32_MAX, last = 0, lo_max = 0, hi_min = INT32_MAX;
    for (int r = 0; r < RV * W; r++) {
        const int i = r < lanes ? r / group : nt - 1; /* padding lanes copy the last row's bounds */
        const int hi = row_lens[b0 + i], lo = sliding_window > 0 && hi > sliding_window ? hi - sliding_window : 0;
        hi_f[r] = (float)hi;
        lo_f[r] = (float)lo;
        first = lo < first ? lo : first;
        last = hi > last ? hi : last;
        lo_max = lo > lo_max ? lo : lo_max;
        hi_min = hi < hi_min ? hi : hi_min;
    }
    for (int d = 0; d < head_size; d++)
        for (int r = 0; r < RV * W; r++) qt[d][r] = ot[d][r] = 0.f;
    for (int r = 0; r < lanes; r++) {
        load_row(q, (int64_t)(b0 + r / group) * q_stride + (int64_t)(kvh * group + r % group) * head_size, dtype,
                 head_size, row);
        for (int d = 0; d < head_size; d++) qt[d][r] = row[d] * scale;
    }
#if defined(PREFILL_BF16)
    uint32_t qp[MAX_HEAD / 2][PREFILL_LANES] __attribute__((aligned(64))); /* Q^T, pairs of d */
    uint32_t pp[PREFILL_CHUNK / 2][PREFILL_LANES] __attribute__((aligned(64)));
    if (BF)
        for (int d = 0; d < head_size; d += 2)
            for (int r = 0; r < RV * W; r++)
                qp[d / 2][r] = f32_to_bf16(qt[d][r]) | (uint32_t)f32_to_bf16(qt[d + 1][r]) << 16;
#endif
    /* The running max starts finite: a lane with nothing visible yet keeps exp(0) = 1 as its
     * correction of zero sums, where -inf - -inf would be NaN. */
    vf m[PREFILL_RV], l[PREFILL_RV];
    for (int r = 0; r < RV; r++) {
        m[r] = v_set1(-1e30f);
        l[r] = v_zero();
    }
    for (int c0 = first - first % PREFILL_CHUNK; c0 < last; c0 += PREFILL_CHUNK) {
        /* bfloat16 tiles pair positions (t, t + 1) from an even t, whatever the tile's first position (a
         * position before it is masked for every lane), so that a row's sums do not depend on its tile. */
        const int ta = c0 > first ? c0 : BF ? first - first % 2 : first;
        const int tb = c0 + PREFILL_CHUNK < last ? c0 + PREFILL_CHUNK : last;
        const int n = tb - ta;
        /* The next chunk's rows are asked for now: they come from L3 or memory (strided, in blocks
         * scattered over the pool) while this chunk is computed. The bfloat16 copy is read in order:
         * the hardware prefetcher follows it. */
        const int elem = dtype == 0 ? 4 : 2;
        int64_t rows[PREFILL_CHUNK];
        const int ahead = BF ? 0 : last - tb < PREFILL_CHUNK ? last - tb : PREFILL_CHUNK;
        kv_rows(rows, blocks, tb, ahead, block_size, row_stride, kvh, head_size);
        for (int t = 0; t < ahead; t++) prefetch_kv_row(k_cache, v_cache, rows[t], head_size, elem);
        if (!BF) kv_rows(rows, blocks, ta, n, block_size, row_stride, kvh, head_size);
        for (int t = 0; t < (BF ? 0 : n); t++) {
            const int64_t index = rows[t];
            if (dtype == 0) {
                krow[t] = (const float *)k_cache + index;
                vrow[t] = (const float *)v_cache + index;
            } else {
                for (int c = 0; c < head_size; c += W) {
                    v_store(kb[t] + c, v_load_row(k_cache, index + c, dtype));
                    v_store(vb[t] + c, v_load_row(v_cache, index + c, dtype));
                }
                krow[t] = kb[t];
                vrow[t] = vb[t];
            }
        }
#if defined(PREFILL_BF16)
        if (BF) {
            prefill_scores_bf16(sc, (const uint32_t (*)[PREFILL_LANES])qp, kconv + (int64_t)(ta - conv_first) * head_size,
                                n, head_size, RV);
        } else
#endif
        prefill_scores(sc, (const float (*)[PREFILL_LANES])qt, krow, n, head_size, RV);
        const int masked = ta < lo_max || tb > hi_min;
        vf corr[PREFILL_RV];
        for (int r = 0; r < RV; r++) {
            const vf lo = v_load(lo_f + W * r), hi = v_load(hi_f + W * r);
            vf cmax = v_set1(-INFINITY);
            for (int t = 0; t < n; t++) {
                vf s = v_load(sc[t] + W * r);
                if (masked) {
                    s = v_select(v_within(v_set1((float)(ta + t)), lo, hi), s, v_set1(-INFINITY));
                    v_store(sc[t] + W * r, s);
                }
                cmax = v_max(cmax, s);
            }
            const vf mn = v_max(m[r], cmax);
            corr[r] = v_exp(v_sub(m[r], mn));
            m[r] = mn;
            vf sum = v_mul(l[r], corr[r]);
            for (int t = 0; t < n; t++) {
                vf p = v_exp(v_sub(v_load(sc[t] + W * r), mn));
                if (masked) p = v_select(v_within(v_set1((float)(ta + t)), lo, hi), p, v_zero());
                sum = v_add(sum, p);
                v_store(sc[t] + W * r, p);
            }
            l[r] = sum;
        }
#if defined(PREFILL_BF16)
        if (BF) {
            for (int t = 0; t < n; t += 2)
                for (int r = 0; r < RV; r++)
                    _mm512_store_si512(pp[t / 2] + W * r, bf16_interleave(v_load(sc[t] + W * r),
                                                                         t + 1 < n ? v_load(sc[t + 1] + W * r) : v_zero()));
            prefill_values_bf16(ot, (const uint32_t (*)[PREFILL_LANES])pp,
                                vconv + (int64_t)(ta - conv_first) / 2 * head_size, n, head_size, corr, RV);
            continue;
        }
#endif
        prefill_values(ot, (const float (*)[PREFILL_LANES])sc, vrow, n, head_size, corr, RV);
    }
    float inv[PREFILL_LANES] __attribute__((aligned(64)));
    for (int r = 0; r < RV; r++) v_store(inv + W * r, l[r]);
    for (int r = 0; r < lanes; r++) {
        const float sum = inv[r];
        for (int d = 0; d < head_size; d++) row[d] = ot[d][r];
        store_row(out, (int64_t)(b0 + r / group) * out_stride + (int64_t)(kvh * group + r % group) * head_size, dtype,
                  head_size, row, sum > 0.f ? 1.f / sum : 0.f);
    }
}
#endif

#if defined(VECTOR_PATH)
/* Whether tile `tile` (of a call whose seq_of_row is given) is a prompt run the prefill tile takes. */
static inline int is_prefill_tile(const int32_t *tiles, int tile, const int32_t *seq_of_row, int group)
{
    const int b0 = tiles[tile], nt = tiles[tile + 1] - tiles[tile];
    return nt >= PREFILL_MIN_ROWS && nt * group <= PREFILL_LANES && seq_of_row[b0] == seq_of_row[b0 + nt - 1];
}
#endif

#if defined(PREFILL_BF16)
/* The bfloat16 copies of the contexts of a call's prompt runs (consecutive prefill tiles of one
 * request): run g holds positions first[g] .. first[g] + span[g] - 1 (first[g] even) of every kv
 * head, K at k + k_at[g] and V's pairs at v + v_at[g], kv head by kv head. */
#define CONVERT_PARALLEL_MIN_ROWS 8192
#define CONVERT_SLICES 8
typedef struct {
    int32_t *run_of_tile; /* per tile: its run, -1 for none; NULL: no run */
    int32_t *first, *span;
    int64_t *k_at, *v_at;
    uint16_t *k;          /* one allocation: the K copies, then the V pairs, then the runs' fields */
    uint32_t *v;
} Converted;

typedef struct {
    int tile, tiles, first, last;
} Run;

static int convert_runs(Converted *conv, const void *k_cache, const void *v_cache, const int32_t *const *row_blocks,
                        const int32_t *tiles, int num_tiles, const int32_t *seq_lens, const int32_t *seq_of_row,
                        int num_kv_heads, int group, int head_size, int block_size, int sliding_window,
                        int64_t row_stride, int dtype, int num_threads)
{
    int32_t *run_of_tile = malloc(sizeof(int32_t) * (size_t)num_tiles);
    Run *run = malloc(sizeof(Run) * (size_t)num_tiles);
    if (run_of_tile == NULL || run == NULL) {
        free(run_of_tile);
        free(run);
        return -1;
    }
    int runs = 0;
    int64_t k_elems = 0, v_elems = 0;
    for (int tile = 0; tile < num_tiles; tile++) {
        run_of_tile[tile] = -1;
        if (!is_prefill_tile(tiles, tile, seq_of_row, group)) continue;
        int lo = INT32_MAX, hi = 0;
        for (int b = tiles[tile]; b < tiles[tile + 1]; b++) {
            const int h = seq_lens[b], l = sliding_window > 0 && h > sliding_window ? h - sliding_window : 0;
            lo = l < lo ? l : lo;
            hi = h > hi ? h : hi;
        }
        lo -= lo % 2;
        Run *r = &run[runs - 1];
        if (runs > 0 && r->tile + r->tiles == tile && seq_of_row[tiles[r->tile]] == seq_of_row[tiles[tile]]) {
            r->tiles++;
            r->first = lo < r->first ? lo : r->first;
            r->last = hi > r->last ? hi : r->last;
        } else {
            run[runs++] = (Run){tile, 1, lo, hi};
        }
        run_of_tile[tile] = runs - 1;
    }
    for (int g = 0; g < runs; g++) {
        k_elems += (int64_t)num_kv_heads * (run[g].last - run[g].first) * head_size;
        v_elems += (int64_t)num_kv_heads * ((run[g].last - run[g].first + 1) / 2) * head_size;
    }
    char *mem = runs == 0 ? NULL : malloc((size_t)k_elems * 2 + (size_t)v_elems * 4 + (size_t)runs * 24 + 64);
    if (runs == 0 || mem == NULL) {
        free(run_of_tile);
        free(run);
        return runs == 0 ? 0 : -1;
    }
    conv->run_of_tile = run_of_tile;
    conv->k = (uint16_t *)mem;
    conv->v = (uint32_t *)(mem + (((size_t)k_elems * 2 + 3) & ~(size_t)3));
    conv->k_at = (int64_t *)(mem + (((size_t)k_elems * 2 + (size_t)v_elems * 4 + 64) & ~(size_t)7));
    conv->v_at = conv->k_at + runs;
    conv->first = (int32_t *)(conv->v_at + runs);
    conv->span = conv->first + runs;
    int64_t k_at = 0, v_at = 0, copied = 0;
    for (int g = 0; g < runs; g++) {
        conv->first[g] = run[g].first;
        conv->span[g] = run[g].last - run[g].first;
        conv->k_at[g] = k_at;
        conv->v_at[g] = v_at;
        k_at += (int64_t)num_kv_heads * conv->span[g] * head_size;
        v_at += (int64_t)num_kv_heads * ((conv->span[g] + 1) / 2) * head_size;
        copied += (int64_t)conv->span[g] * num_kv_heads;
    }
    /* A short prompt's copy takes microseconds on one thread, less than waking the others. Each
     * (run, kv head) goes in CONVERT_SLICES slices of positions, from even offsets: a model with one
     * kv head has work for every thread too. */
    const int threads = copied >= CONVERT_PARALLEL_MIN_ROWS ? num_threads : 1;
    #pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int g = 0; g < runs; g++) {
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            for (int slice = 0; slice < CONVERT_SLICES; slice++) {
                const int first = conv->first[g], span = conv->span[g];
                const int a = (int)((int64_t)span * slice / CONVERT_SLICES) & ~1;
                const int b = slice + 1 == CONVERT_SLICES ? span : (int)((int64_t)span * (slice + 1) / CONVERT_SLICES) & ~1;
                if (a >= b) continue;
                convert_rows(conv->k + conv->k_at[g] + ((int64_t)kvh * span + a) * head_size,
                             conv->v + conv->v_at[g] + ((int64_t)kvh * ((span + 1) / 2) + a / 2) * head_size, k_cache,
                             v_cache, row_blocks[tiles[run[g].tile]], first + a, first + b, block_size, row_stride,
                             kvh, head_size, dtype);
            }
        }
    }
    free(run);
    return 0;
}
#endif

/* The lanes of the vector path this build runs (16: AVX-512, 8: AVX2), 1 for the scalar code. */
int vector_width(void)
{
#if defined(VECTOR_PATH)
    return W;
#else
    return 1;
#endif
}

/* Whether `prefill_bf16` takes effect in this build: AVX-512 with AVX512_BF16. */
int prefill_bf16_built(void)
{
#if defined(PREFILL_BF16)
    return 1;
#else
    return 0;
#endif
}

int paged_decode_attention(
    void *out, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *block_table, const int32_t *seq_lens, const int32_t *seq_of_row,
    int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size,
    int max_blocks_per_seq, float scale, int sliding_window, float soft_cap, int dtype,
    int64_t q_stride, int64_t out_stride, int num_threads, int prefill_bf16)
{
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_size > MAX_HEAD || block_size > MAX_BLOCK || num_heads % num_kv_heads) return -1;
    const int64_t row_stride = (int64_t)num_kv_heads * head_size; /* one token's K (or V) */
    /* Tiles: runs of up to MAX_ROWS / group rows (run_rows) of one request at consecutive positions (a
     * prefill chunk's), or of decodes of different requests sharing at least MIN_SHARED_BLOCKS full blocks
     * at the start of their tables (no sliding window), up to share_rows of them: enough tiles that
     * the threads get two (kv head, tile) items each. */
    const int tile_rows = MAX_ROWS / group > 0 ? MAX_ROWS / group : 1;
#if defined(PREFILL_BF16)
    /* bfloat16 prefill tiles take runs of twice the rows where every run of at least PREFILL_MIN_ROWS
     * goes to them and a shorter one still fits the per-row path's MAX_ROWS (row, head) pairs. */
    const int run_rows = prefill_bf16 && soft_cap <= 0.f && head_size % W == 0 &&
                         (PREFILL_MIN_ROWS - 1) * group <= MAX_ROWS ? PREFILL_LANES / group : tile_rows;
#else
    prefill_bf16 = 0;
    const int run_rows = tile_rows;
#endif
    const int min_tiles = (2 * num_threads + num_kv_heads - 1) / num_kv_heads;
    int share_rows = (num_seqs + min_tiles - 1) / min_tiles;
    share_rows = share_rows < tile_rows ? share_rows : tile_rows;
    int32_t *tiles = malloc(sizeof(int32_t) * (3 * (size_t)num_seqs + 1));
    const int32_t **row_blocks = malloc(sizeof(int32_t *) * ((size_t)num_seqs + 1));
    if (tiles == NULL || row_blocks == NULL) {
        free(tiles);
        free(row_blocks);
        return -2;
    }
    int32_t *shared = tiles + num_seqs + 1; /* per tile: positions all its rows' tables agree on */
    int32_t *lone = shared + num_seqs;      /* per tile: begun by a decode its request has alone */
    int num_tiles = 0;
    int64_t kv_rows = 0; /* K and V rows the call reads, over all rows and kv heads */
    for (int b = 0; b < num_seqs; b++) {
        kv_rows += (int64_t)seq_lens[b] * num_kv_heads;
        row_blocks[b] = block_table + (int64_t)(seq_of_row ? seq_of_row[b] : b) * max_blocks_per_seq;
        const int same_request = b > 0 && seq_of_row != NULL && seq_of_row[b] == seq_of_row[b - 1];
        const int starts_run = b + 1 < num_seqs && seq_of_row != NULL && seq_of_row[b + 1] == seq_of_row[b];
        const int is_lone = !same_request && !starts_run && sliding_window <= 0;
        const int t = num_tiles - 1, size = b - (t >= 0 ? tiles[t] : 0);
        if (same_request && seq_lens[b] == seq_lens[b - 1] + 1 && size < run_rows) {
            shared[t] = seq_lens[b]; /* one request: every position */
            continue;
        }
        if (is_lone && t >= 0 && lone[t] && size < share_rows) { /* a decode, beside decodes */
            const int full = (seq_lens[b] < shared[t] ? seq_lens[b] : shared[t]) / block_size;
            int common = 0;
            while (common < full && row_blocks[b][common] == row_blocks[tiles[t]][common]) common++;
            if (common >= MIN_SHARED_BLOCKS) {
                shared[t] = common * block_size;
                continue;
            }
        }
        tiles[num_tiles] = b;
        lone[num_tiles] = is_lone;
        shared[num_tiles++] = seq_lens[b];
    }
    tiles[num_tiles] = num_seqs;
#if defined(PREFILL_BF16)
    Converted conv = {0};
    if (prefill_bf16 && soft_cap <= 0.f && head_size % W == 0 && seq_of_row != NULL &&
        convert_runs(&conv, k_cache, v_cache, row_blocks, tiles, num_tiles, seq_lens, seq_of_row, num_kv_heads,
                     group, head_size, block_size, sliding_window, row_stride, dtype, num_threads) != 0) {
        free(tiles);
        free(row_blocks);
        return -2;
    }
#endif
    /* A parallel region wakes the other threads and waits for the last of them: tens of us on an
     * idle machine, milliseconds when other processes hold the other cores (kvmesh serve's four on a
     * 2-core VM: a single stream's attention took 15 ms of a 56 ms step). Small calls run serially. */
    const int threads = num_tiles * num_kv_heads >= 2 && kv_rows >= PARALLEL_MIN_KV_ROWS ? num_threads : 1;

    #pragma omp parallel for collapse(2) schedule(dynamic, 2) num_threads(threads) if (threads > 1)
    for (int kvh = 0; kvh < num_kv_heads; kvh++) {
        for (int tile = 0; tile < num_tiles; tile++) {
            const int b0 = tiles[tile], nt = tiles[tile + 1] - tiles[tile];
#if defined(VECTOR_PATH)
            if (head_size % W == 0 && soft_cap <= 0.f && seq_of_row != NULL &&
                is_prefill_tile(tiles, tile, seq_of_row, group)) {
#define PTILE(RV, BF, KC, VC, CF) attend_prefill_tile(out, q, k_cache, v_cache, row_blocks[b0], seq_lens, b0, nt, \
                                                      kvh, group, head_size, block_size, scale, sliding_window, \
                                                      dtype, q_stride, out_stride, row_stride, RV, BF, KC, VC, CF)
#if defined(PREFILL_BF16)
                const int g = conv.run_of_tile != NULL ? conv.run_of_tile[tile] : -1;
                if (g >= 0) { /* prefill_bf16: every prompt run has its copy */
                    const uint16_t *kc = conv.k + conv.k_at[g] + (int64_t)kvh * conv.span[g] * head_size;
                    const uint32_t *vc = conv.v + conv.v_at[g] + (int64_t)kvh * ((conv.span[g] + 1) / 2) * head_size;
                    const int cf = conv.first[g];
                    switch ((nt * group + W - 1) / W) {
                        case 1: PTILE(1, 1, kc, vc, cf); break;
                        case 2: PTILE(2, 1, kc, vc, cf); break;
                        case 3: PTILE(3, 1, kc, vc, cf); break;
                        default: PTILE(4, 1, kc, vc, cf); break;
                    }
                    continue;
                }
#endif
                switch ((nt * group + W - 1) / W) {
                    case 1: PTILE(1, 0, NULL, NULL, 0); break;
#if W == 8
                    case 3: PTILE(3, 0, NULL, NULL, 0); break;
                    case 4: PTILE(4, 0, NULL, NULL, 0); break;
#endif
                    default: PTILE(2, 0, NULL, NULL, 0); break;
                }
#undef PTILE
                continue;
            }
#define VTILE(C) attend_tile_vector(out, q, k_cache, v_cache, row_blocks + b0, shared[tile], seq_lens, b0, nt, \
                                    kvh, group, C, \
                                    block_size, scale, sliding_window, soft_cap, dtype, q_stride, out_stride, \
                                    row_stride)
            if (head_size % W == 0) {
                switch (head_size) {
                    case 64: VTILE(64 / W); break;
                    case 128: VTILE(128 / W); break;
                    default: VTILE(head_size / W); break;
                }
                continue;
            }
#undef VTILE
#endif
#define ITEM(D) attend_item(out, q, k_cache, v_cache, row_blocks[b], seq_lens[b], b, kvh, group, D, block_size, \
                            scale, sliding_window, soft_cap, dtype, q_stride, out_stride, row_stride)
            for (int b = b0; b < b0 + nt; b++) {
                switch (head_size) {
                    case 64: ITEM(64); break;
                    case 128: ITEM(128); break;
                    default: ITEM(head_size); break;
                }
            }
#undef ITEM
        }
    }
#if defined(PREFILL_BF16)
    free(conv.run_of_tile);
    free(conv.k);
#endif
    free(tiles);
    free(row_blocks);
    return 0;
}
