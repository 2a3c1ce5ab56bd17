/* The whole decoder stack of a Llama-family model in one native call, for the CPU's small steps
 * (decodes and short chunks): every layer's
 *
 *   [add +] RMSNorm -> qkv matmul [+ bias] -> RoPE(q, k) -> KV write -> paged attention -> o matmul
 *   -> add + RMSNorm -> gate|up matmul -> SiLU * up -> down matmul
 *
 * then the final add + RMSNorm, calling the same kernels the layers' modules call (quant_matmul.c,
 * fused_ops.c, paged_decode_attention.c, each its own library, reached through the function
 * pointers in `Ops`), with the same arguments and thread counts, in the same order: the result is
 * bit for bit the modules' (tests/unit/test_cpu_decoder.py). What it removes is Python's share of a
 * small step: ~10 module calls, views and ctypes round trips per layer, ~2.5 ms of a 14 ms step
 * for the default model at one sequence.
 *
 * Buffers are the caller's (`Scratch`); nothing is allocated here. */
#include <stdint.h>
#include <stddef.h>

typedef void (*quant_matmul_fn)(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *w,
                                int64_t row_bytes, int64_t M, int64_t N, int64_t K, int type, int num_threads);
typedef void (*quant_matmul_packed_fn)(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *packed,
                                       int64_t M, int64_t N, int64_t K, int num_threads);
typedef void (*rms_norm_fn)(void *out, const void *x, const void *weight, int64_t num_tokens, int hidden, float eps,
                            int dtype, int num_threads);
typedef void (*add_rms_norm_fn)(void *out, void *residual_out, const void *x, const void *residual,
                                const void *weight, int64_t num_tokens, int hidden, float eps, int dtype,
                                int num_threads);
typedef void (*rope_fn)(void *x, int64_t x_stride, const void *cos_sin, int64_t cs_stride, int64_t num_tokens,
                        int num_heads, int head_size, int dtype, int num_threads);
typedef void (*kv_write_fn)(char *k_cache, char *v_cache, const char *k, const char *v, const int64_t *slots,
                            int64_t num_tokens, int64_t row_bytes, int64_t k_stride_bytes, int64_t v_stride_bytes);
typedef int (*attention_fn)(void *out, const void *q, const void *k_cache, const void *v_cache,
                            const int32_t *block_table, const int32_t *seq_lens, const int32_t *seq_of_row,
                            int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size,
                            int max_blocks_per_seq, float scale, int sliding_window, float soft_cap, int dtype,
                            int64_t q_stride, int64_t out_stride, int num_threads);
typedef void (*silu_and_mul_fn)(float *out, const float *x, int64_t num_tokens, int64_t inter, int num_threads);

typedef struct {
    quant_matmul_fn matmul;
    quant_matmul_packed_fn matmul_packed;
    rms_norm_fn rms_norm;
    add_rms_norm_fn add_rms_norm;
    rope_fn rope;
    kv_write_fn kv_write;
    attention_fn attention;
    silu_and_mul_fn silu_and_mul;
} Ops;

/* A [rows, cols] weight in GGUF blocks: row-order blocks (row_bytes apart) or, with packed, the
 * Q4_1 panel layout of quant_pack_q4_1; bias NULL or [rows]. */
typedef struct {
    const uint8_t *data;
    const float *bias;
    int64_t row_bytes;
    int64_t rows, cols;
    int32_t qtype, packed;
} Weight;

typedef struct {
    const float *input_norm, *post_norm;
    Weight qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_size] */
    int32_t sliding_window;  /* 0: none */
} Layer;

typedef struct {
    int32_t hidden, num_heads, num_kv_heads, head_size, inter, block_size;
    float eps, scale, soft_cap;
    int32_t num_threads;
    int64_t parallel_work; /* a matmul of fewer multiply-adds runs on one thread (cpu_quant_matmul) */
} Dims;

/* One step's inputs: num_tokens rows; row i attends the first seq_lens[i] tokens of request
 * seq_of_row[i] (NULL: of request i) through block_table [.., max_blocks]. */
