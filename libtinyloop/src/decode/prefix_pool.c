/* prefix_pool.c — the pool's entries under one lock: insertion with least-recently-used
 * eviction to the byte budget, exact and longest-prefix lookup, and the start of a
 * generation from the best match.
 *
 * The pool holds one reference per cache; a lookup hands out another, so a cache evicted
 * (or the pool freed) while a generation copies from it lives until that copy is done.
 * A generation needs its cache only while loading it: the context then holds the KV. */
#include "decode/prefix_pool.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/error.h"

tl_status tl_pool_open(struct tl_model *model, uint64_t max_bytes, int register_prompts,
                       struct tl_prefix_pool **out) {
    struct tl_prefix_pool *p = calloc(1, sizeof *p);
    if (!p) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a prefix pool");
    if (pthread_mutex_init(&p->lock, NULL) != 0) {
        free(p);
        return tl_fail(TL_ERR_INTERNAL, "cannot initialise the prefix pool's lock");
    }
    p->model = model;
    p->max_bytes = max_bytes;
    p->register_prompts = register_prompts;
    *out = p;
    return TL_OK;
}

void tl_pool_close(struct tl_prefix_pool *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n; i++) tl_prefix_cache_release(p->entries[i].cache);
    pthread_mutex_destroy(&p->lock);
    free(p->entries);
    free(p);
}

static int same_prefix(const struct tl_prefix_cache *c, const int32_t *tokens, size_t n, int depth) {
    return c->depth == depth && c->n_tokens == n && memcmp(c->tokens, tokens, n * sizeof *tokens) == 0;
}

/* Index of the held cache of exactly these tokens, or -1 (lock held). */
static long find_locked(const struct tl_prefix_pool *p, const int32_t *tokens, size_t n, int depth) {
    for (size_t i = 0; i < p->n; i++)
        if (same_prefix(p->entries[i].cache, tokens, n, depth)) return (long)i;
    return -1;
}

/* Mark entry i used and hand out a reference to its cache (lock held). */
static struct tl_prefix_cache *use_locked(struct tl_prefix_pool *p, size_t i) {
    p->entries[i].last_used = ++p->clock;
    tl_prefix_cache_retain(p->entries[i].cache);
    return p->entries[i].cache;
}

static void evict_locked(struct tl_prefix_pool *p, size_t i) {
    struct tl_prefix_cache *c = p->entries[i].cache;
    p->bytes -= c->bytes;
    p->entries[i] = p->entries[--p->n];
    p->n_evicted++;
    tl_prefix_cache_release(c);   /* freed now unless a generation or a caller holds it */
}

static size_t least_recently_used_locked(const struct tl_prefix_pool *p) {
    size_t lru = 0;
    for (size_t i = 1; i < p->n; i++)
        if (p->entries[i].last_used < p->entries[lru].last_used) lru = i;
    return lru;
}

tl_status tl_pool_insert(struct tl_prefix_pool *p, struct tl_prefix_cache *c,
                         struct tl_prefix_cache **held) {
    if (held) *held = NULL;
    if (c->model != p->model)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the prefix cache belongs to another model than the pool");
    if (p->max_bytes && c->bytes > p->max_bytes)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "a prefix of %zu tokens takes %llu bytes, more than "
                       "the pool's whole budget (max_bytes %llu)", c->n_tokens,
                       (unsigned long long)c->bytes, (unsigned long long)p->max_bytes);
    tl_status st = TL_OK;
    pthread_mutex_lock(&p->lock);
    long at = find_locked(p, c->tokens, c->n_tokens, c->depth);
    if (at >= 0) {
        struct tl_prefix_cache *kept = use_locked(p, (size_t)at);
        if (held) *held = kept;
        else tl_prefix_cache_release(kept);
        pthread_mutex_unlock(&p->lock);
        return TL_OK;
    }
    while (p->n > 0 && p->max_bytes && p->bytes + c->bytes > p->max_bytes)
        evict_locked(p, least_recently_used_locked(p));
    if (p->n == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 8;
        tl_pool_entry *grown = realloc(p->entries, cap * sizeof *grown);
        if (!grown) st = tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot grow the prefix pool to %zu entries", cap);
        else {
            p->entries = grown;
            p->cap = cap;
        }
    }
    if (st == TL_OK) {
        tl_prefix_cache_retain(c);
        p->entries[p->n] = (tl_pool_entry){ c, 0 };
        p->bytes += c->bytes;
        struct tl_prefix_cache *kept = use_locked(p, p->n++);
        if (held) *held = kept;
        else tl_prefix_cache_release(kept);
    }
    pthread_mutex_unlock(&p->lock);
    return st;
}

