/* cpu/threadpool.c — persistent workers for tl_parallel_for.
 *
 * A parallel_for publishes a job and bumps a generation counter. Workers spin on
 * the counter for a short while after each job (decode issues several jobs per
 * layer a few microseconds apart, and waking a sleeping thread costs far more than
 * that), then fall asleep on a condition variable so an idle pool burns no CPU.
 * Items are handed out in contiguous chunks through an atomic cursor, so a thread
 * that was descheduled simply takes fewer chunks; the caller works too.
 *
 * The caller waits only for workers that entered the job, never for one that has not
 * shown up yet: when another process holds a core, a worker may not run for a whole
 * scheduler time slice (milliseconds), and waiting for it to acknowledge every job
 * made two threads several times slower than one. A worker enters by incrementing
 * job.state; once the caller has run out of chunks it sets JOB_CLOSED there and waits
 * for the count to drain; a worker that finds the job closed leaves without touching
 * it. */
#define _GNU_SOURCE
#include "cpu/threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TL_CPU_RELAX() _mm_pause()
#else
#define TL_CPU_RELAX() ((void)0)
#endif

/* How long a worker keeps polling for the next job before it sleeps. */
#define TL_SPIN_NS 200000LL
/* Chunks per thread: more than one so a slow thread does not hold up the rest. */
#define TL_CHUNKS_PER_THREAD 4

/* job.state: JOB_CLOSED plus the number of workers inside the job. */
#define JOB_CLOSED 0x40000000

typedef struct tl_job {
    tl_parallel_fn fn;
    void *arg;
    int n_items;
    int chunk;              /* items per chunk, a multiple of grain */
    atomic_int next;        /* first unclaimed item */
    atomic_int state;       /* JOB_CLOSED | workers inside; written only by atomic RMW */
} tl_job;

struct tl_threadpool {
    int n_threads;
    pthread_t *threads;
    tl_job job;
    atomic_uint generation;  /* bumped once per parallel_for */
    atomic_int sleepers;     /* workers blocked (or about to block) on wake */
    atomic_int stop;
    pthread_mutex_t lock;
    pthread_cond_t wake;
};

typedef struct tl_worker_arg {
    tl_threadpool *pool;
    int index;
} tl_worker_arg;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void run_chunks(tl_job *job, int thread_index) {
    for (;;) {
        int begin = atomic_fetch_add_explicit(&job->next, job->chunk, memory_order_relaxed);
        if (begin >= job->n_items) break;
        int end = begin + job->chunk < job->n_items ? begin + job->chunk : job->n_items;
        job->fn(job->arg, begin, end, thread_index);
    }
}

/* Wait until the generation differs from `seen` or the pool stops; spins first. */
static unsigned wait_for_job(tl_threadpool *pool, unsigned seen) {
    int64_t deadline = now_ns() + TL_SPIN_NS;
    for (int spins = 0;; spins++) {
        unsigned g = atomic_load_explicit(&pool->generation, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&pool->stop, memory_order_acquire)) return g;
        TL_CPU_RELAX();
        if ((spins & 255) == 255 && now_ns() > deadline) break;
    }
    pthread_mutex_lock(&pool->lock);
    /* seq_cst pairs with the publisher: it bumps generation then reads sleepers,
     * we bump sleepers then read generation, so one of us sees the other. */
    atomic_fetch_add(&pool->sleepers, 1);
    unsigned g;
    while ((g = atomic_load(&pool->generation)) == seen && !atomic_load(&pool->stop))
        pthread_cond_wait(&pool->wake, &pool->lock);
    atomic_fetch_sub(&pool->sleepers, 1);
    pthread_mutex_unlock(&pool->lock);
    return g;
}

static void *worker_main(void *p) {
    tl_worker_arg wa = *(tl_worker_arg *)p;
    free(p);
    tl_threadpool *pool = wa.pool;
    unsigned seen = 0; /* the generation at creation: a job posted before we ran is still ours */
    for (;;) {
        seen = wait_for_job(pool, seen);
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) break;
        /* Entering may land in a later job than `seen` (the caller already moved on):
         * that job is open, so taking its chunks is right too. */
        int state = atomic_fetch_add_explicit(&pool->job.state, 1, memory_order_acq_rel);
        if (!(state & JOB_CLOSED)) run_chunks(&pool->job, wa.index);
        atomic_fetch_sub_explicit(&pool->job.state, 1, memory_order_release);
    }
    return NULL;
}

tl_threadpool *tl_threadpool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    tl_threadpool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    atomic_init(&pool->generation, 0);
    atomic_init(&pool->sleepers, 0);
    atomic_init(&pool->stop, 0);
    atomic_init(&pool->job.next, 0);
    atomic_init(&pool->job.state, JOB_CLOSED);
    if (n_threads > 1) {
        pool->threads = calloc((size_t)n_threads - 1, sizeof *pool->threads);
        if (!pool->threads) {
            pool->n_threads = 1;
            tl_threadpool_destroy(pool);
            return NULL;
        }
    }
    for (int i = 1; i < n_threads; i++) {
        tl_worker_arg *wa = malloc(sizeof *wa);
        if (wa) {
            wa->pool = pool;
            wa->index = i;
        }
        if (!wa || pthread_create(&pool->threads[i - 1], NULL, worker_main, wa) != 0) {
            free(wa);
            pool->n_threads = i; /* destroy joins only the threads 1..i-1 that exist */
            tl_threadpool_destroy(pool);
            return NULL;
        }
    }
    return pool;
}

void tl_threadpool_destroy(tl_threadpool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->stop, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->threads[i - 1], NULL);
    free(pool->threads);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

int tl_threadpool_size(const tl_threadpool *pool) { return pool ? pool->n_threads : 1; }

void tl_parallel_for(tl_threadpool *pool, int n_items, int grain, tl_parallel_fn fn, void *arg) {
    if (n_items <= 0) return;
    if (grain < 1) grain = 1;
    int n_threads = tl_threadpool_size(pool);
    int n_grains = (n_items + grain - 1) / grain;
    if (n_threads == 1 || n_grains == 1) {
        fn(arg, 0, n_items, 0);
        return;
    }
    int n_chunks = n_threads * TL_CHUNKS_PER_THREAD;
    if (n_chunks > n_grains) n_chunks = n_grains;
    int grains_per_chunk = (n_grains + n_chunks - 1) / n_chunks;

    /* The previous job is closed and empty: no worker reads these fields now. */
    tl_job *job = &pool->job;
    job->fn = fn;
    job->arg = arg;
    job->n_items = n_items;
    job->chunk = grains_per_chunk * grain;
    atomic_store_explicit(&job->next, 0, memory_order_relaxed);
    atomic_fetch_and_explicit(&job->state, ~JOB_CLOSED, memory_order_release); /* open it */
    atomic_fetch_add(&pool->generation, 1); /* seq_cst: wakes spinners and sleepers */
    if (atomic_load(&pool->sleepers) > 0) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }

    run_chunks(job, 0);

    /* Every chunk is claimed. Close the job and wait for the workers inside it, which
     * finish soon; yield if one was descheduled in the middle of a chunk. */
    atomic_fetch_or_explicit(&job->state, JOB_CLOSED, memory_order_acq_rel);
    for (int spins = 0;
         (atomic_load_explicit(&job->state, memory_order_acquire) & ~JOB_CLOSED) != 0; spins++) {
        if (spins < 4096)
            TL_CPU_RELAX();
        else
            sched_yield();
    }
}

int tl_num_cores(void) {
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}