typedef struct {
    int64_t num_tokens;
    const float *cos_sin; /* [num_tokens, head_size] */
    const int64_t *slot_mapping;
    const int32_t *block_table, *seq_lens, *seq_of_row;
    int32_t max_blocks;
} Step;

typedef struct {
    float *normed, *residual, *out; /* [n, hidden]: a norm's output, the residual stream, a sublayer's output */
    float *qkv;                     /* [n, (H + 2 Hkv) D] */
    float *attn;                    /* [n, H D] */
    float *gate_up;                 /* [n, 2 inter] */
    float *act;                     /* [n, inter] */
} Scratch;

static void linear(const Ops *ops, const Dims *d, const Weight *w, float *y, const float *x, int64_t m) {
    const int64_t n = w->rows, k = w->cols;
    const int threads = m * n * k >= d->parallel_work ? d->num_threads : 1;
    if (w->packed)
        ops->matmul_packed(y, n, x, k, w->data, m, n, k, threads);
    else
        ops->matmul(y, n, x, k, w->data, w->row_bytes, m, n, k, w->qtype, threads);
    if (w->bias != NULL)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) y[i * n + j] += w->bias[j];
}

/* hidden: [n, hidden] the embeddings (read only); final_norm: the model's last RMSNorm.
 * The normed last hidden states end in s->normed. Returns 0, or the attention kernel's error. */
int decoder_forward(const Ops *ops, const Dims *d, const Layer *layers, int num_layers, const float *final_norm,
                    const Step *step, const float *hidden, const Scratch *s)
{
    const int64_t n = step->num_tokens;
    const int H = d->hidden, D = d->head_size, nt = d->num_threads;
    const int64_t q_size = (int64_t)d->num_heads * D, kv_size = (int64_t)d->num_kv_heads * D;
    const int64_t qkv_row = q_size + 2 * kv_size;
    for (int li = 0; li < num_layers; li++) {
        const Layer *l = &layers[li];
        if (li == 0) {
            for (int64_t i = 0; i < n * H; i++) s->residual[i] = hidden[i];
            ops->rms_norm(s->normed, s->residual, l->input_norm, n, H, d->eps, 0, nt);
        } else {
            ops->add_rms_norm(s->normed, s->residual, s->out, s->residual, l->input_norm, n, H, d->eps, 0, nt);
        }
        linear(ops, d, &l->qkv, s->qkv, s->normed, n);
        ops->rope(s->qkv, qkv_row, step->cos_sin, D, n, d->num_heads + d->num_kv_heads, D, 0, nt);
        ops->kv_write(l->k_cache, l->v_cache, (const char *)(s->qkv + q_size), (const char *)(s->qkv + q_size + kv_size),
                      step->slot_mapping, n, kv_size * (int64_t)sizeof(float), qkv_row * (int64_t)sizeof(float),
                      qkv_row * (int64_t)sizeof(float));
        const int rc = ops->attention(s->attn, s->qkv, l->k_cache, l->v_cache, step->block_table, step->seq_lens,
                                      step->seq_of_row, (int)n, d->num_heads, d->num_kv_heads, D, d->block_size,
                                      step->max_blocks, d->scale, l->sliding_window, d->soft_cap, 0, qkv_row,
                                      q_size, nt);
        if (rc != 0) return rc;
        linear(ops, d, &l->o, s->out, s->attn, n);
        ops->add_rms_norm(s->normed, s->residual, s->out, s->residual, l->post_norm, n, H, d->eps, 0, nt);
        linear(ops, d, &l->gate_up, s->gate_up, s->normed, n);
        ops->silu_and_mul(s->act, s->gate_up, n, d->inter, nt);
        linear(ops, d, &l->down, s->out, s->act, n);
    }
    ops->add_rms_norm(s->normed, s->residual, s->out, s->residual, final_norm, n, H, d->eps, 0, nt);
    return 0;
}
