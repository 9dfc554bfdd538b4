/* test_kernels.c — the CPU kernels (portable, AVX2 and AVX-512 VNNI paths, with and
 * without a thread pool; the last two also against each other, bit for bit) against straightforward double-precision implementations written here, on
 * random data. Tolerances (docs/cpu-backend.md):
 *   f32/f16/bf16 matmul .......... max error <= 1e-5 * rms(result)
 *   q8/q4/q2 matmul .............. rms error <= 1e-4 * rms(sqrt(sum_c (w_c x_c)^2)): the
 *                                  int16 activations (per block of 32) cost ~1.5e-5
 *                                  (4.7e-5 worst, with an outlier in a block)
 *   q8/q4/q2 vs the same int16
 *   activations .................. max error <= 1e-5 * rms(result): the integer dot is exact
 *   norms, rope, activations,
 *   attention .................... 1e-5 relative to the largest value; adds, logsumexp 1e-6
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/tensor.h"
#include "cpu/kernels.h"
#include "cpu/threadpool.h"

static int n_passed, n_failed;

static void check(int ok, const char *what, double err, double tol) {
    if (ok) {
        n_passed++;
    } else {
        n_failed++;
        printf("FAIL %s: error %.3g > tolerance %.3g\n", what, err, tol);
    }
}

/* ---- random data ------------------------------------------------------------ */

static uint64_t rng_state = 0x1234567887654321ull;

static uint64_t rng_next(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double uniform(double lo, double hi) {
    return lo + (hi - lo) * (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0);
}

static void fill_uniform(float *x, size_t count, double lo, double hi) {
    for (size_t j = 0; j < count; j++) x[j] = (float)uniform(lo, hi);
}

static uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16); /* round to nearest even */
}

/* ---- test tensors -------------------------------------------------------------- */

typedef struct test_tensor {
    tl_tensor t;
    void *qs;
    uint16_t *scales, *mins;
} test_tensor;

/* A random rows x cols tensor in the layout of docs/format.md. */
static test_tensor make_tensor(tl_dtype dtype, int64_t rows, int64_t cols, int group) {
    test_tensor tt;
    memset(&tt, 0, sizeof tt);
    int64_t count = rows * cols;
    tt.t.dtype = dtype;
    tt.t.ndim = rows == 1 ? 1 : 2;
    tt.t.rows = rows;
    tt.t.cols = cols;
    tt.t.shape[0] = rows == 1 ? cols : rows;
    tt.t.shape[1] = rows == 1 ? 0 : cols;
    tt.t.name = "test";
    switch (dtype) {
    case TL_DTYPE_F32: {
        float *v = malloc((size_t)count * sizeof *v);
        fill_uniform(v, (size_t)count, -1.0, 1.0);
        tt.qs = v;
        break;
    }
    case TL_DTYPE_F16:
    case TL_DTYPE_BF16: {
        uint16_t *v = malloc((size_t)count * sizeof *v);
        for (int64_t j = 0; j < count; j++) {
            float f = (float)uniform(-1.0, 1.0);
            v[j] = dtype == TL_DTYPE_F16 ? tl_f32_to_f16(f) : float_to_bf16(f);
        }
        tt.qs = v;
        break;
    }
    default: {
        int64_t bytes = dtype == TL_DTYPE_Q8 ? count : dtype == TL_DTYPE_Q4 ? count / 2 : count / 4;
        uint8_t *q = malloc((size_t)bytes);
        for (int64_t j = 0; j < bytes; j++) q[j] = (uint8_t)rng_next(); /* q8: -128..127 */
        int64_t ng = count / group;
        tt.scales = malloc((size_t)ng * sizeof *tt.scales);
        /* scales sized so w spans about [-1, 1] for every dtype */
        double qmax = dtype == TL_DTYPE_Q8 ? 128.0 : dtype == TL_DTYPE_Q4 ? 15.0 : 3.0;
        for (int64_t g = 0; g < ng; g++) tt.scales[g] = tl_f32_to_f16((float)(uniform(0.5, 2.0) / qmax));
        if (dtype != TL_DTYPE_Q8) {
            tt.mins = malloc((size_t)ng * sizeof *tt.mins);
            for (int64_t g = 0; g < ng; g++) tt.mins[g] = tl_f32_to_f16((float)uniform(-1.2, 0.2));
        }
        tt.qs = q;
        tt.t.group = group;
        break;
    }
    }
    tt.t.data = tt.qs;
    tt.t.scales = tt.scales;
    tt.t.mins = tt.mins;
    tt.t.nbytes = tl_dtype_nbytes(dtype, rows, cols, group);
    return tt;
}

