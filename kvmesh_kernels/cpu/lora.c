/*
 * Batched LoRA on the CPU (kvmesh_kernels/cpu_lora.py): the two halves of punica's SGMV over a flat batch
 * whose rows come in segments, segment i = rows seg_indptr[i]:seg_indptr[i+1], all of one adapter slot
 * seg_slots[i] (-1: no adapter).
 *
 *   lora_shrink  y[t, :R]               = A[slot] x[t]    A: [R, K] rows; y float32, zeros for slot -1
 *   lora_expand  out[t, :n] (+)= B[slot] y[t]    B: [n, R] rows; out rounded once to its dtype
 *
 * Both are the same product: every output is the dot of a row of the input (x, or y) with a row of the
 * slot's weight (A, or B), both contiguous along the reduction (K = in for shrink, R for expand). So one
 * tile serves both: MR input rows x NR weight rows, each of the MR * NR dots a vector accumulator over K,
 * reduced four at a time by a horizontal-add tree at the end:
 *
 *            K ------------------------>
 *   input    [r0 ..........................]   MR rows of one segment
 *            [r1 ..........................]
 *   weight   [w0 ..........................]   NR rows of the segment's slot
 *            [w1 ..........................]
 *            [w2 ..........................]
 *            [w3 ..........................]   -> MR x NR sums, K / VL FMAs each
 *
 * `lora_expand_t` takes B stored transposed, R rows of n (the worker's layout on the CPU): each y value
 * is broadcast against eight columns of a B row read in place, four rows of a segment sharing each
 * load, with nothing to reduce or transpose (a decode step of few rows per adapter is this path).
 *
 * Expand's reduction is short (R = 8..64), so with AVX2 it takes its own path: eight columns reduced
 * into one vector and added to out in one load and store (a decode row), or, for a segment of several
 * rows, B transposed a panel of columns at a time into float32 and each y value broadcast against
 * eight columns of it, with nothing to reduce (prefill).
 *
 * Inputs are float32 or bfloat16 (dtype 0 / 1; bfloat16 weights may serve float32 activations), widened
 * to float32 as they are loaded; the sums are float32 throughout. The threads share the flat rows in
 * blocks, each block walking the segments it overlaps, so one long prefill and many one-row decodes
 * spread alike. The vector path is chosen when
 * the file is compiled: AVX-512F, AVX2 + FMA, or portable C.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define NR 4 /* weight rows of a tile: one horizontal-add tree reduces four sums */
#define MAX_ROW_BLOCK 64 /* flat rows a thread takes at a time at most: a multiple of every MR */
/* A call stays on one thread below this many multiply-adds and this many weights streamed (a slot's
 * n x k for each segment that runs one): one adapter's decode row (rank 16 at hidden 576: 9 K each)
 * takes a few microseconds, about what waking a second OpenMP thread costs, while a decode step of
 * several adapters reads hundreds of kilobytes of their weights, faster on two cores than on one. */
#define PARALLEL_WORK (1 << 20)
#define PARALLEL_WEIGHTS (1 << 16)

enum { F32 = 0, BF16 = 1 };

#if defined(__AVX512F__)
#define ISA 512
#define VL 16
#define MR 4
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA 256
#define VL 8
#define MR 2
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define ISA 0
#define VL 8 /* eight scalar lanes: room for the compiler to vectorize */
#define MR 2
typedef struct { float v[VL]; } vec;
static inline vec VZERO(void) { vec r; for (int i = 0; i < VL; i++) r.v[i] = 0.f; return r; }
static inline vec VFMA(vec a, vec b, vec c) { for (int i = 0; i < VL; i++) c.v[i] += a.v[i] * b.v[i]; return c; }
#endif

int lora_isa(void) { return ISA; }

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

#if defined(__AVX2__) && defined(__FMA__)
/* 8 values from p (float32 or bfloat16) as float32 lanes; only the first `rem` when rem < 8, the other
 * lanes zero, and nothing read past them. */
