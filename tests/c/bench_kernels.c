/* bench_kernels.c — matmul throughput on the SmolLM2-135M shapes (q4 group 32 layers,
 * q8 group 32 tied head) against the machine's streaming read bandwidth.
 *
 *   bench_kernels [reps] [decode|prefill|rows]   (TINYLOOP_CPU=generic times the portable path)
 *
 * rows: n = 1..8 input rows (a speculative verification's sizes) on the q4 shapes and a
 * q4 head, weights read from DRAM as in decode.
 *
 * Prints, per shape, n (input rows) and thread count: median time per call, GB/s of
 * weight bytes read and GFLOP/s (2 * rows * cols * n); then a whole decode step
 * (30 layers of distinct weights + head, as the runtime issues them). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/tensor.h"
#include "cpu/kernels.h"
#include "cpu/threadpool.h"

enum { D = 576, KV = 192, FFN = 1536, VOCAB = 49152, LAYERS = 30, PREFILL = 128 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

static void *xaligned(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

/* A quantized weight with random codes and moderate scales (values do not change speed). */
static tl_tensor make_weight(tl_dtype dtype, int64_t rows, int64_t cols) {
    tl_tensor t;
    memset(&t, 0, sizeof t);
    t.name = "bench";
    t.dtype = dtype;
    t.ndim = 2;
    t.shape[0] = t.rows = rows;
    t.shape[1] = t.cols = cols;
    t.group = 32;
    size_t qbytes = (size_t)(dtype == TL_DTYPE_Q8 ? rows * cols : rows * cols / 2);
    size_t ng = (size_t)(rows * cols / 32);
    uint8_t *qs = xaligned(qbytes);
    for (size_t j = 0; j < qbytes; j++) qs[j] = (uint8_t)(j * 2654435761u >> 13);
    uint16_t *scales = xaligned(ng * 2), *mins = dtype == TL_DTYPE_Q8 ? NULL : xaligned(ng * 2);
    for (size_t g = 0; g < ng; g++) {
        scales[g] = tl_f32_to_f16(0.01f);
        if (mins) mins[g] = tl_f32_to_f16(-0.08f);
    }
    t.data = qs;
    t.scales = scales;
    t.mins = mins;
    t.nbytes = tl_dtype_nbytes(dtype, rows, cols, 32);
    return t;
}

static void free_weight(tl_tensor *t) {
    free((void *)t->data);
    free((void *)t->scales);
    free((void *)t->mins);
}

/* ---- read bandwidth ------------------------------------------------------------- */

typedef struct stream_job {
    const uint64_t *data;
    size_t words;
    uint64_t sums[64];
} stream_job;

static void stream_task(void *arg, int begin, int end, int thread_index) {
    stream_job *job = arg;
    size_t per = job->words / 256;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = (size_t)begin * per; i < (size_t)end * per; i += 4) {
        a += job->data[i];
        b += job->data[i + 1];
        c += job->data[i + 2];
        d += job->data[i + 3];
    }
    job->sums[thread_index] += a + b + c + d;
}

