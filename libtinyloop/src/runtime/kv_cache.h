/* kv_cache.h — K/V rows of one sequence, one slot per virtual layer
 * (docs/model.md: prelude, every loop iteration of every core block, coda). Keys are
 * stored after RoPE, as rows of n_kv_head * head_dim elements in backend buffers: f32,
 * or fp16 with the load option kv_dtype f16 (buf_alloc_f16; offsets stay in elements).
 *
 * Two layouts (docs/model.md, "KV cache layout"):
 *   contiguous (the default): one buffer per plane, [n_slots][max_seq][kv_dim];
 *   paged (tl_load_options.kv_page_size): pages of page_size consecutive positions,
 *     each [2][n_slots][page_size][kv_dim] (keys, then values, of every slot), taken
 *     from the model's tl_kv_pool as the sequence grows and reference counted, so that
 *     forks and prefix caches share them; a page is copied before a write when it is
 *     shared (copy on write). The backend reads them through a page table. */
#ifndef TL_KV_CACHE_H
#define TL_KV_CACHE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "model/kv_policy.h"

/* The model's pool of KV pages (NULL on a model without paged KV). */
typedef struct tl_kv_pool {
    tl_backend *be;
    int page_size;            /* positions per page, a power of two */
    int f16;                  /* pages of fp16 elements (kv_dtype f16) */
    uint64_t cap_bytes;       /* 0 = no cap */
    pthread_mutex_t lock;     /* guards the counters */
    uint64_t bytes, pages;    /* pages allocated (all in use: a page is freed at its last
                                 reference) */
} tl_kv_pool;

typedef struct tl_kv_page {
    tl_buf *buf;              /* [2][n_slots][page_size][kv_dim] */
    size_t bytes;
    int refs;                 /* atomic */
    tl_kv_pool *pool;
} tl_kv_page;

typedef struct tl_kv_cache {
    tl_backend *be;
    tl_buf *k, *v;          /* contiguous: [n_slots][max_seq][kv_dim] each; paged: the
                               page table's views of every slot's keys and values */
    int n_slots, max_seq, kv_dim;   /* max_seq: rows per slot (a ring's when ring) */
    int ring;                 /* 1: each slot is a ring of max_seq rows (a cache window):
                                 position p at row p mod max_seq (backend.h, kv_ring) */
    int written;              /* ring: 1 + the last position a pass reserved, so that
                                 a truncation knows which positions were overwritten */
    int f16;                  /* fp16 elements (kv_dtype f16), else f32 */
    /* paged only (pool != NULL) */
    tl_kv_pool *pool;
    int page_size, n_pages;   /* table entries: max_seq / page_size rounded up */
    tl_kv_page **pages;       /* the table, host side: NULL = no page there yet */
} tl_kv_cache;

/* Slots for a context with loop_slots slots per core block (kv_policy.h: its max depth
 * when exact, fewer when iterations share them). */
int tl_kv_slot_count(const tl_hparams *hp, int loop_slots);
/* Slot of a prelude block b, core block c in iteration i (1-based: slot (i - 1) mod
 * loop_slots, so every iteration has its own when exact), coda block b. */
int tl_kv_slot_pre(const tl_hparams *hp, int b);
int tl_kv_slot_core(const tl_hparams *hp, int loop_slots, int iteration, int c);
int tl_kv_slot_post(const tl_hparams *hp, int loop_slots, int b);

/* Bytes a context caching up to max_depth iterations under `policy` holds per position:
 * its slots' keys and values (fp16 or f32 elements), plus under store_h the core blocks'
 * inputs of every iteration (f32). */
uint64_t tl_kv_bytes_per_position(const tl_hparams *hp, const tl_kv_choice *policy, int max_depth, int f16);

/* Storage of n KV elements, fp16 (f16) or f32, and the bytes of one. */
tl_status tl_kv_buf_alloc(tl_backend *be, int f16, size_t n, tl_buf **out);
static inline size_t tl_kv_elem_bytes(int f16) { return f16 ? 2 : 4; }

/* Pool of pages of page_size positions up to cap_bytes (0 = no cap), of fp16 elements
 * when f16. */
tl_status tl_kv_pool_create(tl_backend *be, int page_size, uint64_t cap_bytes, int f16, tl_kv_pool **out);
void tl_kv_pool_destroy(tl_kv_pool *pool);
void tl_kv_pool_usage(tl_kv_pool *pool, uint64_t *bytes, uint64_t *pages);

/* pool NULL: contiguous (of fp16 elements when f16); else paged (no page is taken yet,
 * the pool's element type). ring: the slots are rings of max_seq rows (paged: rounded
 * up to whole pages) that positions wrap around. */
tl_status tl_kv_cache_init(tl_kv_cache *kv, tl_backend *be, tl_kv_pool *pool, int n_slots, int max_seq,
                           int kv_dim, int f16, int ring);
/* Ring: whether positions [n_keep - attn + 1, n_keep) are still held (none was
 * overwritten), so that the sequence may be cut to n_keep; always for a full cache or
 * n_keep 0. */
int tl_kv_cache_keeps(const tl_kv_cache *kv, int attn, size_t n_keep);
void tl_kv_cache_free(tl_kv_cache *kv);
/* Bytes the context holds on its own: the contiguous buffers; 0 when paged (the pool
 * counts pages). */
size_t tl_kv_cache_bytes(const tl_kv_cache *kv);
/* Row 0 of a slot's keys / values. */
tl_act tl_kv_keys(const tl_kv_cache *kv, int slot);
tl_act tl_kv_values(const tl_kv_cache *kv, int slot);
/* Before rows [pos0, pos0 + n) are written (paged; a no-op when contiguous, but for a
 * ring's count of positions written): take the pages they lack and copy those that are
 * shared. TL_ERR_OUT_OF_MEMORY at the pool's
 * cap or a failed allocation, with every row held unchanged. */
tl_status tl_kv_cache_reserve(tl_kv_cache *kv, tl_exec *ex, int pos0, int n);
/* Give back the pages past the first n_rows positions (paged; a no-op when contiguous;
 * a ring gives back pages only when n_rows is 0). */
void tl_kv_cache_trim(tl_kv_cache *kv, tl_exec *ex, int n_rows);
/* Copy the first n_rows positions of every slot of src into dst (same geometry; a
 * ring: every row); paged: dst (empty) shares src's pages instead. */
void tl_kv_cache_copy(tl_kv_cache *dst, const tl_kv_cache *src, tl_exec *ex, int n_rows);
/* Row `from` of every slot to row `to` (distinct rows, already reserved; tree
 * speculation's accepted path). */
void tl_kv_cache_move_row(tl_kv_cache *kv, tl_exec *ex, int from, int to);

/* References to the pages of the first n_rows positions (paged): a prefix cache's. */
typedef struct tl_kv_page_list {
    int n_slots, loop_slots;  /* the geometry of the context they came from */
    int n_pages;
    tl_kv_page **pages;
} tl_kv_page_list;
tl_status tl_kv_cache_share(const tl_kv_cache *kv, int loop_slots, int n_rows, tl_kv_page_list *out);
void tl_kv_page_list_release(tl_kv_page_list *list);
/* kv (paged, of the same geometry as the list) holds the list's pages for its first
 * n_rows positions, in place of its own. */
void tl_kv_cache_adopt(tl_kv_cache *kv, tl_exec *ex, const tl_kv_page_list *list, int n_rows);
/* Bytes of the pages in the list. */
uint64_t tl_kv_page_list_bytes(const tl_kv_page_list *list);

#endif
