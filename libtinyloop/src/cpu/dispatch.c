/* cpu/dispatch.c — the public CPU kernel entry points (cpu/kernels.h).
 *
 * Picks the AVX-512 VNNI, the AVX2/FMA/F16C or the portable table of inner kernels once
 * (the best this CPU runs), splits work
 * over the thread pool and does the bookkeeping that does not depend on the
 * instruction set (norm weights, RoPE angles, softmax structure). */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "base/debug_flags.h"
#include "base/log.h"
#include "cpu/kernels.h"
#include "cpu/kernels_impl.h"

/* ---- path selection ------------------------------------------------------ */

/* The best level this CPU and this build run (__builtin_cpu_supports also checks that
 * the OS saves the AVX / AVX-512 registers). */
tl_cpu_level tl_cpu_best_level(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c")))
        return TL_CPU_GENERIC;
#ifdef TL_HAVE_AVX512VNNI_KERNELS
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
        return TL_CPU_AVX512VNNI;
#endif
    return TL_CPU_AVX2;
#else
    return TL_CPU_GENERIC;
#endif
}

tl_cpu_level tl_cpu_built_level(void) {
#ifdef TL_HAVE_AVX512VNNI_KERNELS
    return TL_CPU_AVX512VNNI;
#else
    return TL_CPU_AVX2;
#endif
}

static pthread_once_t detect_once = PTHREAD_ONCE_INIT;
static atomic_int current_level = TL_CPU_GENERIC;

/* TINYLOOP_CPU (base/debug_flags.c): the level it names, or -1 when unset; another
 * value is a warning, since a benchmark meant for one path must not silently run another. */
static int level_cap(void) {
    const char *value = tl_debug_value(TL_FLAG_CPU);
    if (!value) return -1;
    for (int level = TL_CPU_GENERIC; level <= TL_CPU_AVX512VNNI; level++)
        if (strcmp(value, tl_cpu_level_name((tl_cpu_level)level)) == 0) return level;
    tl_log(TL_LOG_WARN, "%s=%s is not one of %s: ignored", tl_debug_flag_name(TL_FLAG_CPU), value,
           tl_debug_flag_values(TL_FLAG_CPU));
    return -1;
}

/* The best level, capped by TINYLOOP_CPU. */
static void detect(void) {
    tl_cpu_level level = tl_cpu_best_level();
    int cap = level_cap();
    atomic_store(&current_level, cap >= 0 && (tl_cpu_level)cap < level ? (tl_cpu_level)cap : level);
}

tl_cpu_level tl_cpu_features(void) {
    pthread_once(&detect_once, detect);
    return (tl_cpu_level)atomic_load_explicit(&current_level, memory_order_relaxed);
}

const char *tl_cpu_level_name(tl_cpu_level level) {
    switch (level) {
    case TL_CPU_AVX512VNNI: return "avx512vnni";
    case TL_CPU_AVX2: return "avx2";
    default: return "generic";
    }
}

int tl_cpu_set_level(tl_cpu_level level) {
    pthread_once(&detect_once, detect);
    if (level < TL_CPU_GENERIC || level > tl_cpu_best_level()) return -1;
    atomic_store(&current_level, level);
    return 0;
}

static const tl_cpu_ops *ops(void) {
    switch (tl_cpu_features()) {
#ifdef TL_HAVE_AVX512VNNI_KERNELS
    case TL_CPU_AVX512VNNI: return &tl_cpu_ops_avx512vnni;
#endif
    case TL_CPU_AVX2: return &tl_cpu_ops_avx2;
    default: return &tl_cpu_ops_generic;
    }
}

/* ---- matmul ---------------------------------------------------------------- */

/* Rows per work item grain: the AVX2 kernel keeps this many weight rows in L1 while
 * it walks the input rows. */
