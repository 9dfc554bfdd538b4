/* prefix_pool.h — tl_prefix_pool: a thread-safe set of prefix caches of one model under
 * a byte budget (least recently used evicted first), and the generation that starts from
 * its best match. */
#ifndef TL_PREFIX_POOL_H
#define TL_PREFIX_POOL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "decode/generate.h"
#include "runtime/prefix_cache.h"

typedef struct tl_pool_entry {
    struct tl_prefix_cache *cache;   /* the pool's reference */
    uint64_t last_used;              /* the pool's clock at its last add or match */
} tl_pool_entry;

struct tl_prefix_pool {
    struct tl_model *model;
    pthread_mutex_t lock;            /* guards everything below */
    tl_pool_entry *entries;
    size_t n, cap;
    uint64_t max_bytes, bytes, clock;
    uint64_t n_hits, n_misses, n_evicted;
    int register_prompts;
};

tl_status tl_pool_open(struct tl_model *model, uint64_t max_bytes, int register_prompts,
                       struct tl_prefix_pool **out);
void tl_pool_close(struct tl_prefix_pool *pool);
/* Add a cache (the pool takes a reference), evicting the least recently used to fit.
 * *held (may be NULL) gets the pool's cache of that prefix (a new reference): this one,
 * or the one already held for the same tokens and depth. */
tl_status tl_pool_insert(struct tl_prefix_pool *pool, struct tl_prefix_cache *cache,
                         struct tl_prefix_cache **held);
/* The held cache (a new reference) of exactly these tokens at depth, or NULL. */
struct tl_prefix_cache *tl_pool_find(struct tl_prefix_pool *pool, const int32_t *tokens, size_t n,
                                     int depth);
/* The longest held prefix of the prompt at depth (a new reference, marked used), or NULL;
 * counts a hit or a miss. */
struct tl_prefix_cache *tl_pool_match(struct tl_prefix_pool *pool, const int32_t *prompt, size_t n,
                                      int depth);
void tl_pool_stats(struct tl_prefix_pool *pool, tl_prefix_pool_stats *stats);

/* Begin a stream on ctx (empty, of the pool's model) from the pool's best match (at most
 * n_prompt - 1 of its tokens), then the rest of the prompt; registers the prompt when
 * the pool says so. Arguments as tl_stream_begin's. */
tl_status tl_pool_stream_begin(struct tl_prefix_pool *pool, struct tl_stream *g, struct tl_context *ctx,
                               const int32_t *prompt, size_t n_prompt, const tl_generate_options *o,
                               size_t max_tokens_cap, int may_chain);

#endif