static void free_tensor(test_tensor *tt) {
    free(tt->qs);
    free(tt->scales);
    free(tt->mins);
}

/* W[r, c] decoded directly from the format description, in double. */
static double ref_weight(const tl_tensor *t, int64_t r, int64_t c) {
    int64_t e = r * t->cols + c;
    switch (t->dtype) {
    case TL_DTYPE_F32: return ((const float *)t->data)[e];
    case TL_DTYPE_F16: return tl_f16_to_f32(((const uint16_t *)t->data)[e]);
    case TL_DTYPE_BF16: return tl_bf16_to_f32(((const uint16_t *)t->data)[e]);
    default: break;
    }
    const uint8_t *qs = t->data;
    int64_t g = e / t->group, chunk = e / 32, j = e % 32;
    double scale = tl_f16_to_f32(t->scales[g]);
    if (t->dtype == TL_DTYPE_Q8) return scale * (int8_t)qs[e];
    double min = tl_f16_to_f32(t->mins[g]);
    int q;
    if (t->dtype == TL_DTYPE_Q4)
        q = j < 16 ? qs[chunk * 16 + j] & 15 : qs[chunk * 16 + j - 16] >> 4;
    else
        q = (qs[chunk * 8 + j % 8] >> (2 * (j / 8))) & 3;
    return scale * q + min;
}

/* x as the quantized kernels see it: int16 per block of 32, scale amax / 32767. */
static void ref_quantize_activations(const float *x, int64_t cols, double *out) {
    for (int64_t b = 0; b < cols / 32; b++) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[b * 32 + j]));
        float inv = amax > 0.0f ? 32767.0f / amax : 0.0f, d = amax / 32767.0f;
        for (int j = 0; j < 32; j++) out[b * 32 + j] = (double)d * nearbyintf(x[b * 32 + j] * inv);
    }
}

/* Largest error of an n x m output relative to rms(want). */
static double max_err_over_rms(const float *got, size_t ld_got, const double *want, int n, int m) {
    double err = 0.0, sq = 0.0;
    for (int i = 0; i < n; i++)
        for (int r = 0; r < m; r++) {
            double w = want[(size_t)i * m + r];
            err = fmax(err, fabs((double)got[(size_t)i * ld_got + r] - w));
            sq += w * w;
        }
    return err / (sqrt(sq / ((double)n * m)) + 1e-30);
}

/* rms error relative to the rms of the dot products' terms, sqrt(sum_c (w_c x_c)^2):
 * the activation rounding error scales with those, whatever cancels in the sum. */
static double rms_err_over_terms(const float *got, size_t ld_got, const double *want,
                                 const double *term_sq, int n, int m) {
    double sq_err = 0.0, sq_terms = 0.0;
    for (int i = 0; i < n; i++)
        for (int r = 0; r < m; r++) {
            double e = (double)got[(size_t)i * ld_got + r] - want[(size_t)i * m + r];
            sq_err += e * e;
            sq_terms += term_sq[(size_t)i * m + r];
        }
    return sqrt(sq_err / (sq_terms + 1e-30));
}

/* ---- matmul ----------------------------------------------------------------------- */

static void *alloc_scratch(size_t bytes) {
    return bytes ? aligned_alloc(64, (bytes + 63) & ~(size_t)63) : NULL;
}

