/* The whole decoder stack of a Llama-family or Gemma 3 model in one native call, for the CPU's small
 * steps (decodes and short chunks). Every layer, by the model's `layout`:
 *
 *   Llama:   [add +] RMSNorm -> qkv matmul [+ bias] -> RoPE(q, k) -> KV write -> paged attention
 *            -> o matmul -> add + RMSNorm -> gate|up matmul -> SiLU * up -> down matmul
 *   Gemma 3: RMSNorm -> qkv matmul [+ bias] -> RMSNorm of each q and k head -> RoPE(q, k) with the
 *            layer kind's table -> KV write -> paged attention -> o matmul -> RMSNorm -> add
 *            -> RMSNorm -> gate|up matmul -> GELU-tanh * up -> down matmul -> RMSNorm -> add
 *
 * where each linear layer may add its LoRA delta (the step's adapter segments, lora.c's shrink and
 * expand, after the base matmul and its bias, as services/worker/lora/layers.py adds it), then the
 * final [add +] RMSNorm, calling the same kernels the layers' modules call (quant_matmul.c,
 * fused_ops.c, paged_decode_attention.c, lora.c, each its own library, reached through the function
 * pointers in `Ops`), with the same arguments and thread counts, in the same order: the result is
 * bit for bit the modules' (tests/model/test_native_decoder.py). Gemma's norms hold 1 + w, so its
 * RMSNorm is the same kernel. What this removes is Python's share of a small step: ~10 module
 * calls, views and ctypes round trips per layer, ~2.5 ms of a 14 ms step for the default model at
 * one sequence.
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
                            int64_t q_stride, int64_t out_stride, int num_threads, int prefill_bf16);
typedef void (*gated_fn)(float *out, const float *x, int64_t num_tokens, int64_t inter, int num_threads);
typedef int (*lora_shrink_fn)(float *y, int64_t ld_y, const void *x, int64_t ld_x, const void *a, int64_t slot_stride,
                              int64_t ld_a, int64_t num_slots, const int32_t *seg_indptr, const int32_t *seg_slots,
                              int64_t num_segs, int64_t num_rows, int64_t rank, int64_t k, int dtype, int w_dtype,
                              int num_threads);
typedef int (*lora_expand_fn)(void *out, int64_t ld_out, const float *y, int64_t ld_y, const void *b,
                              int64_t slot_stride, int64_t ld_b, int64_t num_slots, const int32_t *seg_indptr,
                              const int32_t *seg_slots, int64_t num_segs, int64_t num_rows, int64_t n, int64_t rank,
                              int dtype, int w_dtype, int num_threads);

typedef struct {
    quant_matmul_fn matmul;
    quant_matmul_packed_fn matmul_packed;
    rms_norm_fn rms_norm;
    add_rms_norm_fn add_rms_norm;
    rope_fn rope;
    kv_write_fn kv_write;
    attention_fn attention;
    gated_fn silu_and_mul;
    gated_fn gelu_tanh_and_mul;
    lora_shrink_fn lora_shrink; /* NULL when the LoRA library is not built: then no layer has LoRA */
    lora_expand_fn lora_expand; /* lora.c's lora_expand_t: B stored transposed */
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

/* A linear layer's LoRA slots (services/worker/lora/layers.py), float32 or bfloat16 (`dtype`, lora.c's
 * code), zero-padded to Dims.lora_rank R. `a` [lora_slots, slices * R, cols] holds every slice's A along
 * R, shrunk once; slice i's B `b[i]` is stored transposed, [lora_slots, R, n[i]], and expanded into the
 * output's columns from offset[i]. `a` NULL: no LoRA. */
#define MAX_LORA_SLICES 3
typedef struct {
    const float *a;
    const float *b[MAX_LORA_SLICES];
    int64_t n[MAX_LORA_SLICES], offset[MAX_LORA_SLICES];
    int32_t slices, dtype;
} Lora;

enum { LAYOUT_LLAMA = 0, LAYOUT_GEMMA3 = 1 };

typedef struct {
    const float *input_norm, *post_norm; /* before attention; after it (Llama: before the MLP) */
    const float *pre_ffw_norm, *post_ffw_norm, *q_norm, *k_norm; /* Gemma 3's; q_norm, k_norm: [head_size] */
    Weight qkv, o, gate_up, down;
    Lora qkv_lora, o_lora, gate_up_lora, down_lora;
    void *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_size] */
    int32_t sliding_window;  /* 0: none */
    int32_t rope_table;      /* which of the step's cos_sin tables rotates this layer's q and k */
} Layer;

typedef struct {
    int32_t layout; /* LAYOUT_* */
    int32_t hidden, num_heads, num_kv_heads, head_size, inter, block_size;
    float eps, scale, soft_cap;
    int32_t num_threads;
    int64_t parallel_work; /* a matmul of fewer multiply-adds runs on one thread (cpu_quant_matmul) */
    int32_t lora_rank, lora_slots; /* every Lora's R and slot count */
} Dims;