#define MATMUL_ROW_GRAIN 16

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t tl_cpu_matmul_scratch_bytes(const tl_tensor *w, int n) {
    if (!tl_dtype_is_quantized(w->dtype) || n <= 0) return 0;
    size_t blocks = (size_t)n * (size_t)(w->cols / TL_QBLOCK);
    return align64((size_t)n * (size_t)w->cols * sizeof(int16_t)) + 2 * align64(blocks * sizeof(float));
}

typedef struct matmul_job {
    const tl_cpu_ops *ops;
    int count;
    const tl_tensor *const *ws;
    int64_t row_end[TL_CPU_MATMUL_MAX_MULTI]; /* cumulative rows: weight t owns [end[t-1], end[t]) */
    const float *x;
    int n;
    size_t ldx;
    float *const *ys;
    const size_t *ldys;
    tl_qact qa;
    int16_t *qs;
    float *qd, *qsum;
} matmul_job;

static void quantize_rows_task(void *arg, int begin, int end, int thread_index) {
    matmul_job *job = arg;
    int64_t cols = job->qa.cols, nb = cols / TL_QBLOCK;
    for (int i = begin; i < end; i++)
        job->ops->quantize_row(job->x + (size_t)i * job->ldx, cols, job->qs + i * cols,
                               job->qd + i * nb, job->qsum + i * nb);
}

static void matmul_rows_task(void *arg, int begin, int end, int thread_index) {
    matmul_job *job = arg;
    int64_t start = 0;
    for (int t = 0; t < job->count; start = job->row_end[t], t++) {
        int64_t r0 = begin > start ? begin : start;
        int64_t r1 = end < job->row_end[t] ? end : job->row_end[t];
        if (r0 >= r1) continue;
        const tl_tensor *w = job->ws[t];
        if (tl_dtype_is_quantized(w->dtype))
            job->ops->matmul_quant_rows(w, &job->qa, job->n, job->ys[t], job->ldys[t],
                                        r0 - start, r1 - start);
        else
            job->ops->matmul_float_rows(w, job->x, job->n, job->ldx, job->ys[t], job->ldys[t],
                                        r0 - start, r1 - start);
    }
}

void tl_cpu_matmul_multi(const tl_tensor *const *ws, int count, const float *x, int n,
                         size_t ldx, float *const *ys, const size_t *ldys, void *scratch,
                         tl_threadpool *pool) {
    if (n <= 0 || count <= 0) return;
    if (count > TL_CPU_MATMUL_MAX_MULTI) { /* more than one job holds: run them in slices */
        tl_cpu_matmul_multi(ws, TL_CPU_MATMUL_MAX_MULTI, x, n, ldx, ys, ldys, scratch, pool);
        tl_cpu_matmul_multi(ws + TL_CPU_MATMUL_MAX_MULTI, count - TL_CPU_MATMUL_MAX_MULTI, x, n, ldx,
                            ys + TL_CPU_MATMUL_MAX_MULTI, ldys + TL_CPU_MATMUL_MAX_MULTI, scratch, pool);
        return;
    }
    matmul_job job = {.ops = ops(), .count = count, .ws = ws, .x = x, .n = n, .ldx = ldx,
                      .ys = ys, .ldys = ldys};
    int any_quantized = 0;
    int64_t total = 0;
    for (int t = 0; t < count; t++) {
        total += ws[t]->rows;
        job.row_end[t] = total;
        any_quantized |= tl_dtype_is_quantized(ws[t]->dtype);
    }
    if (any_quantized) {
        int64_t cols = ws[0]->cols;
        size_t blocks = (size_t)n * (size_t)(cols / TL_QBLOCK);
        job.qs = scratch;
        job.qd = (float *)((char *)scratch + align64((size_t)n * (size_t)cols * sizeof(int16_t)));
        job.qsum = (float *)((char *)job.qd + align64(blocks * sizeof(float)));
        job.qa = (tl_qact){.qs = job.qs, .d = job.qd, .s = job.qsum, .cols = cols};
        /* one row is ~1 us of work: only prefill is worth splitting */
        if (n >= 4)
            tl_parallel_for(pool, n, 1, quantize_rows_task, &job);
        else
            quantize_rows_task(&job, 0, n, 0);
    }
    tl_parallel_for(pool, (int)total, MATMUL_ROW_GRAIN, matmul_rows_task, &job);
}