static void test_matmul_case(tl_dtype dtype, int group, int64_t rows, int64_t cols, int n,
                             tl_threadpool *pool, const char *path) {
    test_tensor tt = make_tensor(dtype, rows, cols, group);
    const tl_tensor *w = &tt.t;
    size_t ldx = (size_t)cols + 3, ldy = (size_t)rows + 5; /* strides wider than rows */
    float *x = malloc((size_t)n * ldx * sizeof *x);
    float *y = malloc((size_t)n * ldy * sizeof *y);
    double *want = calloc((size_t)n * rows, sizeof *want);
    double *want_q = calloc((size_t)n * rows, sizeof *want_q);
    double *term_sq = calloc((size_t)n * rows, sizeof *term_sq);
    double *xq = malloc((size_t)cols * sizeof *xq);
    fill_uniform(x, (size_t)n * ldx, -1.0, 1.0);
    if (n > 2) x[ldx + 5] = 4.0f; /* an outlier in one block, as real activations have */
    int quantized = tl_dtype_is_quantized(dtype);
    for (int i = 0; i < n; i++) {
        if (quantized) ref_quantize_activations(x + (size_t)i * ldx, cols, xq);
        for (int64_t r = 0; r < rows; r++) {
            double s = 0.0, sq = 0.0, t2 = 0.0;
            for (int64_t c = 0; c < cols; c++) {
                double wv = ref_weight(w, r, c), term = wv * x[(size_t)i * ldx + c];
                s += term;
                t2 += term * term;
                if (quantized) sq += wv * xq[c];
            }
            want[(size_t)i * rows + r] = s;
            want_q[(size_t)i * rows + r] = sq;
            term_sq[(size_t)i * rows + r] = t2;
        }
    }
    void *scratch = alloc_scratch(tl_cpu_matmul_scratch_bytes(w, n));
    tl_cpu_matmul(w, x, n, ldx, y, ldy, scratch, pool);

    char what[160];
    snprintf(what, sizeof what, "matmul %s %s g%d %lldx%lld n=%d threads=%d", path, tl_dtype_name(dtype),
             group, (long long)rows, (long long)cols, n, tl_threadpool_size(pool));
    if (quantized) {
        double err = rms_err_over_terms(y, ldy, want, term_sq, n, (int)rows);
        if (getenv("SHOWERR")) printf("%s %g\n", what, err);
        check(err <= 1e-4, what, err, 1e-4);
        strncat(what, " (same int16 activations)", sizeof what - strlen(what) - 1);
        double err_q = max_err_over_rms(y, ldy, want_q, n, (int)rows);
        check(err_q <= 1e-5, what, err_q, 1e-5);
    } else {
        double err = max_err_over_rms(y, ldy, want, n, (int)rows);
        check(err <= 1e-5, what, err, 1e-5);
    }
    free(scratch);
    free(xq);
    free(term_sq);
    free(want_q);
    free(want);
    free(y);
    free(x);
    free_tensor(&tt);
}

static void test_matmul(tl_threadpool *pool, const char *path) {
    static const int ns[] = {1, 3, 17, 64};
    static const int64_t rows_list[] = {1, 7, 36, 50};
    for (int dt = 0; dt < TL_DTYPE_COUNT; dt++) {
        int quantized = tl_dtype_is_quantized((tl_dtype)dt);
        for (int gi = 0; gi < (quantized ? 3 : 1); gi++) {
            int group = quantized ? 32 << gi : 0;
            /* float types also get widths that are not a multiple of 8 */
            const int64_t cols_list[] = {128, 384, quantized ? 640 : 100};
            for (int ci = 0; ci < 3; ci++)
                for (int ri = 0; ri < 4; ri++)
                    for (int ni = 0; ni < 4; ni++) {
                        int64_t cols = cols_list[ci];
                        if (quantized && cols % group) continue;
                        /* keep the double reference quick: big n only on small shapes */
                        if (ns[ni] == 64 && rows_list[ri] * cols > 36 * 384) continue;
                        test_matmul_case((tl_dtype)dt, group, rows_list[ri], cols, ns[ni], pool, path);
                    }
        }
    }
}