/* One step's inputs: num_tokens rows; row i attends the first seq_lens[i] tokens of request
 * seq_of_row[i] (NULL: of request i) through block_table [.., max_blocks]. */
typedef struct {
    int64_t num_tokens;
    const float *cos_sin[2]; /* [num_tokens, head_size] each, by Layer.rope_table */
    const int64_t *slot_mapping;
    const int32_t *block_table, *seq_lens, *seq_of_row;
    int32_t max_blocks;
    /* LoRA: request i is rows seg_indptr[i]..seg_indptr[i + 1], adapter slot seg_slots[i] (-1: none);
     * seg_slots NULL: no request of the step has an adapter */
    const int32_t *seg_indptr, *seg_slots;
    int64_t num_segs;
    int32_t prefill_bf16; /* the attention kernel's: prefill tiles' products in bfloat16 */
} Step;

typedef struct {
    float *normed, *residual, *out; /* [n, hidden]: a norm's output, the residual stream, a sublayer's output */
    float *qkv;                     /* [n, (H + 2 Hkv) D] */
    float *attn;                    /* [n, H D] */
    float *gate_up;                 /* [n, 2 inter] */
    float *act;                     /* [n, inter] */
    float *lora_y;                  /* [n, MAX_LORA_SLICES * lora_rank]: the shrink's sums; NULL without LoRA */
} Scratch;

/* A LoRA kernel's refusal (bad segments), told apart from the attention kernel's. */
#define LORA_REJECTED 1000

/* y += each segment's LoRA delta of x, as LoRA layers add it: one shrink over every slice's A, then
 * each slice's expand into its columns. */
static int add_lora(const Ops *ops, const Dims *d, const Lora *lora, const Step *step, const Scratch *s,
                    int64_t n_out, float *y, const float *x, int64_t m, int64_t k) {
    const int64_t r = d->lora_rank, width = lora->slices * r;
    if (ops->lora_shrink(s->lora_y, width, x, k, lora->a, width * k, k, d->lora_slots, step->seg_indptr,
                         step->seg_slots, step->num_segs, m, width, k, 0, lora->dtype, d->num_threads) != 0)
        return LORA_REJECTED;
    for (int i = 0; i < lora->slices; i++)
        if (ops->lora_expand(y + lora->offset[i], n_out, s->lora_y + i * r, width, lora->b[i], lora->n[i] * r,
                             lora->n[i], d->lora_slots, step->seg_indptr, step->seg_slots, step->num_segs, m,
                             lora->n[i], r, 0, lora->dtype, d->num_threads) != 0)
            return LORA_REJECTED;
    return 0;
}

static int linear(const Ops *ops, const Dims *d, const Weight *w, const Lora *lora, const Step *step,
                  const Scratch *s, float *y, const float *x, int64_t m) {
    const int64_t n = w->rows, k = w->cols;
    const int threads = m * n * k >= d->parallel_work ? d->num_threads : 1;
    if (w->packed)
        ops->matmul_packed(y, n, x, k, w->data, m, n, k, threads);
    else
        ops->matmul(y, n, x, k, w->data, w->row_bytes, m, n, k, w->qtype, threads);
    if (w->bias != NULL)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) y[i * n + j] += w->bias[j];
    if (lora->a != NULL && step->seg_slots != NULL) return add_lora(ops, d, lora, step, s, n, y, x, m, k);
    return 0;
}

/* Gemma 3's QK-norm, in place in each token's q|k|v row: its H q heads, then its Hkv k heads, each
 * row of head_size normalised by the same kernel the module calls on [n * heads, head_size]. A
 * row's result does not depend on how the rows are grouped into calls. */
static void qk_norm(const Ops *ops, const Dims *d, const Layer *l, float *qkv, int64_t n, int64_t qkv_row) {
    const int D = d->head_size;
    for (int64_t t = 0; t < n; t++) {
        float *q = qkv + t * qkv_row, *k = q + (int64_t)d->num_heads * D;
        ops->rms_norm(q, q, l->q_norm, d->num_heads, D, d->eps, 0, d->num_threads);
        ops->rms_norm(k, k, l->k_norm, d->num_kv_heads, D, d->eps, 0, d->num_threads);
    }
}

/* The attention sublayer of s->normed: the o projection's output in s->out. */
static int attention(const Ops *ops, const Dims *d, const Layer *l, const Step *step, const Scratch *s) {
    const int64_t n = step->num_tokens;
    const int D = d->head_size, nt = d->num_threads;
    const int64_t q_size = (int64_t)d->num_heads * D, kv_size = (int64_t)d->num_kv_heads * D;
    const int64_t qkv_row = q_size + 2 * kv_size;
    int rc = linear(ops, d, &l->qkv, &l->qkv_lora, step, s, s->qkv, s->normed, n);
    if (rc != 0) return rc;
    if (d->layout == LAYOUT_GEMMA3) qk_norm(ops, d, l, s->qkv, n, qkv_row);
    ops->rope(s->qkv, qkv_row, step->cos_sin[l->rope_table], D, n, d->num_heads + d->num_kv_heads, D, 0, nt);
    ops->kv_write(l->k_cache, l->v_cache, (const char *)(s->qkv + q_size), (const char *)(s->qkv + q_size + kv_size),
                  step->slot_mapping, n, kv_size * (int64_t)sizeof(float), qkv_row * (int64_t)sizeof(float),
                  qkv_row * (int64_t)sizeof(float));
    rc = ops->attention(s->attn, s->qkv, l->k_cache, l->v_cache, step->block_table, step->seq_lens,
                                  step->seq_of_row, (int)n, d->num_heads, d->num_kv_heads, D, d->block_size,
                                  step->max_blocks, d->scale, l->sliding_window, d->soft_cap, 0, qkv_row,
                                  q_size, nt, step->prefill_bf16);
    if (rc != 0) return rc;
    return linear(ops, d, &l->o, &l->o_lora, step, s, s->out, s->attn, n);
}

