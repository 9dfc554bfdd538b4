/* cpu/threadpool.h — a fixed pool of worker threads for data-parallel loops. */
#ifndef TL_THREADPOOL_H
#define TL_THREADPOOL_H

typedef struct tl_threadpool tl_threadpool;

/* fn(arg, begin, end, thread_index) processes items [begin, end). */
typedef void (*tl_parallel_fn)(void *arg, int begin, int end, int thread_index);

/* n_threads includes the calling thread; 1 = no workers. Returns NULL on failure. */
tl_threadpool *tl_threadpool_create(int n_threads);
void tl_threadpool_destroy(tl_threadpool *pool);
int tl_threadpool_size(const tl_threadpool *pool);   /* 1 for NULL */
/* Split [0, n_items) into contiguous chunks (multiples of `grain`) over the threads and
 * wait for all. The caller runs one share itself. Not reentrant: one parallel_for per
 * pool at a time (each tl_context owns a pool or borrows the model's under its lock). */
void tl_parallel_for(tl_threadpool *pool, int n_items, int grain, tl_parallel_fn fn, void *arg);
int tl_num_cores(void);

#endif