static inline __attribute__((always_inline)) __m256 load8(const void *p, const int dtype, const int64_t rem) {
    if (dtype == F32) {
        if (rem >= 8) return _mm256_loadu_ps(p);
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rem), lane));
    }
    __m128i h;
    if (rem >= 8) {
        h = _mm_loadu_si128((const __m128i *)p);
    } else {
        uint16_t buf[8] = {0};
        memcpy(buf, p, (size_t)rem * sizeof(uint16_t));
        h = _mm_loadu_si128((const __m128i *)buf);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* VL values from p (float32 or bfloat16) as float32 lanes; only the first `rem` when rem < VL, the other
 * lanes zero, and nothing read past them. */
static inline __attribute__((always_inline)) vec vload(const void *p, const int dtype, const int64_t rem) {
#if ISA == 512
    if (dtype == F32)
        return rem >= VL ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << rem) - 1), p);
    __m256i h;
    if (rem >= VL) {
        h = _mm256_loadu_si256((const __m256i *)p);
    } else {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        h = _mm256_maskz_loadu_epi16((__mmask16)((1u << rem) - 1), p);
#else
        uint16_t buf[VL] = {0};
        memcpy(buf, p, (size_t)rem * sizeof(uint16_t));
        h = _mm256_loadu_si256((const __m256i *)buf);
#endif
    }
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif ISA == 256
    return load8(p, dtype, rem);
#else
    vec r = VZERO();
    const int64_t m = rem < VL ? rem : VL;
    for (int64_t i = 0; i < m; i++)
        r.v[i] = dtype == F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
    return r;
#endif
}

/* The four sums of a[0..3]'s lanes. */
static inline __attribute__((always_inline)) void reduce4(float s[NR], const vec a[NR]) {
#if ISA
#if ISA == 512
    __m256 h[NR];
    for (int j = 0; j < NR; j++)
        h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
#else
    const __m256 *h = a;
#endif
    /* lanes of t: [h0 h1 h2 h3 sums of the low 128 bits | the same of the high 128 bits] */
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
    for (int j = 0; j < NR; j++) {
        float sum = 0.f;
        for (int i = 0; i < VL; i++) sum += a[j].v[i];
        s[j] = sum;
    }
#endif
}

/* One segment's operands: input rows (x, or y) against its slot's weight rows (A, or B), sums over K. */
typedef struct {
    const char *in;   /* the flat batch's input rows, `ld_in` elements apart */
    const char *w;    /* the slot's weight rows, `ld_w` elements apart */
    char *out;        /* the flat batch's output rows, `ld_out` elements apart */
    int64_t ld_in, ld_w, ld_out;
    int64_t k;        /* the reduction length */
    int64_t n;        /* weight rows = outputs per input row */
    int in_dtype, w_dtype, out_dtype;
    int accumulate;   /* 0: out = sum (float32); 1: out = round(out + sum) in out_dtype */
    int transposed;   /* expand only: the slot's B stored as R rows of n (`ld_w` apart), not n rows of R */
} dot_args;

static inline size_t dtype_size(int dtype) { return dtype == F32 ? 4 : 2; }

/* One VL-wide step of the mr x nr dots at k (only `rem` lanes read when rem < VL). */
static inline __attribute__((always_inline)) void step(vec acc[MR][NR], const char *const xr[MR],
                                                       const char *const wr[NR], int64_t k, int64_t rem,
                                                       const int mr, const int nr, const int in_dt, const int w_dt) {
    const size_t isz = dtype_size(in_dt), wsz = dtype_size(w_dt);
    vec wv[NR];
    for (int c = 0; c < nr; c++) wv[c] = vload(wr[c] + (size_t)k * wsz, w_dt, rem);
    for (int m = 0; m < mr; m++) {
        const vec xv = vload(xr[m] + (size_t)k * isz, in_dt, rem);
        for (int c = 0; c < nr; c++) acc[m][c] = VFMA(xv, wv[c], acc[m][c]);
    }
}