struct tl_prefix_cache *tl_pool_find(struct tl_prefix_pool *p, const int32_t *tokens, size_t n,
                                     int depth) {
    pthread_mutex_lock(&p->lock);
    long at = find_locked(p, tokens, n, depth);
    struct tl_prefix_cache *c = at >= 0 ? use_locked(p, (size_t)at) : NULL;
    pthread_mutex_unlock(&p->lock);
    return c;
}

struct tl_prefix_cache *tl_pool_match(struct tl_prefix_pool *p, const int32_t *prompt, size_t n,
                                      int depth) {
    pthread_mutex_lock(&p->lock);
    long best = -1;
    for (size_t i = 0; i < p->n; i++) {
        const struct tl_prefix_cache *c = p->entries[i].cache;
        if (c->depth != depth || c->n_tokens > n) continue;
        if (best >= 0 && c->n_tokens <= p->entries[best].cache->n_tokens) continue;
        if (memcmp(c->tokens, prompt, c->n_tokens * sizeof *prompt) == 0) best = (long)i;
    }
    struct tl_prefix_cache *c = best >= 0 ? use_locked(p, (size_t)best) : NULL;
    if (c) p->n_hits++;
    else p->n_misses++;
    pthread_mutex_unlock(&p->lock);
    return c;
}

void tl_pool_stats(struct tl_prefix_pool *p, tl_prefix_pool_stats *s) {
    pthread_mutex_lock(&p->lock);
    s->n_prefixes = (uint32_t)p->n;
    s->bytes = p->bytes;
    s->max_bytes = p->max_bytes;
    s->n_hits = p->n_hits;
    s->n_misses = p->n_misses;
    s->n_evicted = p->n_evicted;
    pthread_mutex_unlock(&p->lock);
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

tl_status tl_pool_stream_begin(struct tl_prefix_pool *p, struct tl_stream *g, struct tl_context *ctx,
                               const int32_t *prompt, size_t n_prompt, const tl_generate_options *o,
                               size_t max_tokens_cap, int may_chain) {
    if (n_prompt == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "the prompt is empty (need at least 1 token)");
    if (!prompt) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt is NULL with %zu tokens", n_prompt);
    int depth = 0;
    tl_status st = tl_prefix_cache_resolve_depth(ctx->model, o->depth, &depth);
    if (st != TL_OK) return st;
    double t0 = now_seconds();
    struct tl_prefix_cache *match = tl_pool_match(p, prompt, n_prompt, depth);
    /* the last prompt token is computed: its logits give the first new token */
    size_t k = match ? (match->n_tokens < n_prompt ? match->n_tokens : n_prompt - 1) : 0;
    tl_context_set_length(ctx, 0);
    if (k > 0) st = tl_prefix_cache_load(ctx, match, k);
    tl_prefix_cache_release(match);
    if (st != TL_OK) return st;
    double load_seconds = now_seconds() - t0;
    /* a snapshot must be complete when taken: no step may run ahead of it on a device */
    int add = p->register_prompts && n_prompt > k;
    st = tl_stream_begin(g, ctx, prompt + k, n_prompt - k, o, max_tokens_cap, may_chain && !add);
    if (st != TL_OK) return st;
    g->n_prompt = (uint32_t)n_prompt;
    g->n_cached = (uint32_t)k;
    g->prefill_seconds += load_seconds;
    if (add) {
        /* a failure to add (a prompt over the whole budget, memory) leaves the stream as is */
        struct tl_prefix_cache *c = NULL;
        if (tl_prefix_cache_snapshot(ctx, n_prompt, &c) == TL_OK) {
            (void)tl_pool_insert(p, c, NULL);
            tl_prefix_cache_release(c);
        }
    }
    return TL_OK;
}