/* matmul_multi must give what separate matmuls give. */
static void test_matmul_multi(tl_threadpool *pool, const char *path) {
    const int64_t cols = 256;
    const int n = 5;
    test_tensor a = make_tensor(TL_DTYPE_Q4, 40, cols, 32);
    test_tensor b = make_tensor(TL_DTYPE_Q8, 13, cols, 64);
    test_tensor c = make_tensor(TL_DTYPE_F16, 21, cols, 0);
    const tl_tensor *ws[3] = {&a.t, &b.t, &c.t};
    float *x = malloc((size_t)n * cols * sizeof *x);
    fill_uniform(x, (size_t)n * cols, -1.0, 1.0);
    float *ys[3], *single[3];
    size_t ldys[3];
    size_t scratch_bytes = 0;
    for (int t = 0; t < 3; t++) {
        ldys[t] = (size_t)ws[t]->rows;
        ys[t] = malloc((size_t)n * ldys[t] * sizeof(float));
        single[t] = malloc((size_t)n * ldys[t] * sizeof(float));
        size_t s = tl_cpu_matmul_scratch_bytes(ws[t], n);
        if (s > scratch_bytes) scratch_bytes = s;
    }
    void *scratch = alloc_scratch(scratch_bytes);
    tl_cpu_matmul_multi(ws, 3, x, n, (size_t)cols, ys, ldys, scratch, pool);
    double err = 0.0;
    for (int t = 0; t < 3; t++) {
        tl_cpu_matmul(ws[t], x, n, (size_t)cols, single[t], ldys[t], scratch, NULL);
        for (size_t j = 0; j < (size_t)n * ldys[t]; j++) err = fmax(err, fabs(ys[t][j] - single[t][j]));
    }
    char what[96];
    snprintf(what, sizeof what, "matmul_multi %s threads=%d (max abs difference)", path, tl_threadpool_size(pool));
    check(err <= 1e-6, what, err, 1e-6);
    for (int t = 0; t < 3; t++) {
        free(ys[t]);
        free(single[t]);
    }
    free(scratch);
    free(x);
    free_tensor(&a);
    free_tensor(&b);
    free_tensor(&c);
}

static void test_dequant_row(const char *path) {
    for (int dt = 0; dt < TL_DTYPE_COUNT; dt++) {
        int group = tl_dtype_is_quantized((tl_dtype)dt) ? 64 : 0;
        test_tensor tt = make_tensor((tl_dtype)dt, 5, 192, group);
        float out[192];
        double err = 0.0;
        for (int64_t r = 0; r < 5; r++) {
            tl_cpu_dequant_row(&tt.t, r, out);
            for (int c = 0; c < 192; c++) err = fmax(err, fabs(out[c] - ref_weight(&tt.t, r, c)));
        }
        char what[64];
        snprintf(what, sizeof what, "dequant_row %s %s (max abs)", path, tl_dtype_name((tl_dtype)dt));
        check(err <= 1e-6, what, err, 1e-6);
        free_tensor(&tt);
    }
}

/* ---- norms and elementwise ops -------------------------------------------------- */

static double max_rel_err(const float *got, const double *want, size_t count) {
    double err = 0.0, scale = 0.0;
    for (size_t j = 0; j < count; j++) {
        err = fmax(err, fabs(got[j] - want[j]));
        scale = fmax(scale, fabs(want[j]));
    }
    return err / (scale + 1e-30);
}