/* The mr x nr dots of input rows t.. and weight rows j.., written to out. mr, nr and the dtypes are
 * constants where this is inlined (`tile_any`), so the loops below unroll into registers. */
static inline __attribute__((always_inline)) void tile(const dot_args *d, int64_t t, int64_t j, const int mr,
                                                       const int nr, const int in_dt, const int w_dt,
                                                       const int out_dt) {
    const size_t isz = dtype_size(in_dt), wsz = dtype_size(w_dt), osz = dtype_size(out_dt);
    const char *xr[MR], *wr[NR];
    for (int m = 0; m < mr; m++) xr[m] = d->in + (size_t)((t + m) * d->ld_in) * isz;
    for (int c = 0; c < nr; c++) wr[c] = d->w + (size_t)((j + c) * d->ld_w) * wsz;
    vec acc[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int c = 0; c < NR; c++) acc[m][c] = VZERO();
    int64_t k = 0;
    for (; k + VL <= d->k; k += VL) step(acc, xr, wr, k, VL, mr, nr, in_dt, w_dt);
    if (k < d->k) step(acc, xr, wr, k, d->k - k, mr, nr, in_dt, w_dt);
    for (int m = 0; m < mr; m++) {
        float s[NR];
        reduce4(s, acc[m]);
        char *o = d->out + (size_t)((t + m) * d->ld_out + j) * osz;
        for (int c = 0; c < nr; c++) {
            if (!d->accumulate)
                ((float *)o)[c] = s[c];
            else if (out_dt == F32)
                ((float *)o)[c] += s[c];
            else
                ((uint16_t *)o)[c] = f32_to_bf16(bf16_to_f32(((uint16_t *)o)[c]) + s[c]);
        }
    }
}

#define TILE_NR(mr, i, w, o)                                           \
    switch (nr) {                                                      \
    case 1: tile(d, t, j, mr, 1, i, w, o); break;                      \
    case 2: tile(d, t, j, mr, 2, i, w, o); break;                      \
    case 3: tile(d, t, j, mr, 3, i, w, o); break;                      \
    default: tile(d, t, j, mr, NR, i, w, o); break;                    \
    }

/* `tile` for the dtype combinations the two ops take (`dtypes_supported`): shrink's x and A into float32,
 * expand's float32 y against B into out, with mr = MR or 1 (a segment's last rows, and decode). */
#define TILE_DTYPES(mr)                                                                  \
    if (d->in_dtype == F32 && d->w_dtype == F32) { TILE_NR(mr, F32, F32, F32) }         \
    else if (d->in_dtype == BF16) { TILE_NR(mr, BF16, BF16, F32) }                      \
    else if (d->out_dtype == F32) { TILE_NR(mr, F32, BF16, F32) }                       \
    else { TILE_NR(mr, F32, BF16, BF16) }

static void tile_any(const dot_args *d, int64_t t, int64_t j, int mr, int nr) {
    if (mr == MR) {
        TILE_DTYPES(MR)
    } else {
        for (int m = 0; m < mr; m++, t++) { TILE_DTYPES(1) }
    }
}

