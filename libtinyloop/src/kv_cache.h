/* kv_cache.h — K/V rows of one sequence, one slot per virtual layer
 * (docs/model.md: prelude, every loop iteration of every core block, coda). Keys are
 * stored after RoPE, as f32 rows of n_kv_head * head_dim in backend buffers. */
#ifndef TL_KV_CACHE_H
#define TL_KV_CACHE_H

#include <stddef.h>

#include "backend.h"

typedef struct tl_kv_cache {
    tl_backend *be;
    tl_buf *k, *v;          /* [n_slots][max_seq][kv_dim] each */
    int n_slots, max_seq, kv_dim;
} tl_kv_cache;

/* Slots for a context with loop_slots slots per core block (kv_policy.h: its max depth
 * when exact, fewer when iterations share them). */
int tl_kv_slot_count(const tl_hparams *hp, int loop_slots);
/* Slot of a prelude block b, core block c in iteration i (1-based: slot (i - 1) mod
 * loop_slots, so every iteration has its own when exact), coda block b. */
int tl_kv_slot_pre(const tl_hparams *hp, int b);
int tl_kv_slot_core(const tl_hparams *hp, int loop_slots, int iteration, int c);
int tl_kv_slot_post(const tl_hparams *hp, int loop_slots, int b);

tl_status tl_kv_cache_init(tl_kv_cache *kv, tl_backend *be, int n_slots, int max_seq, int kv_dim);
void tl_kv_cache_free(tl_kv_cache *kv);
size_t tl_kv_cache_bytes(const tl_kv_cache *kv);
/* Row 0 of a slot's keys / values. */
tl_act tl_kv_keys(const tl_kv_cache *kv, int slot);
tl_act tl_kv_values(const tl_kv_cache *kv, int slot);
/* Copy the first n_rows positions of every slot of src into dst (same geometry). */
void tl_kv_cache_copy(tl_kv_cache *dst, const tl_kv_cache *src, tl_exec *ex, int n_rows);
/* Row `from` of every slot to row `to` (distinct rows; tree speculation's accepted path). */
void tl_kv_cache_move_row(tl_kv_cache *kv, tl_exec *ex, int from, int to);

#endif