static void test_norms(const char *path) {
    const int n = 3, d = 77;
    float x[3 * 77], out[3 * 77];
    double want[3 * 77];
    fill_uniform(x, (size_t)n * d, -2.0, 3.0);
    for (int dt = 0; dt < 3; dt++) {
        test_tensor wt = make_tensor((tl_dtype)dt, 1, d, 0), bt = make_tensor((tl_dtype)dt, 1, d, 0);
        for (int unit = 0; unit < 2; unit++) {
            tl_cpu_rmsnorm(x, n, d, &wt.t, unit, 1e-5f, out);
            for (int i = 0; i < n; i++) {
                double ss = 0.0;
                for (int j = 0; j < d; j++) ss += (double)x[i * d + j] * x[i * d + j];
                double inv = 1.0 / sqrt(ss / d + 1e-5);
                for (int j = 0; j < d; j++) want[i * d + j] = x[i * d + j] * inv * (unit + ref_weight(&wt.t, 0, j));
            }
            char what[64];
            snprintf(what, sizeof what, "rmsnorm %s weight=%s unit_offset=%d", path, tl_dtype_name((tl_dtype)dt), unit);
            double err = max_rel_err(out, want, (size_t)n * d);
            check(err <= 1e-5, what, err, 1e-5);
        }
        memcpy(out, x, sizeof x);
        tl_cpu_layernorm(out, n, d, &wt.t, &bt.t, 1e-5f, out); /* in place */
        for (int i = 0; i < n; i++) {
            double mean = 0.0, var = 0.0;
            for (int j = 0; j < d; j++) mean += x[i * d + j];
            mean /= d;
            for (int j = 0; j < d; j++) var += (x[i * d + j] - mean) * (x[i * d + j] - mean);
            double inv = 1.0 / sqrt(var / d + 1e-5);
            for (int j = 0; j < d; j++)
                want[i * d + j] = (x[i * d + j] - mean) * inv * ref_weight(&wt.t, 0, j) + ref_weight(&bt.t, 0, j);
        }
        char what[64];
        snprintf(what, sizeof what, "layernorm %s weight=%s in place", path, tl_dtype_name((tl_dtype)dt));
        double err = max_rel_err(out, want, (size_t)n * d);
        check(err <= 1e-5, what, err, 1e-5);

        float y[3 * 77];
        memcpy(y, x, sizeof x);
        tl_cpu_add_bias(y, n, d, &bt.t);
        for (int i = 0; i < n * d; i++) want[i] = x[i] + ref_weight(&bt.t, 0, i % d);
        snprintf(what, sizeof what, "add_bias %s bias=%s", path, tl_dtype_name((tl_dtype)dt));
        err = max_rel_err(y, want, (size_t)n * d);
        check(err <= 1e-6, what, err, 1e-6);
        free_tensor(&wt);
        free_tensor(&bt);
    }
    float y[3 * 77];
    memcpy(y, x, sizeof x);
    tl_cpu_add(y, out, (size_t)n * d);
    for (int i = 0; i < n * d; i++) want[i] = (double)x[i] + out[i];
    double err = max_rel_err(y, want, (size_t)n * d);
    char what[32];
    snprintf(what, sizeof what, "add %s", path);
    check(err <= 1e-6, what, err, 1e-6);
}

static void test_rope(const char *path) {
    const int n = 4, heads = 3, hd = 24;
    const int32_t positions[4] = {0, 1, 17, 5000};
    float x[4 * 3 * 24], got[4 * 3 * 24], table[4 * 24];
    double want[4 * 3 * 24];
    fill_uniform(x, sizeof x / sizeof *x, -1.0, 1.0);
    for (int style = 0; style < 2; style++)
        for (int rd = 8; rd <= hd; rd += hd - 8) { /* partial and full rotary dims */
            memcpy(got, x, sizeof x);
            tl_cpu_rope_table(n, rd, 10000.0f, NULL, positions, table);
            tl_cpu_rope_apply(got, n, heads, hd, rd, style, table);
            for (int i = 0; i < n; i++)
                for (int h = 0; h < heads; h++) {
                    const float *v = x + (i * heads + h) * hd;
                    double *o = want + (i * heads + h) * hd;
                    for (int j = 0; j < hd; j++) o[j] = v[j];
                    for (int p = 0; p < rd / 2; p++) {
                        double angle = positions[i] * pow(10000.0, -2.0 * p / rd);
                        int ia = style ? 2 * p : p, ib = style ? 2 * p + 1 : p + rd / 2;
                        o[ia] = v[ia] * cos(angle) - v[ib] * sin(angle);
                        o[ib] = v[ia] * sin(angle) + v[ib] * cos(angle);
                    }
                }
            char what[64];
            snprintf(what, sizeof what, "rope %s style=%s rope_dims=%d", path, style ? "interleaved" : "half", rd);
            double err = max_rel_err(got, want, sizeof x / sizeof *x);
            check(err <= 1e-5, what, err, 1e-5);
        }
}

