/* cpu/kernels.h — CPU compute kernels on host memory. The hot kernels have an
 * AVX2/FMA/F16C path (also built with AVX-512 VNNI, the same results bit for bit) and a
 * portable C path, chosen once at run time (tl_cpu_features()); results of the portable
 * and the vector paths agree within float rounding (docs/cpu-backend.md).
 * Matrices are row-major; W is [rows=out, cols=in]; y = x W^T. */
#ifndef TL_CPU_KERNELS_H
#define TL_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "base/tensor.h"
#include "cpu/threadpool.h"

/* Ordered: a CPU that runs a level runs every level below it. */
typedef enum { TL_CPU_GENERIC = 0, TL_CPU_AVX2 = 1, TL_CPU_AVX512VNNI = 2 } tl_cpu_level;

/* Detected once, the best level this CPU and build run; TINYLOOP_CPU=generic or =avx2
 * caps it (tests use them to compare the paths). */
tl_cpu_level tl_cpu_features(void);
const char *tl_cpu_level_name(tl_cpu_level level);
/* Switch paths at run time (tests and benchmarks compare them). Returns 0, or -1 when
 * this CPU or build cannot run `level` (nothing changes then). Not thread-safe against
 * running kernels. */
int tl_cpu_set_level(tl_cpu_level level);
/* The best level this CPU and build run (before TINYLOOP_CPU), and the highest level
 * this build has kernels for. */
tl_cpu_level tl_cpu_best_level(void);
tl_cpu_level tl_cpu_built_level(void);

/* Scratch a matmul needs for n input rows of width cols (quantized activations);
 * callers pass a buffer of at least this many bytes (64-byte aligned). */
size_t tl_cpu_matmul_scratch_bytes(const tl_tensor *w, int n);

/* y[i, r] = sum_c x[i, c] * W[r, c] for i < n, r < w->rows.
 * x: n x w->cols floats (row stride ldx), y: n x w->rows floats (row stride ldy).
 * Work is split over the pool's threads; the pool may be NULL (run inline).
 * Quantized weights are never dequantized as a whole: each thread decodes the
 * groups it needs in registers. */
void tl_cpu_matmul(const tl_tensor *w, const float *x, int n, size_t ldx, float *y, size_t ldy,
                   void *scratch, tl_threadpool *pool);

/* Several weights with the same cols applied to one input (q/k/v, gate/up): the input
 * is quantized once and all their rows share one parallel_for. ws[t] writes ys[t]
 * (row stride ldys[t]); up to TL_CPU_MATMUL_MAX_MULTI share one loop; scratch: the largest
 * tl_cpu_matmul_scratch_bytes() of the weights. */
#define TL_CPU_MATMUL_MAX_MULTI 4
void tl_cpu_matmul_multi(const tl_tensor *const *ws, int count, const float *x, int n,
                         size_t ldx, float *const *ys, const size_t *ldys, void *scratch,
                         tl_threadpool *pool);

/* out[c] = W[row, c] as floats (embedding lookup, tests). */
void tl_cpu_dequant_row(const tl_tensor *w, int64_t row, float *out);

/* out = norm(x) per row of width d. weight/bias are 1-D f32/f16/bf16 tensors
 * (bias may be NULL). rms: x / sqrt(mean(x^2) + eps) * (unit_offset ? 1 + w : w);
 * layer: (x - mean) / sqrt(var + eps) * w + b. out may equal x. */
void tl_cpu_rmsnorm(const float *x, int n, int d, const tl_tensor *weight, int unit_offset,
                    float eps, float *out);
void tl_cpu_layernorm(const float *x, int n, int d, const tl_tensor *weight,
                      const tl_tensor *bias, float eps, float *out);

/* RoPE in two steps, so that the cos/sin of a chunk's positions are computed once for
 * all layers: tl_cpu_rope_table fills, per row i at position positions[i], rope_dims
 * floats (cos then sin of the rope_dims/2 angles, freq_p = theta^(-2p/rope_dims), divided
 * by factors[p] when factors is not NULL);
 * tl_cpu_rope_apply rotates the first rope_dims dims of each head of x (n rows of
 * n_heads*head_dim) in place with such a table. style 0 = half (pairs p,
 * p+rope_dims/2), 1 = interleaved (pairs 2p, 2p+1). */