void tl_cpu_matmul(const tl_tensor *w, const float *x, int n, size_t ldx, float *y, size_t ldy,
                   void *scratch, tl_threadpool *pool) {
    tl_cpu_matmul_multi(&w, 1, x, n, ldx, &y, &ldy, scratch, pool);
}

void tl_cpu_dequant_row(const tl_tensor *w, int64_t row, float *out) {
    if (!tl_dtype_is_quantized(w->dtype)) {
        tl_convert_float_row(w, row, 0, (int)w->cols, out);
        return;
    }
    int64_t nb = w->cols / TL_QBLOCK, ng = w->cols / w->group;
    for (int64_t b = 0; b < nb; b++) {
        int8_t q[TL_QBLOCK];
        tl_unpack_qblock(w, row, b, q);
        int64_t g = row * ng + b * TL_QBLOCK / w->group;
        float scale = tl_half_to_float(w->scales[g]);
        float min = w->mins ? tl_half_to_float(w->mins[g]) : 0.0f;
        for (int j = 0; j < TL_QBLOCK; j++) out[b * TL_QBLOCK + j] = scale * (float)q[j] + min;
    }
}

/* ---- norms and elementwise ops -------------------------------------------- */

/* Element j of a 1-D f32/f16/bf16 tensor (norm weights, biases). */
static inline float vector_at(const tl_tensor *t, int j) {
    switch (t->dtype) {
    case TL_DTYPE_F32: return ((const float *)t->data)[j];
    case TL_DTYPE_F16: return tl_half_to_float(((const uint16_t *)t->data)[j]);
    default: return tl_bfloat_to_float(((const uint16_t *)t->data)[j]);
    }
}

void tl_cpu_rmsnorm(const float *x, int n, int d, const tl_tensor *weight, int unit_offset,
                    float eps, float *out) {
    const tl_cpu_ops *k = ops();
    float offset = unit_offset ? 1.0f : 0.0f;
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d;
        float *oi = out + (size_t)i * d;
        float inv = 1.0f / sqrtf(k->sum_squares(xi, d) / (float)d + eps);
        for (int j = 0; j < d; j++) oi[j] = xi[j] * inv * (offset + vector_at(weight, j));
    }
}

void tl_cpu_layernorm(const float *x, int n, int d, const tl_tensor *weight,
                      const tl_tensor *bias, float eps, float *out) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d;
        float *oi = out + (size_t)i * d;
        float mean = 0.0f, var = 0.0f;
        for (int j = 0; j < d; j++) mean += xi[j];
        mean /= (float)d;
        for (int j = 0; j < d; j++) var += (xi[j] - mean) * (xi[j] - mean);
        float inv = 1.0f / sqrtf(var / (float)d + eps);
        for (int j = 0; j < d; j++)
            oi[j] = (xi[j] - mean) * inv * vector_at(weight, j) + (bias ? vector_at(bias, j) : 0.0f);
    }
}

void tl_cpu_rope_table(int n, int rope_dims, float theta, const float *factors,
                       const int32_t *positions, float *table) {
    int pairs = rope_dims / 2;
    for (int i = 0; i < n; i++) {
        float *c = table + (size_t)i * rope_dims, *s = c + pairs;
        for (int p = 0; p < pairs; p++) {
            /* angles in double: positions reach thousands of radians */
            double freq = pow((double)theta, -2.0 * p / rope_dims);
            if (factors) freq /= (double)factors[p];
            double angle = (double)positions[i] * freq;
            c[p] = (float)cos(angle);
            s[p] = (float)sin(angle);
        }
    }
}