static void test_gated_act(const char *path) {
    enum { COUNT = 203 };
    float gate[COUNT], up[COUNT], out[COUNT];
    double want[COUNT];
    fill_uniform(gate, COUNT, -12.0, 12.0);
    fill_uniform(up, COUNT, -2.0, 2.0);
    gate[0] = -100.0f; /* saturated tails */
    gate[1] = 100.0f;
    for (int act = 0; act < 2; act++) {
        tl_cpu_gated_act(gate, up, COUNT, act, out);
        double err = 0.0;
        for (int j = 0; j < COUNT; j++) {
            double g = gate[j];
            double a = act ? 0.5 * g * (1.0 + tanh(sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g)))
                           : g / (1.0 + exp(-g));
            want[j] = a * up[j];
            /* relative to the value, with an absolute floor for results near zero */
            err = fmax(err, fabs(out[j] - want[j]) / fmax(fabs(want[j]), 1.0));
        }
        char what[64];
        snprintf(what, sizeof what, "gated_act %s %s (relative, absolute below 1)", path, act ? "gelu_tanh" : "silu");
        check(err <= 1e-5, what, err, 1e-5);
    }
}

static void test_logsumexp(const char *path) {
    enum { COUNT = 1001 };
    float x[COUNT];
    fill_uniform(x, COUNT, 990.0, 1010.0); /* would overflow a naive sum of exp */
    double max = -INFINITY, sum = 0.0;
    for (int j = 0; j < COUNT; j++) max = fmax(max, x[j]);
    for (int j = 0; j < COUNT; j++) sum += exp(x[j] - max);
    double want = max + log(sum), got = tl_cpu_logsumexp(x, COUNT);
    double err = fabs(got - want) / fabs(want);
    char what[48];
    snprintf(what, sizeof what, "logsumexp %s", path);
    check(err <= 1e-6, what, err, 1e-6);
}

/* ---- attention ---------------------------------------------------------------------- */

static void test_attention_case(int n, int pos0, int n_head, int n_kv, int hd, int window, float scale,
                                tl_threadpool *pool, const char *path) {
    int total = pos0 + n, qw = n_head * hd, kvw = n_kv * hd;
    float *q = malloc((size_t)n * qw * sizeof *q), *out = malloc((size_t)n * qw * sizeof *out);
    float *k = malloc((size_t)total * kvw * sizeof *k), *v = malloc((size_t)total * kvw * sizeof *v);
    double *want = malloc((size_t)n * qw * sizeof *want), *p = malloc((size_t)total * sizeof *p);
    fill_uniform(q, (size_t)n * qw, -1.0, 1.0);
    fill_uniform(k, (size_t)total * kvw, -1.0, 1.0);
    fill_uniform(v, (size_t)total * kvw, -1.0, 1.0);
    void *scratch = alloc_scratch(tl_cpu_attention_scratch_bytes(tl_threadpool_size(pool), n_head, total));
    tl_cpu_attention(q, n, pos0, k, v, n_head, n_kv, hd, scale, window, out, scratch, pool);
    for (int i = 0; i < n; i++)
        for (int h = 0; h < n_head; h++) {
            int pos = pos0 + i, kvh = h / (n_head / n_kv);
            int first = window > 0 ? pos - window + 1 : 0;
            if (first < 0) first = 0;
            double max = -INFINITY, sum = 0.0;
            for (int j = first; j <= pos; j++) {
                double s = 0.0;
                for (int c = 0; c < hd; c++) s += (double)q[i * qw + h * hd + c] * k[j * kvw + kvh * hd + c];
                p[j] = s * scale;
                max = fmax(max, p[j]);
            }
            for (int j = first; j <= pos; j++) sum += (p[j] = exp(p[j] - max));
            for (int c = 0; c < hd; c++) {
                double o = 0.0;
                for (int j = first; j <= pos; j++) o += p[j] * v[j * kvw + kvh * hd + c];
                want[i * qw + h * hd + c] = o / sum;
            }
        }
    char what[128];
    snprintf(what, sizeof what, "attention %s n=%d pos0=%d heads=%d/%d hd=%d window=%d scale=%g threads=%d", path,
             n, pos0, n_head, n_kv, hd, window, scale, tl_threadpool_size(pool));
    double err = max_rel_err(out, want, (size_t)n * qw);
    check(err <= 1e-5, what, err, 1e-5);
    if (n == 1 && pos0 > 0) {
        /* one query row takes its own path; it must match row 2 of a two-row call exactly */
        float *q2 = malloc(2 * (size_t)qw * sizeof *q2), *out2 = malloc(2 * (size_t)qw * sizeof *out2);
        fill_uniform(q2, (size_t)qw, -1.0, 1.0);
        memcpy(q2 + qw, q, (size_t)qw * sizeof *q);
        tl_cpu_attention(q2, 2, pos0 - 1, k, v, n_head, n_kv, hd, scale, window, out2, scratch, pool);
        int same = memcmp(out2 + qw, out, (size_t)qw * sizeof *out) == 0;
        snprintf(what, sizeof what, "attention %s one row = two-row call, bit for bit, pos0=%d threads=%d",
                 path, pos0, tl_threadpool_size(pool));
        check(same, what, same ? 0.0 : 1.0, 0.0);
        free(out2);
        free(q2);
    }
    free(scratch);
    free(p);
    free(want);
    free(v);
    free(k);
    free(out);
    free(q);
}