/* Rows t0..t1 of one segment, every output of each. */
static void segment_rows(const dot_args *d, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t += MR) {
        const int mr = t1 - t < MR ? (int)(t1 - t) : MR;
        for (int64_t j = 0; j < d->n; j += NR) tile_any(d, t, j, mr, d->n - j < NR ? (int)(d->n - j) : NR);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define EXPAND8 1
/* The eight sums of a[0..7]'s lanes, in order. */
static inline __attribute__((always_inline)) __m256 reduce8(const __m256 a[8]) {
    /* u0: [a0..a3 sums of the low 128 bits | of the high 128 bits], u1 the same of a4..a7 */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Eight float32 lanes rounded to bfloat16 as f32_to_bf16 rounds one. */
static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* packus works within 128-bit halves: [r0..r3 r0..r3 | r4..r7 r4..r7]; qwords 0 and 2 are r0..r7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

/* out[j..j+cols) += the first cols lanes of s, rounded once to dtype. */
static inline __attribute__((always_inline)) void add8(char *o, const int dtype, __m256 s, const int cols) {
    if (cols == 8) {
        if (dtype == F32) {
            _mm256_storeu_ps((float *)o, _mm256_add_ps(_mm256_loadu_ps((const float *)o), s));
        } else {
            _mm_storeu_si128((__m128i *)o, bf16x8(_mm256_add_ps(load8(o, BF16, 8), s)));
        }
        return;
    }
    float sums[8];
    _mm256_storeu_ps(sums, s);
    for (int c = 0; c < cols; c++) {
        if (dtype == F32) ((float *)o)[c] += sums[c];
        else ((uint16_t *)o)[c] = f32_to_bf16(bf16_to_f32(((uint16_t *)o)[c]) + sums[c]);
    }
}

/* The sums of y over eight (or the last cols) rows of B at column j, R at a time in 8-lane steps. */
static inline __attribute__((always_inline)) __m256 expand8(const float *yr, const char *w, int64_t ld_w,
                                                            int64_t rank, const int cols, const int dtype) {
    const size_t wsz = dtype_size(dtype);
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= rank; k += 8) {
        const __m256 yv = _mm256_loadu_ps(yr + k);
        for (int c = 0; c < cols; c++)
            acc[c] = _mm256_fmadd_ps(load8(w + (size_t)(c * ld_w + k) * wsz, dtype, 8), yv, acc[c]);
    }
    if (k < rank) {
        const __m256 yv = load8(yr + k, F32, rank - k);
        for (int c = 0; c < cols; c++)
            acc[c] = _mm256_fmadd_ps(load8(w + (size_t)(c * ld_w + k) * wsz, dtype, rank - k), yv, acc[c]);
    }
    return reduce8(acc);
}

#define PANEL 64 /* columns (a multiple of 8) whose B rows a segment of several rows transposes at a time */
#define MAX_PANEL_RANK 256 /* the transposed panel, R x PANEL float32, stays on the stack (64 KB at most) */

/* out[t..t+mr) at columns j0.. += y rows times bt, B transposed ([rank][cols], rows ld_bt elements apart,
 * of bt_dtype; a row's last `cols % 8` values read masked): each y value broadcast against eight
 * columns, so nothing needs reducing and each load of bt serves mr rows. */
static inline __attribute__((always_inline)) void panel_rows(const dot_args *d, const char *bt, int64_t ld_bt,
                                                             const int bt_dtype, int64_t t, const int mr,
                                                             int64_t j0, int64_t cols, const int dtype) {
    const size_t osz = dtype_size(dtype), bsz = dtype_size(bt_dtype);
    const int64_t rank = d->k, ld_y = d->ld_in;
    const float *y = (const float *)d->in + t * ld_y;
    char *out = d->out + (size_t)(t * d->ld_out + j0) * osz;
    const size_t ld_out = (size_t)d->ld_out * osz;
    for (int64_t j = 0; j < cols; j += 8) {
        const int c = cols - j < 8 ? (int)(cols - j) : 8;
        __m256 acc[4];
        for (int m = 0; m < mr; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t k = 0; k < rank; k++) {
            const __m256 b = load8(bt + (size_t)(k * ld_bt + j) * bsz, bt_dtype, c);
            for (int m = 0; m < mr; m++) acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(y + m * ld_y + k), b, acc[m]);
        }
        for (int m = 0; m < mr; m++) add8(out + m * ld_out + (size_t)j * osz, dtype, acc[m], c);
    }
}