void tl_cpu_rope_apply(float *x, int n, int n_heads, int head_dim, int rope_dims, int style,
                       const float *table) {
    int pairs = rope_dims / 2;
    for (int i = 0; i < n; i++) {
        const float *c = table + (size_t)i * rope_dims, *s = c + pairs;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)i * n_heads + h) * head_dim;
            for (int p = 0; p < pairs; p++) {
                int ia = style ? 2 * p : p;
                int ib = style ? ia + 1 : ia + pairs;
                float a = v[ia], b = v[ib];
                v[ia] = a * c[p] - b * s[p];
                v[ib] = a * s[p] + b * c[p];
            }
        }
    }
}

void tl_cpu_gated_act(const float *gate, const float *up, size_t count, int act, float *out) {
    ops()->gated_act(gate, up, count, act, out);
}

void tl_cpu_add(float *y, const float *x, size_t count) { ops()->add(y, x, count); }

void tl_cpu_add_bias(float *y, int n, int d, const tl_tensor *b) {
    const tl_cpu_ops *k = ops();
    for (int i = 0; i < n; i++) {
        float *yi = y + (size_t)i * d;
        if (b->dtype == TL_DTYPE_F32)
            k->add(yi, b->data, (size_t)d);
        else
            for (int j = 0; j < d; j++) yi[j] += vector_at(b, j);
    }
}

float tl_cpu_logsumexp(const float *x, int n) {
    float max = -INFINITY;
    for (int j = 0; j < n; j++) max = fmaxf(max, x[j]);
    if (!isfinite(max)) return max;
    return max + logf(ops()->exp_sum(NULL, x, n, max));
}

/* ---- attention --------------------------------------------------------------- */

/* Per-thread score rows are padded to a cache line. */
static size_t score_stride(int len) { return ((size_t)len + 15) & ~(size_t)15; }

size_t tl_cpu_attention_scratch_bytes(int n_threads, int n_head, int max_seq) {
    if (n_threads < 1) n_threads = 1;
    /* prefill: one score row per thread; one query row: one score row per head and
     * the heads' exp sums */
    int rows = n_threads > n_head ? n_threads : n_head;
    return ((size_t)rows * score_stride(max_seq) + score_stride(n_head)) * sizeof(float);
}

typedef struct attention_job {
    const tl_cpu_ops *ops;
    const float *q, *k_cache, *v_cache;
    float *out, *scratch;
    int n_head, head_dim, group, pos0, window;
    size_t kv_stride, stride;
    float scale;
    /* one query row: the visible keys [first, first + len) and each head's exp sum */
    int first, len;
    float *sums;
    const tl_cpu_kv_pages *pages;   /* NULL: k_cache / v_cache are contiguous rows */
    int ring;                       /* > 0: position p at row p mod ring */
} attention_job;

/* Rows row.. of the keys (plane 0) or values (plane 1) as far as they lie in one run at
 * kv_stride: all len of them when contiguous, up to the end of the page when paged, up
 * to the end of a ring (row is a position there). */
static const float *kv_run(const attention_job *job, int plane, int row, int len, int *run) {
    const tl_cpu_kv_pages *pg = job->pages;
    if (job->ring) {
        row %= job->ring;
        if (len > job->ring - row) len = job->ring - row;
    }
    if (!pg) {
        *run = len;
        return (plane ? job->v_cache : job->k_cache) + (size_t)row * job->kv_stride;
    }
    int size = 1 << pg->shift, in_page = row & (size - 1);
    *run = len < size - in_page ? len : size - in_page;
    return pg->table[row >> pg->shift] + (plane ? pg->v_off : pg->k_off) + (size_t)in_page * job->kv_stride;
}

/* scores[j] = scale * q . key(row0 + j) + col, for j < len, page run by page run (the
 * same floats as one call: each score is its own dot product). */