static double read_bandwidth(tl_threadpool *pool, int reps) {
    const size_t bytes = (size_t)512 << 20;
    stream_job job = {.data = xaligned(bytes), .words = bytes / 8};
    memset((void *)job.data, 1, bytes);
    double best = 0.0;
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        tl_parallel_for(pool, 256, 1, stream_task, &job);
        double gbs = (double)bytes / (now_s() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    free((void *)job.data);
    return best;
}

/* ---- thread pool overhead --------------------------------------------------------- */

static void touch_task(void *arg, int begin, int end, int thread_index) {
    volatile int *slots = arg;
    slots[thread_index * 16] += end - begin;
}

/* Median cost of one parallel_for over trivial items, back to back as decode issues them. */
static double parallel_for_overhead_us(tl_threadpool *pool) {
    enum { CALLS = 2000, ROUNDS = 9 };
    int slots[64 * 16] = {0};
    double times[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now_s();
        for (int k = 0; k < CALLS; k++) tl_parallel_for(pool, 64, 1, touch_task, slots);
        times[r] = (now_s() - t0) / CALLS * 1e6;
    }
    return median(times, ROUNDS);
}

/* ---- matmul ------------------------------------------------------------------------- */

static void bench_shape(const char *name, tl_dtype dtype, int64_t rows, int64_t cols, int n,
                        tl_threadpool *pool, int reps) {
    /* copies of the weight (up to ~96 MB) so decode-sized calls mostly read from DRAM */
    size_t one = (size_t)tl_dtype_nbytes(dtype, rows, cols, 32);
    int copies = n <= 8 ? (int)(((size_t)96 << 20) / one) + 1 : 1;
    if (copies > 64) copies = 64;
    tl_tensor *w = malloc((size_t)copies * sizeof *w);
    for (int c = 0; c < copies; c++) w[c] = make_weight(dtype, rows, cols);
    float *x = xaligned((size_t)n * cols * sizeof(float)), *y = xaligned((size_t)n * rows * sizeof(float));
    for (int64_t j = 0; j < n * cols; j++) x[j] = (float)((j * 7919) % 201 - 100) / 100.0f;
    void *scratch = xaligned(tl_cpu_matmul_scratch_bytes(&w[0], n) + 64);
    int calls = n <= 8 ? copies * 4 : 3;
    double *times = malloc((size_t)reps * sizeof *times);
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        for (int k = 0; k < calls; k++) tl_cpu_matmul(&w[k % copies], x, n, (size_t)cols, y, (size_t)rows, scratch, pool);
        times[r] = (now_s() - t0) / calls;
    }
    double t = median(times, reps);
    printf("%-10s %-3s %6lldx%-5lld n=%-4d threads=%d  %9.1f us  %6.2f GB/s  %7.2f GFLOP/s\n", name,
           tl_dtype_name(dtype), (long long)rows, (long long)cols, n, tl_threadpool_size(pool), t * 1e6,
           (double)one / t / 1e9, 2.0 * (double)rows * (double)cols * n / t / 1e9);
    free(times);
    free(scratch);
    free(y);
    free(x);
    for (int c = 0; c < copies; c++) free_weight(&w[c]);
    free(w);
}

/* One decode step's matmuls: per layer q/k/v fused, o, gate/up fused, down; then the head. */
typedef struct layer_weights {
    tl_tensor q, k, v, o, gate, up, down;
} layer_weights;