/* out[t..t+mr) += y rows times B stored transposed (the slot's R rows of n, ld_w apart, of dtype wdt),
 * 32 columns at a time: each y value is broadcast once against four vectors of its B row, and each B
 * load serves the mr (1 or 2) rows; 8 accumulators, 4 B vectors and a broadcast fit AVX2's 16
 * registers. The last columns go eight (then fewer, masked) at a time. */
static inline __attribute__((always_inline)) void transposed_rows(const dot_args *d, int64_t t, const int mr,
                                                                  const int dtype, const int wdt) {
    const size_t sz = dtype_size(dtype), wsz = dtype_size(wdt);
    const int64_t n = d->n, rank = d->k, ld_y = d->ld_in, ld_w = d->ld_w;
    const float *y = (const float *)d->in + t * ld_y;
    char *out = d->out + (size_t)(t * d->ld_out) * sz;
    const size_t ld_out = (size_t)d->ld_out * sz;
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        __m256 acc[2][4];
        for (int m = 0; m < mr; m++)
            for (int v = 0; v < 4; v++) acc[m][v] = _mm256_setzero_ps();
        for (int64_t k = 0; k < rank; k++) {
            const char *b = d->w + (size_t)(k * ld_w + j) * wsz;
            const __m256 b0 = load8(b, wdt, 8), b1 = load8(b + 8 * wsz, wdt, 8);
            const __m256 b2 = load8(b + 16 * wsz, wdt, 8), b3 = load8(b + 24 * wsz, wdt, 8);
            for (int m = 0; m < mr; m++) {
                const __m256 yv = _mm256_broadcast_ss(y + m * ld_y + k);
                acc[m][0] = _mm256_fmadd_ps(yv, b0, acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(yv, b1, acc[m][1]);
                acc[m][2] = _mm256_fmadd_ps(yv, b2, acc[m][2]);
                acc[m][3] = _mm256_fmadd_ps(yv, b3, acc[m][3]);
            }
        }
        for (int m = 0; m < mr; m++)
            for (int v = 0; v < 4; v++) add8(out + m * ld_out + (size_t)(j + 8 * v) * sz, dtype, acc[m][v], 8);
    }
    for (; j < n; j += 8) {
        const int c = n - j < 8 ? (int)(n - j) : 8;
        __m256 acc[2];
        for (int m = 0; m < mr; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t k = 0; k < rank; k++) {
            const __m256 b = load8(d->w + (size_t)(k * ld_w + j) * wsz, wdt, c);
            for (int m = 0; m < mr; m++) acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(y + m * ld_y + k), b, acc[m]);
        }
        for (int m = 0; m < mr; m++) add8(out + m * ld_out + (size_t)j * sz, dtype, acc[m], c);
    }
}

static inline __attribute__((always_inline)) void expand_rows_t(const dot_args *d, int64_t t0, int64_t t1,
                                                                const int dtype, const int wdt) {
    const size_t osz = dtype_size(dtype), wsz = dtype_size(wdt);
    const int64_t n = d->n, rank = d->k;
    if (d->transposed) {
        int64_t t = t0;
        for (; t + 2 <= t1; t += 2) transposed_rows(d, t, 2, dtype, wdt);
        if (t < t1) transposed_rows(d, t, 1, dtype, wdt);
        return;
    }
    if (t1 - t0 >= 4 && rank <= MAX_PANEL_RANK) {
        /* Several rows (prefill): transpose B a panel at a time, as float32, then broadcast-FMA. */
        float bt[MAX_PANEL_RANK * PANEL];
        for (int64_t p = 0; p < n; p += PANEL) {
            const int64_t cols = n - p < PANEL ? n - p : PANEL;
            for (int64_t c = 0; c < PANEL; c++) {
                const char *w = d->w + (size_t)((p + c) * d->ld_w) * wsz;
                for (int64_t k = 0; k < rank; k++)
                    bt[k * PANEL + c] = c >= cols ? 0.f
                                      : wdt == F32 ? ((const float *)w)[k] : bf16_to_f32(((const uint16_t *)w)[k]);
            }
            const char *panel = (const char *)bt;
            int64_t t = t0;
            for (; t + 4 <= t1; t += 4) panel_rows(d, panel, PANEL, F32, t, 4, p, cols, dtype);
            for (; t < t1; t++) panel_rows(d, panel, PANEL, F32, t, 1, p, cols, dtype);
        }
        return;
    }
    /* One row or a few (decode): dot products along R, eight columns reduced at once. */
    const int64_t full = n / 8 * 8;
    for (int64_t t = t0; t < t1; t++) {
        const float *yr = (const float *)d->in + t * d->ld_in;
        char *o = d->out + (size_t)(t * d->ld_out) * osz;
        for (int64_t j = 0; j < full; j += 8)
            add8(o + j * osz, dtype, expand8(yr, d->w + (size_t)(j * d->ld_w) * wsz, d->ld_w, rank, 8, wdt), 8);
        if (full < n) {
            const int cols = (int)(n - full);
            add8(o + full * osz, dtype, expand8(yr, d->w + (size_t)(full * d->ld_w) * wsz, d->ld_w, rank, cols, wdt),
                 cols);
        }
    }
}

