/*
 * Paged decode attention for the CPU: one query token per sequence against its paged KV cache.
 *
 * Cache layout (services/worker/kv_cache.py): K and V are each [num_blocks, block_size, Hkv, D].
 * Token t of sequence b lives in block block_table[b][t / block_size], row t % block_size.
 * Work is split over (sequence, kv head); each item reads its context once and serves the
 * H / Hkv query heads that share that kv head (GQA), with an online softmax in float32.
 * dtype: 0 = float32, 1 = bfloat16 (q, cache and out share it).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD 256
#define MAX_BLOCK 128

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

static inline void load_row(const void *base, int64_t index, int dtype, int d, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + index, sizeof(float) * d);
    } else {
        /* bf16 -> f32 is a 16-bit shift; written on integers so the compiler vectorizes it. */
        const uint16_t *src = (const uint16_t *)base + index;
        uint32_t *bits = (uint32_t *)dst;
        for (int i = 0; i < d; i++) bits[i] = ((uint32_t)src[i]) << 16;
    }
}

/* One (sequence, kv head) item. Inlined with a constant head_size so the loops over it vectorize. */
static inline __attribute__((always_inline)) void attend_item(
    void *out, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *block_table, const int32_t *seq_lens, int b, int kvh, int group, const int head_size,
    int block_size, int max_blocks_per_seq, float scale, int sliding_window, float soft_cap, int dtype,
    int64_t q_stride, int64_t out_stride, int64_t row_stride)
{
    float qv[MAX_GROUP][MAX_HEAD], acc[MAX_GROUP][MAX_HEAD], kv[MAX_HEAD];
    float m[MAX_GROUP], l[MAX_GROUP];
    const int seq_len = seq_lens[b];
    const int start = sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
    for (int g = 0; g < group; g++) {
        load_row(q, b * q_stride + (int64_t)(kvh * group + g) * head_size, dtype, head_size, qv[g]);
        m[g] = -INFINITY;
        l[g] = 0.f;
        for (int i = 0; i < head_size; i++) acc[g][i] = 0.f;
    }
    const int32_t *blocks = block_table + (int64_t)b * max_blocks_per_seq;
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
        const int64_t o = b * out_stride + (int64_t)(kvh * group + g) * head_size;
        if (dtype == 0) {
            float *dst = (float *)out + o;
            for (int i = 0; i < head_size; i++) dst[i] = acc[g][i] * inv;
        } else {
            uint16_t *dst = (uint16_t *)out + o;
            for (int i = 0; i < head_size; i++) dst[i] = f32_to_bf16(acc[g][i] * inv);
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/*
 * The AVX-512 path. Each (sequence, kv head) item walks its context in chunks of up to 16
 * positions (never across a block): K and V rows of a chunk are made float32 once (bfloat16: a
 * 16-bit shift) into buffers that stay in L1, then every query head of the group takes, in
 * registers, its 16 scores (one horizontal sum per position), one vector exp for the chunk, and
 * its P·V accumulation. The scalar path above spends most of its time in one expf call per
 * (position, head) and in accumulators that live in memory.
 */
#define CHUNK 16

/* exp(x) for x <= 0 (scores minus their running max): Cephes' expf polynomial, range-reduced by
 * ln 2 and scaled back with scalef; relative error ~1e-7, exact 0 is not needed (masked). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 load16(const void *base, int64_t index, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + index);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* One (sequence, kv head) item; C = head_size / 16, a constant where inlined. */
static inline __attribute__((always_inline)) void attend_item_avx512(
    void *out, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *block_table, const int32_t *seq_lens, int b, int kvh, int group, const int C,
    int block_size, int max_blocks_per_seq, float scale, int sliding_window, float soft_cap, int dtype,
    int64_t q_stride, int64_t out_stride, int64_t row_stride)
{
    const int head_size = C * 16;
    float qf[MAX_GROUP][MAX_HEAD] __attribute__((aligned(64)));
    float acc[MAX_GROUP][MAX_HEAD] __attribute__((aligned(64)));
    /* Rows packed at head_size apart: a chunk's K and V take 8 KB at head size 64. */
    float kb[CHUNK * MAX_HEAD] __attribute__((aligned(64)));
    float vb[CHUNK * MAX_HEAD] __attribute__((aligned(64)));
    float s[CHUNK] __attribute__((aligned(64)));
    float m[MAX_GROUP], l[MAX_GROUP];
    const int seq_len = seq_lens[b];
    const int start = sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
    for (int g = 0; g < group; g++) {
        const int64_t qi = b * q_stride + (int64_t)(kvh * group + g) * head_size;
        for (int c = 0; c < C; c++) {
            _mm512_store_ps(qf[g] + 16 * c, _mm512_mul_ps(load16(q, qi + 16 * c, dtype), _mm512_set1_ps(scale)));
            _mm512_store_ps(acc[g] + 16 * c, _mm512_setzero_ps());
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    const int32_t *blocks = block_table + (int64_t)b * max_blocks_per_seq;
    for (int t0 = start; t0 < seq_len;) {
        const int block_end = (t0 / block_size + 1) * block_size;
        int n = (block_end < seq_len ? block_end : seq_len) - t0;
        if (n > CHUNK) n = CHUNK;
        const int64_t row0 = ((int64_t)blocks[t0 / block_size] * block_size + t0 % block_size) * row_stride
                             + (int64_t)kvh * head_size;
        for (int t = 0; t < n; t++)
            for (int c = 0; c < C; c++) {
                _mm512_store_ps(kb + t * head_size + 16 * c, load16(k_cache, row0 + t * row_stride + 16 * c, dtype));
                _mm512_store_ps(vb + t * head_size + 16 * c, load16(v_cache, row0 + t * row_stride + 16 * c, dtype));
            }
        const __mmask16 live = (__mmask16)((1u << n) - 1);
        for (int g = 0; g < group; g++) {
            __m512 qr[MAX_HEAD / 16];
            for (int c = 0; c < C; c++) qr[c] = _mm512_load_ps(qf[g] + 16 * c);
            for (int t = 0; t < n; t++) {
                const float *k = kb + t * head_size;
                __m512 d = _mm512_mul_ps(qr[0], _mm512_load_ps(k));
                for (int c = 1; c < C; c++) d = _mm512_fmadd_ps(qr[c], _mm512_load_ps(k + 16 * c), d);
                s[t] = _mm512_reduce_add_ps(d);
            }
            if (soft_cap > 0.f)
                for (int t = 0; t < n; t++) s[t] = soft_cap * tanhf(s[t] / soft_cap);
            const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, s);
            const float chunk_max = _mm512_reduce_max_ps(sv);
            __m512 ar[MAX_HEAD / 16];
            for (int c = 0; c < C; c++) ar[c] = _mm512_load_ps(acc[g] + 16 * c);
            if (chunk_max > m[g]) {
                const float correction = expf(m[g] - chunk_max);
                l[g] *= correction;
                for (int c = 0; c < C; c++) ar[c] = _mm512_mul_ps(ar[c], _mm512_set1_ps(correction));
                m[g] = chunk_max;
            }
            const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(m[g]))));
            l[g] += _mm512_reduce_add_ps(p);
            _mm512_store_ps(s, p);
            for (int t = 0; t < n; t++) {
                const __m512 pt = _mm512_set1_ps(s[t]);
                const float *v = vb + t * head_size;
                for (int c = 0; c < C; c++) ar[c] = _mm512_fmadd_ps(pt, _mm512_load_ps(v + 16 * c), ar[c]);
            }
            for (int c = 0; c < C; c++) _mm512_store_ps(acc[g] + 16 * c, ar[c]);
        }
        t0 += n;
    }
    for (int g = 0; g < group; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        const int64_t o = b * out_stride + (int64_t)(kvh * group + g) * head_size;
        if (dtype == 0) {
            for (int c = 0; c < C; c++)
                _mm512_storeu_ps((float *)out + o + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[g] + 16 * c), _mm512_set1_ps(inv)));
        } else {
            uint16_t *dst = (uint16_t *)out + o;
            for (int i = 0; i < head_size; i++) dst[i] = f32_to_bf16(acc[g][i] * inv);
        }
    }
}
#endif

