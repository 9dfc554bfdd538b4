/* prefix_cache.h — tl_prefix_cache: an immutable, reference-counted snapshot of the
 * first tokens of a sequence (KV rows of every slot, warm states, kept loop states), and
 * the copies between it and a context. */
#ifndef TL_PREFIX_CACHE_H
#define TL_PREFIX_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "runtime/context.h"

struct tl_prefix_cache {
    struct tl_model *model;
    int refs;                 /* atomic: the creator's, the pools', the generations' */
    int depth;                /* 0 without a loop */
    size_t n_tokens;
    int32_t *tokens;
    int n_slots;              /* n_pre + depth * n_core + n_post, in that order */
    tl_buf *k, *v;            /* [n_slots][n_tokens][kv_dim] each; NULL when paged */
    tl_kv_page_list pages;    /* paged KV: the pages of the context it came from (shared) */
    tl_buf *warm;             /* [n_tokens][d]: a warm state init's final states; or NULL */
    tl_buf *loop_e, *loop_s;  /* [n_tokens][d]: kept loop states (loop_e with injection); or NULL */
    uint64_t bytes;           /* what it keeps alive: its buffers and its pages */
    uint64_t own_bytes;       /* its buffers (the memory report's prefix_cache_bytes;
                                 pages count in the pool's) */
};

/* A snapshot of ctx's first n tokens (1 <= n <= its length); uses ctx's execution state. */
tl_status tl_prefix_cache_snapshot(struct tl_context *ctx, size_t n, struct tl_prefix_cache **out);
/* A snapshot of tokens computed at depth (0 = the model's default) on a context of its own. */
tl_status tl_prefix_cache_compute(struct tl_model *model, const int32_t *tokens, size_t n, int32_t depth,
                                  struct tl_prefix_cache **out);
/* ctx's sequence becomes the first n tokens of the cache (n <= its length). Paged: ctx
 * shares the cache's pages when its slots are laid out alike (the same slot count and
 * loop slots), else they are copied into pages of its own. */
tl_status tl_prefix_cache_load(struct tl_context *ctx, const struct tl_prefix_cache *cache, size_t n);
/* The depth a prefix computed at `depth` (0 = the model's default) runs at, checked. */
tl_status tl_prefix_cache_resolve_depth(const struct tl_model *m, int32_t depth, int *resolved);
void tl_prefix_cache_retain(struct tl_prefix_cache *cache);
void tl_prefix_cache_release(struct tl_prefix_cache *cache);   /* frees at the last reference */

#endif