/* Expand's rows t0..t1 of one segment, eight output columns at a time, each eight added to out in one
 * load and store (R is short: the generic tile's four-at-a-time reduction and one-by-one stores cost
 * more than its products). */
static void expand_rows(const dot_args *d, int64_t t0, int64_t t1) {
    if (d->out_dtype == F32 && d->w_dtype == F32) expand_rows_t(d, t0, t1, F32, F32);
    else if (d->out_dtype == F32) expand_rows_t(d, t0, t1, F32, BF16);
    else expand_rows_t(d, t0, t1, BF16, BF16);
}
#endif

#if !defined(EXPAND8)
/* Expand with B transposed, portable C: out[t, j] += sum over r of y[t, r] B[r, j], in float32, r in order. */
static void expand_rows(const dot_args *d, int64_t t0, int64_t t1) {
    const size_t wsz = dtype_size(d->w_dtype), osz = dtype_size(d->out_dtype);
    float sums[256];
    for (int64_t t = t0; t < t1; t++) {
        const float *y = (const float *)d->in + t * d->ld_in;
        char *o = d->out + (size_t)(t * d->ld_out) * osz;
        for (int64_t j0 = 0; j0 < d->n; j0 += 256) {
            const int64_t cols = d->n - j0 < 256 ? d->n - j0 : 256;
            for (int64_t j = 0; j < cols; j++) sums[j] = 0.f;
            for (int64_t r = 0; r < d->k; r++) {
                const char *b = d->w + (size_t)(r * d->ld_w + j0) * wsz;
                for (int64_t j = 0; j < cols; j++) {
                    const float w = d->w_dtype == F32 ? ((const float *)b)[j] : bf16_to_f32(((const uint16_t *)b)[j]);
                    sums[j] += y[r] * w;
                }
            }
            for (int64_t j = 0; j < cols; j++) {
                if (d->out_dtype == F32) ((float *)o)[j0 + j] += sums[j];
                else ((uint16_t *)o)[j0 + j] = f32_to_bf16(bf16_to_f32(((uint16_t *)o)[j0 + j]) + sums[j]);
            }
        }
    }
}
#endif