static void bench_model(layer_weights *layers, const tl_tensor *head, int n, tl_threadpool *pool, int reps) {
    float *x = xaligned((size_t)n * FFN * sizeof(float)), *y = xaligned((size_t)n * VOCAB * sizeof(float));
    float *y2 = xaligned((size_t)n * FFN * sizeof(float)), *y3 = xaligned((size_t)n * FFN * sizeof(float));
    for (int64_t j = 0; j < (int64_t)n * FFN; j++) x[j] = (float)((j * 7919) % 201 - 100) / 100.0f;
    void *scratch = xaligned(tl_cpu_matmul_scratch_bytes(&layers[0].down, n) + 64);
    uint64_t bytes = head->nbytes;
    for (int l = 0; l < LAYERS; l++) {
        layer_weights *L = &layers[l];
        bytes += L->q.nbytes + L->k.nbytes + L->v.nbytes + L->o.nbytes + L->gate.nbytes + L->up.nbytes + L->down.nbytes;
    }
    double *times = malloc((size_t)reps * sizeof *times);
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        for (int l = 0; l < LAYERS; l++) {
            layer_weights *L = &layers[l];
            const tl_tensor *qkv[3] = {&L->q, &L->k, &L->v};
            float *qkv_out[3] = {y, y2, y3};
            size_t qkv_ld[3] = {D, KV, KV};
            tl_cpu_matmul_multi(qkv, 3, x, n, D, qkv_out, qkv_ld, scratch, pool);
            tl_cpu_matmul(&L->o, x, n, D, y, D, scratch, pool);
            const tl_tensor *gu[2] = {&L->gate, &L->up};
            float *gu_out[2] = {y2, y3};
            size_t gu_ld[2] = {FFN, FFN};
            tl_cpu_matmul_multi(gu, 2, x, n, D, gu_out, gu_ld, scratch, pool);
            tl_cpu_matmul(&L->down, x, n, FFN, y, D, scratch, pool);
        }
        tl_cpu_matmul(head, x, n, D, y, VOCAB, scratch, pool);
        times[r] = now_s() - t0;
    }
    double t = median(times, reps);
    printf("model step n=%-4d threads=%d  %8.2f ms  %7.1f tokens/s  %6.2f GB/s of weights\n", n,
           tl_threadpool_size(pool), t * 1e3, n / t, (double)bytes / t / 1e9);
    free(times);
    free(scratch);
    free(y3);
    free(y2);
    free(y);
    free(x);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 15;
    if (reps < 1) reps = 1;
    /* optional: time only n = 1 (decode) or only n = PREFILL */
    const char *only = argc > 2 ? argv[2] : "";
    const int run_decode = strcmp(only, "prefill") != 0, run_prefill = strcmp(only, "decode") != 0;
    printf("kernel path: %s, cores: %d\n", tl_cpu_level_name(tl_cpu_features()), tl_num_cores());
    tl_threadpool *pools[2] = {tl_threadpool_create(1), tl_threadpool_create(2)};
    for (int p = 0; p < 2; p++)
        printf("streaming read bandwidth, %d thread(s): %.2f GB/s\n", p + 1, read_bandwidth(pools[p], 5));

    printf("parallel_for round trip, 2 threads: %.2f us\n", parallel_for_overhead_us(pools[1]));

    if (strcmp(only, "rows") == 0) {
        for (int n = 1; n <= 8; n++) {
            bench_shape("gate/up", TL_DTYPE_Q4, FFN, D, n, pools[1], reps);
            bench_shape("head-q4", TL_DTYPE_Q4, VOCAB, D, n, pools[1], reps);
        }
        tl_threadpool_destroy(pools[0]);
        tl_threadpool_destroy(pools[1]);
        return 0;
    }

    static const struct {
        const char *name;
        tl_dtype dtype;
        int64_t rows, cols;
    } shapes[] = {
        {"q/o", TL_DTYPE_Q4, D, D},       {"k/v", TL_DTYPE_Q4, KV, D},
        {"gate/up", TL_DTYPE_Q4, FFN, D}, {"down", TL_DTYPE_Q4, D, FFN},
        {"head", TL_DTYPE_Q8, VOCAB, D},
    };
    for (int s = 0; s < 5; s++)
        for (int ni = 0; ni < 2; ni++)
            for (int p = 0; p < 2; p++)
                if (ni ? run_prefill : run_decode)
                    bench_shape(shapes[s].name, shapes[s].dtype, shapes[s].rows, shapes[s].cols,
                            ni ? PREFILL : 1, pools[p], reps);

    layer_weights *layers = malloc(LAYERS * sizeof *layers);
    for (int l = 0; l < LAYERS; l++) {
        layers[l] = (layer_weights){
            make_weight(TL_DTYPE_Q4, D, D),   make_weight(TL_DTYPE_Q4, KV, D),
            make_weight(TL_DTYPE_Q4, KV, D),  make_weight(TL_DTYPE_Q4, D, D),
            make_weight(TL_DTYPE_Q4, FFN, D), make_weight(TL_DTYPE_Q4, FFN, D),
            make_weight(TL_DTYPE_Q4, D, FFN)};
    }
    tl_tensor head = make_weight(TL_DTYPE_Q8, VOCAB, D);
    for (int p = 0; p < 2; p++) {
        if (run_decode) bench_model(layers, &head, 1, pools[p], reps);
        if (run_prefill) bench_model(layers, &head, PREFILL, pools[p], reps < 5 ? reps : 5);
    }
    for (int l = 0; l < LAYERS; l++) {
        layer_weights *L = &layers[l];
        tl_tensor *all[7] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
        for (int k = 0; k < 7; k++) free_weight(all[k]);
    }
    free(layers);
    free_weight(&head);
    tl_threadpool_destroy(pools[0]);
    tl_threadpool_destroy(pools[1]);
    return 0;
}