/* The MLP of s->normed: the down projection's output in s->out. */
static int mlp(const Ops *ops, const Dims *d, const Layer *l, const Step *step, const Scratch *s) {
    const int64_t n = step->num_tokens;
    const int rc = linear(ops, d, &l->gate_up, &l->gate_up_lora, step, s, s->gate_up, s->normed, n);
    if (rc != 0) return rc;
    const gated_fn act = d->layout == LAYOUT_GEMMA3 ? ops->gelu_tanh_and_mul : ops->silu_and_mul;
    act(s->act, s->gate_up, n, d->inter, d->num_threads);
    return linear(ops, d, &l->down, &l->down_lora, step, s, s->out, s->act, n);
}

/* Llama's layer: the residual add before each norm is the norm's (add_rms_norm), so a layer leaves
 * its MLP's output in s->out for the next norm to add; the first layer's input norm has none. */
static int llama_layer(const Ops *ops, const Dims *d, const Layer *l, int first, const Step *step,
                       const Scratch *s) {
    const int64_t n = step->num_tokens;
    const int H = d->hidden, nt = d->num_threads;
    if (first)
        ops->rms_norm(s->normed, s->residual, l->input_norm, n, H, d->eps, 0, nt);
    else
        ops->add_rms_norm(s->normed, s->residual, s->out, s->residual, l->input_norm, n, H, d->eps, 0, nt);
    const int rc = attention(ops, d, l, step, s);
    if (rc != 0) return rc;
    ops->add_rms_norm(s->normed, s->residual, s->out, s->residual, l->post_norm, n, H, d->eps, 0, nt);
    return mlp(ops, d, l, step, s);
}

/* residual += x, as the module's `hidden_states + x` (one float add each, commutative). */
static void add_into(float *residual, const float *x, int64_t size) {
    for (int64_t i = 0; i < size; i++) residual[i] = residual[i] + x[i];
}

/* Gemma 3's layer: each sublayer's output is normed before the residual add, so the adds are plain
 * and the residual stream is whole in s->residual after every layer. */
static int gemma3_layer(const Ops *ops, const Dims *d, const Layer *l, const Step *step, const Scratch *s) {
    const int64_t n = step->num_tokens;
    const int H = d->hidden, nt = d->num_threads;
    ops->rms_norm(s->normed, s->residual, l->input_norm, n, H, d->eps, 0, nt);
    int rc = attention(ops, d, l, step, s);
    if (rc != 0) return rc;
    ops->rms_norm(s->normed, s->out, l->post_norm, n, H, d->eps, 0, nt);
    add_into(s->residual, s->normed, n * H);
    ops->rms_norm(s->normed, s->residual, l->pre_ffw_norm, n, H, d->eps, 0, nt);
    rc = mlp(ops, d, l, step, s);
    if (rc != 0) return rc;
    ops->rms_norm(s->normed, s->out, l->post_ffw_norm, n, H, d->eps, 0, nt);
    add_into(s->residual, s->normed, n * H);
    return 0;
}

/* hidden: [n, hidden] the embeddings, scaled as the model scales them (read only); final_norm: the
 * model's last RMSNorm. The normed last hidden states end in s->normed. Returns 0, the attention
 * kernel's error, or LORA_REJECTED. */
int decoder_forward(const Ops *ops, const Dims *d, const Layer *layers, int num_layers, const float *final_norm,
                    const Step *step, const float *hidden, const Scratch *s)
{
    const int64_t n = step->num_tokens;
    const int H = d->hidden, nt = d->num_threads;
    for (int64_t i = 0; i < n * H; i++) s->residual[i] = hidden[i];
    for (int li = 0; li < num_layers; li++) {
        const int rc = d->layout == LAYOUT_GEMMA3 ? gemma3_layer(ops, d, &layers[li], step, s)
                                                  : llama_layer(ops, d, &layers[li], li == 0, step, s);
        if (rc != 0) return rc;
    }
    if (d->layout == LAYOUT_GEMMA3)
        ops->rms_norm(s->normed, s->residual, final_norm, n, H, d->eps, 0, nt);
    else
        ops->add_rms_norm(s->normed, s->residual, s->out, s->residual, final_norm, n, H, d->eps, 0, nt);
    return 0;
}
