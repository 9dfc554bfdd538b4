/* kv_cache.c — slot layout and storage of the KV cache (one slot per iteration when
 * exact, shared by iterations under an approximate policy: kv_policy.h).
 * Contiguous buffers are sized once from max_seq_len and the context's max depth; on the
 * CPU the allocation is lazy (untouched pages cost no memory), so a long max_seq_len
 * only costs what the sequence actually fills. Paged caches take pages from the model's
 * pool as they grow (kv_cache.h). */
#include "runtime/kv_cache.h"

#include <stdlib.h>
#include <string.h>

#include "base/error.h"

int tl_kv_slot_count(const tl_hparams *hp, int loop_slots) {
    return hp->n_pre + loop_slots * hp->n_core + hp->n_post;
}

int tl_kv_slot_pre(const tl_hparams *hp, int b) { return b; }

uint64_t tl_kv_bytes_per_position(const tl_hparams *hp, const tl_kv_choice *policy, int max_depth, int f16) {
    uint64_t kv = (uint64_t)tl_kv_slot_count(hp, tl_kv_loop_slots(policy, max_depth)) * 2 * hp->n_kv_head *
                  hp->head_dim * tl_kv_elem_bytes(f16);
    uint64_t inputs = tl_kv_stores_h(policy) ? (uint64_t)hp->n_core * max_depth * hp->d * sizeof(float) : 0;
    return kv + inputs;
}

int tl_kv_slot_core(const tl_hparams *hp, int loop_slots, int iteration, int c) {
    return hp->n_pre + ((iteration - 1) % loop_slots) * hp->n_core + c;
}

/* Coda slots sit after the loop's slots (as many as the context's deepest depth when
 * exact), so a sequence's depth does not move them. */
int tl_kv_slot_post(const tl_hparams *hp, int loop_slots, int b) {
    return hp->n_pre + loop_slots * hp->n_core + b;
}

/* ---- the pool ------------------------------------------------------------------ */

tl_status tl_kv_buf_alloc(tl_backend *be, int f16, size_t n, tl_buf **out) {
    return f16 ? be->ops->buf_alloc_f16(be, n, out) : be->ops->buf_alloc(be, n, out);
}

tl_status tl_kv_pool_create(tl_backend *be, int page_size, uint64_t cap_bytes, int f16, tl_kv_pool **out) {
    tl_kv_pool *p = calloc(1, sizeof *p);
    if (!p) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate the KV page pool");
    p->be = be;
    p->page_size = page_size;
    p->f16 = f16;
    p->cap_bytes = cap_bytes;
    pthread_mutex_init(&p->lock, NULL);
    *out = p;
    return TL_OK;
}

void tl_kv_pool_destroy(tl_kv_pool *p) {
    if (!p) return;
    pthread_mutex_destroy(&p->lock);
    free(p);
}

void tl_kv_pool_usage(tl_kv_pool *p, uint64_t *bytes, uint64_t *pages) {
    pthread_mutex_lock(&p->lock);
    *bytes = p->bytes;
    *pages = p->pages;
    pthread_mutex_unlock(&p->lock);
}

/* Elements of a page (floats, or halves when f16). */
static size_t page_floats(const tl_kv_cache *kv) {
    return 2 * (size_t)kv->n_slots * (size_t)kv->page_size * (size_t)kv->kv_dim;
}

/* A new page (one reference), counted against the cap. */
static tl_status page_new(tl_kv_cache *kv, tl_kv_page **out) {
    tl_kv_pool *p = kv->pool;
    size_t bytes = page_floats(kv) * tl_kv_elem_bytes(kv->f16);
    pthread_mutex_lock(&p->lock);
    int over = p->cap_bytes && p->bytes + bytes > p->cap_bytes;
    uint64_t held = p->bytes, pages = p->pages;
    if (!over) {
        p->bytes += bytes;
        p->pages++;
    }
    pthread_mutex_unlock(&p->lock);
    if (over)
        return tl_fail(TL_ERR_OUT_OF_MEMORY,
                       "the KV page pool is at its cap kv_pool_bytes = %llu: %llu pages of %d "
                       "positions (%llu bytes) are in use and a page is %zu bytes more",
                       (unsigned long long)p->cap_bytes, (unsigned long long)pages, p->page_size,
                       (unsigned long long)held, bytes);
    tl_kv_page *pg = calloc(1, sizeof *pg);
    tl_status st = pg ? tl_kv_buf_alloc(kv->be, kv->f16, page_floats(kv), &pg->buf) : TL_ERR_OUT_OF_MEMORY;
    if (st != TL_OK) {
        free(pg);
        pthread_mutex_lock(&p->lock);
        p->bytes -= bytes;
        p->pages--;
        pthread_mutex_unlock(&p->lock);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a KV page of %zu bytes", bytes);
    }
    pg->bytes = bytes;
    pg->refs = 1;
    pg->pool = p;
    *out = pg;
    return TL_OK;
}