static void test_attention(tl_threadpool *pool, const char *path) {
    test_attention_case(1, 0, 4, 4, 16, 0, 0.25f, pool, path);    /* first token */
    test_attention_case(1, 40, 6, 2, 20, 0, 0.2236f, pool, path); /* decode, GQA */
    test_attention_case(1, 150, 9, 3, 64, 0, 0.125f, pool, path); /* decode, several key blocks */
    test_attention_case(1, 300, 4, 1, 72, 100, 0.118f, pool, path); /* decode, window, column tail */
    test_attention_case(7, 5, 6, 2, 20, 0, 0.2236f, pool, path);  /* prefill chunk after a prefix */
    test_attention_case(9, 0, 6, 3, 64, 4, 0.125f, pool, path);   /* sliding window */
    test_attention_case(3, 30, 2, 1, 33, 8, 0.1741f, pool, path); /* window, odd head dim */
    test_attention_case(5, 12, 4, 2, 16, 0, 40.0f, pool, path);   /* scores far beyond exp range */
}

/* ---- thread pool ------------------------------------------------------------------- */

typedef struct coverage {
    int *hits;
    int grain;
    int misaligned;
    int bad_thread;
    int n_threads;
} coverage;

static void mark_items(void *arg, int begin, int end, int thread_index) {
    coverage *c = arg;
    if (begin % c->grain) __atomic_store_n(&c->misaligned, 1, __ATOMIC_RELAXED);
    if (thread_index < 0 || thread_index >= c->n_threads) __atomic_store_n(&c->bad_thread, 1, __ATOMIC_RELAXED);
    for (int i = begin; i < end; i++) __atomic_fetch_add(&c->hits[i], 1, __ATOMIC_RELAXED);
}

static void test_threadpool(void) {
    for (int threads = 1; threads <= 3; threads++) {
        tl_threadpool *pool = tl_threadpool_create(threads);
        int ok = pool != NULL && tl_threadpool_size(pool) == threads;
        static const int sizes[] = {1, 2, 7, 64, 1000, 4097};
        for (int rep = 0; rep < 200 && ok; rep++) {
            int n = sizes[rep % 6], grain = 1 + rep % 5;
            int *hits = calloc((size_t)n, sizeof *hits);
            coverage c = {hits, grain, 0, 0, threads};
            tl_parallel_for(pool, n, grain, mark_items, &c);
            for (int i = 0; i < n; i++) ok &= hits[i] == 1;
            ok &= !c.misaligned && !c.bad_thread;
            free(hits);
        }
        char what[96];
        snprintf(what, sizeof what, "threadpool %d threads: every item once, chunks on grain", threads);
        check(ok, what, 0.0, 0.0);
        tl_threadpool_destroy(pool);
    }
    check(tl_num_cores() >= 1, "tl_num_cores >= 1", 0.0, 0.0);
}