/* The last segment starting at or before row t (skipping empty ones: the largest such index). */
static int64_t segment_of(const int32_t *seg_indptr, int64_t num_segs, int64_t t) {
    int64_t lo = 0, hi = num_segs; /* seg_indptr[lo] <= t < seg_indptr[hi] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (seg_indptr[mid] <= t) lo = mid; else hi = mid;
    }
    return lo;
}

/* The activations' dtype (x for shrink, out for expand) against the weights': both float32, both
 * bfloat16, or bfloat16 weights with float32 activations (adapters kept at half the bytes). */
#define DTYPES_REFUSED 5
static int dtypes_supported(int dtype, int w_dtype) { return dtype == w_dtype || (dtype == F32 && w_dtype == BF16); }

/* 0 when the segments tile rows 0..num_rows in order and every slot is -1 or below num_slots; else
 * what is wrong (1: not from row 0, 2: a segment ends before it starts, 3: a slot out of range,
 * 4: not up to num_rows), before anything is read through them. */
static int check_segments(const int32_t *seg_indptr, const int32_t *seg_slots, int64_t num_segs,
                          int64_t num_rows, int64_t num_slots) {
    if (seg_indptr[0] != 0) return 1;
    for (int64_t s = 0; s < num_segs; s++) {
        if (seg_indptr[s + 1] < seg_indptr[s]) return 2;
        if (seg_slots[s] < -1 || seg_slots[s] >= num_slots) return 3;
    }
    return seg_indptr[num_segs] == num_rows ? 0 : 4;
}

/* Every segment's rows, threads taking a block of rows at a time; rows of slot -1 segments are zeroed
 * (shrink) or left alone (expand). `slot_stride` elements separate the slots' weights. */
static void run(dot_args d, const char *weights, int64_t slot_stride, const int32_t *seg_indptr,
                const int32_t *seg_slots, int64_t num_segs, int64_t num_rows, int num_threads) {
    const size_t wsz = dtype_size(d.w_dtype);
    const double work = (double)num_rows * (double)d.n * (double)d.k;
    int64_t adapted = 0; /* segments that run an adapter */
    for (int64_t s = 0; s < num_segs; s++) adapted += seg_slots[s] >= 0;
    const double streamed = (double)adapted * (double)d.n * (double)d.k;
    const int parallel = (work >= PARALLEL_WORK || streamed >= PARALLEL_WEIGHTS) && num_threads > 1;
    /* Blocks of MAX_ROW_BLOCK rows, or about four a thread where that leaves each fewer (a multiple of 4,
     * so of every MR): a long block amortises expand's transposed panels over more rows. */
    int64_t rows_per_block = MAX_ROW_BLOCK;
    if (parallel) {
        const int64_t share = (num_rows + 4 * num_threads - 1) / (4 * num_threads);
        rows_per_block = share < 4 ? 4 : (share > MAX_ROW_BLOCK ? MAX_ROW_BLOCK : (share + 3) / 4 * 4);
    }
    const int64_t num_blocks = (num_rows + rows_per_block - 1) / rows_per_block;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (parallel)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t b0 = b * rows_per_block, b1 = b0 + rows_per_block < num_rows ? b0 + rows_per_block : num_rows;
        for (int64_t s = segment_of(seg_indptr, num_segs, b0); s < num_segs && seg_indptr[s] < b1; s++) {
            const int64_t t0 = seg_indptr[s] > b0 ? seg_indptr[s] : b0;
            const int64_t t1 = seg_indptr[s + 1] < b1 ? seg_indptr[s + 1] : b1;
            if (t0 >= t1) continue;
            if (seg_slots[s] >= 0) {
                dot_args seg = d;
                seg.w = weights + (size_t)(seg_slots[s] * slot_stride) * wsz;
#if defined(EXPAND8)
                if (d.accumulate) { expand_rows(&seg, t0, t1); continue; }
#else
                if (d.transposed) { expand_rows(&seg, t0, t1); continue; }
#endif
                segment_rows(&seg, t0, t1);
            } else if (!d.accumulate) {
                for (int64_t t = t0; t < t1; t++) memset(d.out + (size_t)(t * d.ld_out) * 4, 0, (size_t)d.n * 4);
            }
        }
    }
}

/* y[t, :rank] = a[slot] @ x[t] for every row t of every segment (zeros for slot -1). x: [num_rows, k]
 * rows ld_x apart; a: [num_slots, rank, k], slot_stride and ld_a elements apart; y: float32, rows ld_y
 * apart. Returns `check_segments`' answer, and computes only when it is 0. */