void tl_cpu_rope_table(int n, int rope_dims, float theta, const float *factors,
                       const int32_t *positions, float *table);
void tl_cpu_rope_apply(float *x, int n, int n_heads, int head_dim, int rope_dims, int style,
                       const float *table);

/* out[i] = act(gate[i]) * up[i]; act 0 = silu, 1 = gelu_tanh. */
void tl_cpu_gated_act(const float *gate, const float *up, size_t count, int act, float *out);

/* y += x */
void tl_cpu_add(float *y, const float *x, size_t count);
/* y += b per row (b: 1-D f32/f16/bf16 tensor of width d) */
void tl_cpu_add_bias(float *y, int n, int d, const tl_tensor *b);

/* Causal attention of n query rows at positions pos0..pos0+n-1 against a cache holding
 * keys/values for positions 0..pos0+n-1 (k_cache/v_cache: [max_seq, n_kv_head*head_dim]
 * float rows). q: n x (n_head*head_dim); out: same shape. GQA: query head h uses kv head
 * h / (n_head / n_kv_head). window > 0 limits each query to the last `window`
 * positions (itself included). Parallel on the pool: over (row, head) for several rows,
 * over (KV head, keys or columns) for one row. scratch: at least
 * tl_cpu_attention_scratch_bytes() bytes. */
size_t tl_cpu_attention_scratch_bytes(int n_threads, int n_head, int max_seq);
void tl_cpu_attention(const float *q, int n, int pos0, const float *k_cache,
                      const float *v_cache, int n_head, int n_kv_head, int head_dim,
                      float scale, int window, float *out, void *scratch,
                      tl_threadpool *pool);

/* A paged KV cache (kv_cache.h): row r of a slot's keys at table[r >> shift] + k_off +
 * (r & (2^shift - 1)) * n_kv_head * head_dim, its values likewise at v_off. */
typedef struct tl_cpu_kv_pages {
    const float *const *table;
    int shift;
    size_t k_off, v_off;
    int ring;   /* > 0: the slot is a ring of this many rows, position p at row p mod ring */
} tl_cpu_kv_pages;
/* tl_cpu_attention over a slot held as a ring of `ring` rows (a cache window: position p
 * at row p mod ring; window <= ring): the same floats as over the positions' rows laid
 * out in order. */
void tl_cpu_attention_ring(const float *q, int n, int pos0, const float *k_cache, const float *v_cache, int ring,
                           int n_head, int n_kv_head, int head_dim, float scale, int window, float *out,
                           void *scratch, tl_threadpool *pool);
/* tl_cpu_attention reading keys and values through pages (the same floats as over the
 * same rows laid out contiguously). */
void tl_cpu_attention_paged(const float *q, int n, int pos0, const tl_cpu_kv_pages *pages, int n_head,
                            int n_kv_head, int head_dim, float scale, int window, float *out, void *scratch,
                            tl_threadpool *pool);

/* tl_cpu_attention for n rows of a token tree (backend.h, tl_tree): query row i is node
 * first + i at position tree->pos[first + i], against the prefix rows and the nodes it
 * sees. The same scratch. */
struct tl_tree;
void tl_cpu_tree_attention(const float *q, int n, const struct tl_tree *tree, int first,
                           const float *k_cache, const float *v_cache, int n_head, int n_kv_head,
                           int head_dim, float scale, int window, float *out, void *scratch,
                           tl_threadpool *pool);
/* The same through pages (pages != NULL; k_cache / v_cache unused) or not (pages NULL). */
void tl_cpu_tree_attention_paged(const float *q, int n, const struct tl_tree *tree, int first,
                                 const float *k_cache, const float *v_cache, const tl_cpu_kv_pages *pages,
                                 int n_head, int n_kv_head, int head_dim, float scale, int window, float *out,
                                 void *scratch, tl_threadpool *pool);

/* log-softmax helpers for scoring and sampling */
float tl_cpu_logsumexp(const float *x, int n);

#endif