int paged_decode_attention(
    void *out, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *block_table, const int32_t *seq_lens,
    int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size,
    int max_blocks_per_seq, float scale, int sliding_window, float soft_cap, int dtype,
    int64_t q_stride, int64_t out_stride, int num_threads)
{
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_size > MAX_HEAD || block_size > MAX_BLOCK || num_heads % num_kv_heads) return -1;
    const int64_t row_stride = (int64_t)num_kv_heads * head_size; /* one token's K (or V) */

    #pragma omp parallel for collapse(2) schedule(dynamic, 4) num_threads(num_threads)
    for (int b = 0; b < num_seqs; b++) {
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
#if defined(__AVX512F__)
#define ITEM512(C) attend_item_avx512(out, q, k_cache, v_cache, block_table, seq_lens, b, kvh, group, C, \
                            block_size, max_blocks_per_seq, scale, sliding_window, soft_cap, dtype, q_stride, \
                            out_stride, row_stride)
            if (head_size % 16 == 0) {
                switch (head_size) {
                    case 64: ITEM512(4); break;
                    case 128: ITEM512(8); break;
                    default: ITEM512(head_size / 16); break;
                }
                continue;
            }
#undef ITEM512
#endif
#define ITEM(D) attend_item(out, q, k_cache, v_cache, block_table, seq_lens, b, kvh, group, D, block_size, \
                            max_blocks_per_seq, scale, sliding_window, soft_cap, dtype, q_stride, out_stride, row_stride)
            switch (head_size) {
                case 64: ITEM(64); break;
                case 128: ITEM(128); break;
                default: ITEM(head_size); break;
            }
#undef ITEM
        }
    }
    return 0;
}