static void page_retain(tl_kv_page *pg) { __atomic_add_fetch(&pg->refs, 1, __ATOMIC_RELAXED); }

static void page_release(tl_kv_page *pg) {
    if (!pg || __atomic_sub_fetch(&pg->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
    tl_kv_pool *p = pg->pool;
    p->be->ops->buf_free(pg->buf);
    pthread_mutex_lock(&p->lock);
    p->bytes -= pg->bytes;
    p->pages--;
    pthread_mutex_unlock(&p->lock);
    free(pg);
}

static int page_shared(tl_kv_page *pg) { return __atomic_load_n(&pg->refs, __ATOMIC_ACQUIRE) > 1; }

/* Entry i of the table becomes pg (the table takes over the caller's reference). */
static void table_set(tl_kv_cache *kv, tl_exec *ex, int i, tl_kv_page *pg) {
    kv->pages[i] = pg;
    kv->be->ops->page_table_set(ex, kv->k, i, pg ? pg->buf : NULL);
}

/* ---- the cache ------------------------------------------------------------------ */

tl_status tl_kv_cache_init(tl_kv_cache *kv, tl_backend *be, tl_kv_pool *pool, int n_slots, int max_seq,
                           int kv_dim, int f16, int ring) {
    memset(kv, 0, sizeof *kv);
    kv->be = be;
    kv->f16 = pool ? pool->f16 : f16;
    kv->n_slots = n_slots;
    /* a ring's last page would be taken whole anyway: its rows widen the ring */
    if (ring && pool) max_seq = (max_seq + pool->page_size - 1) / pool->page_size * pool->page_size;
    kv->max_seq = max_seq;
    kv->ring = ring;
    kv->kv_dim = kv_dim;
    size_t count = (size_t)n_slots * (size_t)max_seq * (size_t)kv_dim;
    if (count == 0) return TL_OK;
    if (pool) {
        kv->pool = pool;
        kv->page_size = pool->page_size;
        kv->n_pages = (max_seq + pool->page_size - 1) / pool->page_size;
        kv->pages = calloc((size_t)kv->n_pages, sizeof *kv->pages);
        tl_status st = kv->pages ? be->ops->page_table_create(be, kv->n_pages, kv->page_size, n_slots, kv_dim,
                                                              kv->f16, &kv->k, &kv->v)
                                 : tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a KV page table");
        if (st != TL_OK) {
            free(kv->pages);
            kv->pages = NULL;
            kv->pool = NULL;
        } else if (ring) {
            be->ops->kv_ring(kv->k, max_seq);
        }
        return st;
    }
    tl_status st = tl_kv_buf_alloc(be, kv->f16, count, &kv->k);
    if (st == TL_OK) st = tl_kv_buf_alloc(be, kv->f16, count, &kv->v);
    if (st == TL_OK && ring) {
        be->ops->kv_ring(kv->k, max_seq);
        be->ops->kv_ring(kv->v, max_seq);
    }
    if (st != TL_OK) {
        tl_kv_cache_free(kv);
        return tl_fail(TL_ERR_OUT_OF_MEMORY,
                       "cannot allocate the KV cache: %d slots x %d positions x %d %s, "
                       "twice (%zu bytes); lower max_seq_len or max_depth",
                       n_slots, max_seq, kv_dim, kv->f16 ? "halves" : "floats",
                       2 * count * tl_kv_elem_bytes(kv->f16));
    }
    return TL_OK;
}

void tl_kv_cache_free(tl_kv_cache *kv) {
    if (kv->pool) {
        for (int i = 0; i < kv->n_pages; i++) page_release(kv->pages[i]);
        free(kv->pages);
        kv->be->ops->page_table_free(kv->k);
        kv->pages = NULL;
        kv->pool = NULL;
        kv->k = kv->v = NULL;
        return;
    }
    if (kv->k) kv->be->ops->buf_free(kv->k);
    if (kv->v) kv->be->ops->buf_free(kv->v);
    kv->k = kv->v = NULL;
}

size_t tl_kv_cache_bytes(const tl_kv_cache *kv) {
    if (kv->pool) return 0;
    return 2 * (size_t)kv->n_slots * (size_t)kv->max_seq * (size_t)kv->kv_dim * tl_kv_elem_bytes(kv->f16);
}

/* Row 0 of a slot: max_seq rows apart when contiguous, page_size rows apart inside a
 * page when paged. */
static size_t slot_offset(const tl_kv_cache *kv, int slot) {
    return (size_t)slot * (size_t)(kv->pool ? kv->page_size : kv->max_seq) * (size_t)kv->kv_dim;
}

tl_act tl_kv_keys(const tl_kv_cache *kv, int slot) { return tl_act_at(kv->k, slot_offset(kv, slot)); }

tl_act tl_kv_values(const tl_kv_cache *kv, int slot) {
    return tl_act_at(kv->v, slot_offset(kv, slot));
}

int tl_kv_cache_keeps(const tl_kv_cache *kv, int attn, size_t n_keep) {
    if (!kv->ring || n_keep == 0) return 1;
    /* the ring holds positions [written - rows, written) */
    return (long long)n_keep - attn + 1 >= (long long)kv->written - kv->max_seq;
}

/* The pages of rows [row0, row0 + n) taken, those shared copied. */
static tl_status reserve_rows(tl_kv_cache *kv, tl_exec *ex, int row0, int n) {
    int first = row0 / kv->page_size, last = (row0 + n - 1) / kv->page_size;
    int copied = 0;
    for (int i = first; i <= last; i++) {
        tl_kv_page *old = kv->pages[i];
        if (old && !page_shared(old)) continue;
        tl_kv_page *pg = NULL;
        tl_status st = page_new(kv, &pg);
        if (st != TL_OK) return st;   /* the pages taken so far hold what was there */
        if (old) {   /* copy on write: the whole page, every slot, keys and values */
            size_t count = page_floats(kv);
            kv->be->ops->copy_rows(ex, tl_act_at(pg->buf, 0), count, tl_act_at(old->buf, 0), count, 1, (int)count);
            copied = 1;
        }
        table_set(kv, ex, i, pg);
        if (old && copied) {
            /* the other holders may write the old page once it is theirs alone: the copy
               must have read it first (a device runs the copy asynchronously) */
            tl_status wait = kv->be->ops->status(ex);
            if (wait != TL_OK) return wait;
            copied = 0;
        }
        page_release(old);
    }
    return TL_OK;
}

tl_status tl_kv_cache_reserve(tl_kv_cache *kv, tl_exec *ex, int pos0, int n) {
    if (n <= 0) return TL_OK;
    if (!kv->ring) return kv->pool ? reserve_rows(kv, ex, pos0, n) : TL_OK;
    tl_status st = TL_OK;
    if (kv->pool) {
        /* the positions' rows: one run, or two where they wrap */
        int rows = kv->max_seq, r0 = pos0 % rows;
        if (n >= rows) st = reserve_rows(kv, ex, 0, rows);
        else if (r0 + n <= rows) st = reserve_rows(kv, ex, r0, n);
        else {
            st = reserve_rows(kv, ex, r0, rows - r0);
            if (st == TL_OK) st = reserve_rows(kv, ex, 0, r0 + n - rows);
        }
    }
    if (st == TL_OK && pos0 + n > kv->written) kv->written = pos0 + n;
    return st;
}

void tl_kv_cache_trim(tl_kv_cache *kv, tl_exec *ex, int n_rows) {
    if (kv->ring) {
        if (n_rows > 0) return;   /* every row may hold a position still seen */
        kv->written = 0;
    }
    if (!kv->pool) return;
    for (int i = (n_rows + kv->page_size - 1) / kv->page_size; i < kv->n_pages; i++) {
        if (!kv->pages[i]) continue;
        tl_kv_page *pg = kv->pages[i];
        table_set(kv, ex, i, NULL);
        page_release(pg);
    }
}

void tl_kv_cache_copy(tl_kv_cache *dst, const tl_kv_cache *src, tl_exec *ex, int n_rows) {
    if (n_rows <= 0 || !src->k) return;
    if (src->ring) {   /* the positions lie all over the ring */
        n_rows = src->max_seq;
        dst->written = src->written;
    }
    if (src->pool) {
        tl_kv_page_list list = { src->n_slots, 0, (n_rows + src->page_size - 1) / src->page_size, src->pages };
        tl_kv_cache_adopt(dst, ex, &list, n_rows);
        return;
    }
    size_t count = (size_t)n_rows * (size_t)src->kv_dim;
    for (int s = 0; s < src->n_slots; s++) {
        src->be->ops->copy_rows(ex, tl_kv_keys(dst, s), count, tl_kv_keys(src, s), count, 1,
                                (int)count);
        src->be->ops->copy_rows(ex, tl_kv_values(dst, s), count, tl_kv_values(src, s), count,
                                1, (int)count);
    }
}

void tl_kv_cache_move_row(tl_kv_cache *kv, tl_exec *ex, int from, int to) {
    if (!kv->k) return;
    if (kv->pool) {
        /* every slot's key row, then every slot's value row: 2 * n_slots rows page_size
           rows apart, from one page to another (or the same) */
        size_t w = (size_t)kv->kv_dim, stride = (size_t)kv->page_size * w;
        tl_kv_page *a = kv->pages[from / kv->page_size], *b = kv->pages[to / kv->page_size];
        kv->be->ops->copy_rows(ex, tl_act_at(b->buf, (size_t)(to % kv->page_size) * w), stride,
                               tl_act_at(a->buf, (size_t)(from % kv->page_size) * w), stride,
                               2 * kv->n_slots, kv->kv_dim);
        return;
    }
    /* one strided copy per plane: a slot's rows are max_seq rows apart */
    size_t stride = (size_t)kv->max_seq * (size_t)kv->kv_dim, w = (size_t)kv->kv_dim;
    tl_buf *planes[] = { kv->k, kv->v };
    for (int i = 0; i < 2; i++)
        kv->be->ops->copy_rows(ex, tl_act_at(planes[i], (size_t)to * w), stride, tl_act_at(planes[i], (size_t)from * w),
                               stride, kv->n_slots, kv->kv_dim);
}

/* ---- sharing with prefix caches -------------------------------------------------- */

tl_status tl_kv_cache_share(const tl_kv_cache *kv, int loop_slots, int n_rows, tl_kv_page_list *out) {
    memset(out, 0, sizeof *out);
    out->n_slots = kv->n_slots;
    out->loop_slots = loop_slots;
    out->n_pages = (n_rows + kv->page_size - 1) / kv->page_size;
    if (out->n_pages == 0) return TL_OK;
    out->pages = malloc((size_t)out->n_pages * sizeof *out->pages);
    if (!out->pages) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a list of %d KV pages", out->n_pages);
    for (int i = 0; i < out->n_pages; i++) {
        out->pages[i] = kv->pages[i];
        page_retain(out->pages[i]);
    }
    return TL_OK;
}

void tl_kv_page_list_release(tl_kv_page_list *list) {
    for (int i = 0; i < list->n_pages; i++) page_release(list->pages[i]);
    free(list->pages);
    list->pages = NULL;
    list->n_pages = 0;
}

void tl_kv_cache_adopt(tl_kv_cache *kv, tl_exec *ex, const tl_kv_page_list *list, int n_rows) {
    int n = (n_rows + kv->page_size - 1) / kv->page_size;
    for (int i = 0; i < n; i++) {
        tl_kv_page *old = kv->pages[i];
        page_retain(list->pages[i]);
        table_set(kv, ex, i, list->pages[i]);
        page_release(old);
    }
    tl_kv_cache_trim(kv, ex, n_rows);
}

uint64_t tl_kv_page_list_bytes(const tl_kv_page_list *list) {
    uint64_t sum = 0;
    for (int i = 0; i < list->n_pages; i++) sum += list->pages[i]->bytes;
    return sum;
}
