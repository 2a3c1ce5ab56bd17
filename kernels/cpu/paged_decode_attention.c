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