static void dot_keys(const attention_job *job, const float *q, int row0, int len, size_t col, float *scores) {
    for (int j = 0, run = 0; j < len; j += run) {
        const float *keys = kv_run(job, 0, row0 + j, len - j, &run) + col;
        job->ops->dot_rows(q, keys, job->kv_stride, run, job->head_dim, job->scale, scores + j);
    }
}

/* o[0..width) += sum_j p[j] value(row0 + j)[col..], in row order run by run (axpy_rows
 * accumulates row after row, so the split changes no float). */
static void axpy_values(const attention_job *job, float *o, const float *p, int row0, int len, size_t col,
                        int width) {
    for (int j = 0, run = 0; j < len; j += run) {
        const float *vals = kv_run(job, 1, row0 + j, len - j, &run) + col;
        job->ops->axpy_rows(o, p + j, vals, job->kv_stride, run, width);
    }
}

static float max_of(const float *x, int n) {
    float max = -INFINITY;
    for (int j = 0; j < n; j++) max = x[j] > max ? x[j] : max;   /* scores are never NaN */
    return max;
}

/* The first visible key of the query at `pos`. */
static int first_key(int pos, int window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* Head h's output from its exp(score - max) row p over value rows row0..row0+len: the
 * weighted sum of values (columns col.. of width), then one division. */
static void weighted_values(const attention_job *job, float *o, const float *p, int row0, size_t col,
                            int len, int width, float sum) {
    memset(o, 0, (size_t)width * sizeof *o);
    axpy_values(job, o, p, row0, len, col, width);
    job->ops->scale(o, 1.0f / sum, width);
}

/* Many query rows (prefill): one item per (row, head), scores in the thread's own row. */
static void attention_task(void *arg, int begin, int end, int thread_index) {
    const attention_job *job = arg;
    const tl_cpu_ops *k = job->ops;
    float *scores = job->scratch + (size_t)thread_index * job->stride;
    int hd = job->head_dim;
    for (int item = begin; item < end; item++) {
        int i = item / job->n_head, h = item % job->n_head;
        int pos = job->pos0 + i;
        int first = first_key(pos, job->window);
        int len = pos - first + 1;
        size_t q_off = ((size_t)i * job->n_head + h) * hd;
        const float *q = job->q + q_off;
        size_t col = (size_t)(h / job->group) * hd;
        /* two passes: scores and their max, then exp and the weighted sum of values */
        dot_keys(job, q, first, len, col, scores);
        float max = max_of(scores, len);
        float sum = k->exp_sum(scores, scores, len, max);
        weighted_values(job, job->out + q_off, scores, first, col, len, hd, sum);
    }
}

/* One query row (decode). Its n_head items alone would leave most KV rows read from
 * memory once per query head of their group, and split unevenly over the threads;
 * instead every KV row is read once for all heads of its group, in three steps whose
 * arithmetic per head is that of attention_task (the same results, bit for bit):
 *   1. scores, items (KV head, block of keys);
 *   2. per head max and exp, inline (a few thousand exps);
 *   3. weighted values, items (KV head, block of columns). */
#define DECODE_KEY_BLOCK 64
#define DECODE_COL_BLOCK 32   /* a multiple of 8: vector / scalar tails fall as in one call */

static void decode_scores_task(void *arg, int begin, int end, int thread_index) {
    const attention_job *job = arg;
    int hd = job->head_dim, blocks = (job->len + DECODE_KEY_BLOCK - 1) / DECODE_KEY_BLOCK;
    for (int item = begin; item < end; item++) {
        int kvh = item / blocks, j0 = (item % blocks) * DECODE_KEY_BLOCK;
        int j1 = j0 + DECODE_KEY_BLOCK < job->len ? j0 + DECODE_KEY_BLOCK : job->len;
        /* the block's keys stay in L1 while every head of the group reads them */
        for (int h = kvh * job->group; h < (kvh + 1) * job->group; h++)
            dot_keys(job, job->q + (size_t)h * hd, job->first + j0, j1 - j0, (size_t)kvh * hd,
                     job->scratch + (size_t)h * job->stride + j0);
    }
}

static void decode_values_task(void *arg, int begin, int end, int thread_index) {
    const attention_job *job = arg;
    int hd = job->head_dim, blocks = (hd + DECODE_COL_BLOCK - 1) / DECODE_COL_BLOCK;
    for (int item = begin; item < end; item++) {
        int kvh = item / blocks, c0 = (item % blocks) * DECODE_COL_BLOCK;
        int width = hd - c0 < DECODE_COL_BLOCK ? hd - c0 : DECODE_COL_BLOCK;
        for (int h = kvh * job->group; h < (kvh + 1) * job->group; h++)
            weighted_values(job, job->out + (size_t)h * hd + c0, job->scratch + (size_t)h * job->stride,
                            job->first, (size_t)kvh * hd + c0, job->len, width, job->sums[h]);
    }
}

static void attention_one_row(attention_job *job, tl_threadpool *pool) {
    int n_kv_head = job->n_head / job->group;
    float *sums = job->scratch + (size_t)job->n_head * job->stride;
    job->first = first_key(job->pos0, job->window);
    job->len = job->pos0 - job->first + 1;
    job->sums = sums;
    int key_blocks = (job->len + DECODE_KEY_BLOCK - 1) / DECODE_KEY_BLOCK;
    tl_parallel_for(pool, n_kv_head * key_blocks, 1, decode_scores_task, job);
    for (int h = 0; h < job->n_head; h++) {
        float *scores = job->scratch + (size_t)h * job->stride;
        float max = max_of(scores, job->len);
        sums[h] = job->ops->exp_sum(scores, scores, job->len, max);
    }
    int col_blocks = (job->head_dim + DECODE_COL_BLOCK - 1) / DECODE_COL_BLOCK;
    tl_parallel_for(pool, n_kv_head * col_blocks, 1, decode_values_task, job);
}

static void attention_rows(const float *q, int n, int pos0, const float *k_cache, const float *v_cache,
                           const tl_cpu_kv_pages *pages, int ring, int n_head, int n_kv_head, int head_dim,
                           float scale, int window, float *out, void *scratch, tl_threadpool *pool) {
    /* the longest row is pos0 + n keys, or the window's, within the max_seq (a ring's
       rows) the scratch was sized for */
    int keys = ring && window < pos0 + n ? window : pos0 + n;
    attention_job job = { .pages = pages, .ring = ring,
        .ops = ops(), .q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out,
        .scratch = scratch, .n_head = n_head, .head_dim = head_dim,
        .group = n_head / n_kv_head, .pos0 = pos0, .window = window,
        .kv_stride = (size_t)n_kv_head * head_dim,
        .stride = score_stride(keys), .scale = scale};
    if (n == 1)
        attention_one_row(&job, pool);
    else
        tl_parallel_for(pool, n * n_head, 1, attention_task, &job);
}

void tl_cpu_attention(const float *q, int n, int pos0, const float *k_cache,
                      const float *v_cache, int n_head, int n_kv_head, int head_dim,
                      float scale, int window, float *out, void *scratch,
                      tl_threadpool *pool) {
    attention_rows(q, n, pos0, k_cache, v_cache, NULL, 0, n_head, n_kv_head, head_dim, scale, window, out,
                   scratch, pool);
}

void tl_cpu_attention_ring(const float *q, int n, int pos0, const float *k_cache, const float *v_cache, int ring,
                           int n_head, int n_kv_head, int head_dim, float scale, int window, float *out,
                           void *scratch, tl_threadpool *pool) {
    attention_rows(q, n, pos0, k_cache, v_cache, NULL, ring, n_head, n_kv_head, head_dim, scale, window, out,
                   scratch, pool);
}

void tl_cpu_attention_paged(const float *q, int n, int pos0, const tl_cpu_kv_pages *pages, int n_head,
                            int n_kv_head, int head_dim, float scale, int window, float *out, void *scratch,
                            tl_threadpool *pool) {
    attention_rows(q, n, pos0, NULL, NULL, pages, pages->ring, n_head, n_kv_head, head_dim, scale, window, out,
                   scratch, pool);
}

/* ---- tree attention (tree speculation) ------------------------------------------ */

typedef struct tree_attention_job {
    attention_job a;
    const tl_tree *tree;
    int first;
} tree_attention_job;

/* One item per (row, head): the prefix's keys in one run, then each visible node's key,
 * in cache-row order; a path's rows then score, sum and accumulate in the order of a
 * causal pass over the same tokens laid out in a line (the same floats). */
static void tree_attention_task(void *arg, int begin, int end, int thread_index) {
    const tree_attention_job *job = arg;
    const attention_job *a = &job->a;
    const tl_cpu_ops *k = a->ops;
    const tl_tree *t = job->tree;
    float *scores = a->scratch + (size_t)thread_index * a->stride;
    int hd = a->head_dim;
    for (int item = begin; item < end; item++) {
        int i = item / a->n_head, h = item % a->n_head, node = job->first + i;
        int pos = t->pos[node];
        int first = first_key(pos, a->window), prefix = t->n_prefix - first;
        if (prefix < 0) prefix = 0, first = t->n_prefix;
        size_t q_off = ((size_t)i * a->n_head + h) * hd, col = (size_t)(h / a->group) * hd;
        const float *q = a->q + q_off;
        dot_keys(a, q, first, prefix, col, scores);
        int len = prefix;
        for (int j = 0; j < t->n_nodes; j++)
            if ((t->visible[node] >> j & 1) && (a->window <= 0 || pos - t->pos[j] < a->window))
                dot_keys(a, q, t->n_prefix + j, 1, col, scores + len++);
        float max = max_of(scores, len);
        float sum = k->exp_sum(scores, scores, len, max);
        float *o = a->out + q_off;
        memset(o, 0, (size_t)hd * sizeof *o);
        axpy_values(a, o, scores, first, prefix, col, hd);
        int at = prefix;
        for (int j = 0; j < t->n_nodes; j++)
            if ((t->visible[node] >> j & 1) && (a->window <= 0 || pos - t->pos[j] < a->window))
                axpy_values(a, o, scores + at++, t->n_prefix + j, 1, col, hd);
        k->scale(o, 1.0f / sum, hd);
    }
}

void tl_cpu_tree_attention(const float *q, int n, const tl_tree *tree, int first, const float *k_cache,
                           const float *v_cache, int n_head, int n_kv_head, int head_dim, float scale,
                           int window, float *out, void *scratch, tl_threadpool *pool) {
    tl_cpu_tree_attention_paged(q, n, tree, first, k_cache, v_cache, NULL, n_head, n_kv_head, head_dim, scale,
                                window, out, scratch, pool);
}

void tl_cpu_tree_attention_paged(const float *q, int n, const tl_tree *tree, int first, const float *k_cache,
                                 const float *v_cache, const tl_cpu_kv_pages *pages, int n_head, int n_kv_head,
                                 int head_dim, float scale, int window, float *out, void *scratch,
                                 tl_threadpool *pool) {
    tree_attention_job job = {
        .a = { .ops = ops(), .pages = pages, .q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out,
               .scratch = scratch, .n_head = n_head, .head_dim = head_dim,
               .group = n_head / n_kv_head, .window = window,
               .kv_stride = (size_t)n_kv_head * head_dim,
               .stride = score_stride(tree->n_prefix + tree->n_nodes), .scale = scale },
        .tree = tree, .first = first };
    tl_parallel_for(pool, n * n_head, 1, tree_attention_task, &job);
}