/* The AVX-512 VNNI build of the vector kernels must give the AVX2 build's floats bit for
 * bit (the same int32 sums, the same float operations): matmuls of every dtype and group,
 * decode and tiled row counts, widths of whole and partial scale chunks. */
static void test_vnni_equals_avx2(tl_threadpool *pool) {
    if (tl_cpu_set_level(TL_CPU_AVX512VNNI) != 0) {
        printf("skip avx512vnni == avx2 bit for bit: no AVX-512 VNNI on this CPU or in this build\n");
        return;
    }
    static const int ns[] = {1, 2, 3, 4, 5, 17, 64};
    static const int64_t cols_list[] = {128, 384, 640};
    for (int dt = 0; dt < TL_DTYPE_COUNT; dt++) {
        int quantized = tl_dtype_is_quantized((tl_dtype)dt);
        for (int gi = 0; gi < (quantized ? 3 : 1); gi++) {
            int group = quantized ? 32 << gi : 0;
            for (int ci = 0; ci < 3; ci++) {
                int64_t cols = cols_list[ci], rows = 37;
                if (quantized && cols % group) continue;
                test_tensor w = make_tensor((tl_dtype)dt, rows, cols, group);
                int same = 1;
                for (int ni = 0; ni < 7; ni++) {
                    int n = ns[ni];
                    float *x = malloc((size_t)n * cols * sizeof *x);
                    float *y[2] = {malloc((size_t)n * rows * sizeof(float)), malloc((size_t)n * rows * sizeof(float))};
                    fill_uniform(x, (size_t)n * cols, -1.0, 1.0);
                    void *scratch = alloc_scratch(tl_cpu_matmul_scratch_bytes(&w.t, n));
                    for (int level = 0; level < 2; level++) {
                        tl_cpu_set_level(level ? TL_CPU_AVX512VNNI : TL_CPU_AVX2);
                        tl_cpu_matmul(&w.t, x, n, (size_t)cols, y[level], (size_t)rows, scratch, pool);
                    }
                    same &= memcmp(y[0], y[1], (size_t)n * rows * sizeof(float)) == 0;
                    free(x);
                    free(y[0]);
                    free(y[1]);
                    free(scratch);
                }
                char what[96];
                snprintf(what, sizeof what, "avx512vnni == avx2 bit for bit: %s group %d cols %lld",
                         tl_dtype_name((tl_dtype)dt), group, (long long)cols);
                check(same, what, 0.0, 0.0);
                free_tensor(&w);
            }
        }
    }
}

int main(void) {
    test_threadpool();
    tl_threadpool *pool = tl_threadpool_create(2);
    const tl_cpu_level levels[3] = {TL_CPU_GENERIC, TL_CPU_AVX2, TL_CPU_AVX512VNNI};
    for (int li = 0; li < 3; li++) {
        if (tl_cpu_set_level(levels[li]) != 0) {
            printf("skip %s path: not supported by this CPU or build\n", tl_cpu_level_name(levels[li]));
            continue;
        }
        const char *path = tl_cpu_level_name(levels[li]);
        test_matmul(NULL, path);
        test_matmul(pool, path);
        test_matmul_multi(pool, path);
        test_dequant_row(path);
        test_norms(path);
        test_rope(path);
        test_gated_act(path);
        test_logsumexp(path);
        test_attention(NULL, path);
        test_attention(pool, path);
    }
    test_vnni_equals_avx2(pool);
    tl_threadpool_destroy(pool);
    printf("test_kernels: %d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