int lora_shrink(float *y, int64_t ld_y, const void *x, int64_t ld_x, const void *a, int64_t slot_stride,
                int64_t ld_a, int64_t num_slots, const int32_t *seg_indptr, const int32_t *seg_slots,
                int64_t num_segs, int64_t num_rows, int64_t rank, int64_t k, int dtype, int w_dtype,
                int num_threads) {
    if (!dtypes_supported(dtype, w_dtype)) return DTYPES_REFUSED;
    const int bad = check_segments(seg_indptr, seg_slots, num_segs, num_rows, num_slots);
    if (bad) return bad;
    const dot_args d = {.in = x, .out = (char *)y, .ld_in = ld_x, .ld_w = ld_a, .ld_out = ld_y, .k = k,
                        .n = rank, .in_dtype = dtype, .w_dtype = w_dtype, .out_dtype = F32, .accumulate = 0};
    run(d, a, slot_stride, seg_indptr, seg_slots, num_segs, num_rows, num_threads);
    return 0;
}

/* Both expands: the checks, then every segment's rows; `transposed` says how each slot's B is stored. */
static int expand(void *out, int64_t ld_out, const float *y, int64_t ld_y, const void *b, int64_t slot_stride,
                  int64_t ld_b, int64_t num_slots, const int32_t *seg_indptr, const int32_t *seg_slots,
                  int64_t num_segs, int64_t num_rows, int64_t n, int64_t rank, int dtype, int w_dtype,
                  int num_threads, int transposed) {
    if (!dtypes_supported(dtype, w_dtype)) return DTYPES_REFUSED;
    const int bad = check_segments(seg_indptr, seg_slots, num_segs, num_rows, num_slots);
    if (bad) return bad;
    const dot_args d = {.in = (const char *)y, .out = out, .ld_in = ld_y, .ld_w = ld_b, .ld_out = ld_out,
                        .k = rank, .n = n, .in_dtype = F32, .w_dtype = w_dtype, .out_dtype = dtype, .accumulate = 1,
                        .transposed = transposed};
    run(d, b, slot_stride, seg_indptr, seg_slots, num_segs, num_rows, num_threads);
    return 0;
}

/* out[t, :n] += b[slot] @ y[t] for every row t of every segment of a slot >= 0, rounded once to out's
 * dtype. y: float32 [num_rows, rank] rows ld_y apart; b: [num_slots, n, rank] of w_dtype; out: rows
 * ld_out apart, already at its column offset. Returns as lora_shrink. */
int lora_expand(void *out, int64_t ld_out, const float *y, int64_t ld_y, const void *b, int64_t slot_stride,
                int64_t ld_b, int64_t num_slots, const int32_t *seg_indptr, const int32_t *seg_slots,
                int64_t num_segs, int64_t num_rows, int64_t n, int64_t rank, int dtype, int w_dtype,
                int num_threads) {
    return expand(out, ld_out, y, ld_y, b, slot_stride, ld_b, num_slots, seg_indptr, seg_slots, num_segs, num_rows,
                  n, rank, dtype, w_dtype, num_threads, 0);
}

/* lora_expand with B stored transposed: b: [num_slots, rank, n], each slot's R rows of n ld_b elements
 * apart (slot_stride between slots). */
int lora_expand_t(void *out, int64_t ld_out, const float *y, int64_t ld_y, const void *b, int64_t slot_stride,
                  int64_t ld_b, int64_t num_slots, const int32_t *seg_indptr, const int32_t *seg_slots,
                  int64_t num_segs, int64_t num_rows, int64_t n, int64_t rank, int dtype, int w_dtype,
                  int num_threads) {
    return expand(out, ld_out, y, ld_y, b, slot_stride, ld_b, num_slots, seg_indptr, seg_slots, num_segs, num_rows,
                  n, rank, dtype, w_dtype, num_threads, 1);
}
