/* kv_cache.c — slot layout and storage of the KV cache (one slot per iteration when
 * exact, shared by iterations under an approximate policy: kv_policy.h).
 * Buffers are sized once from max_seq_len and the context's max depth; on the CPU
 * the allocation is lazy (untouched pages cost no memory), so a long max_seq_len
 * only costs what the sequence actually fills. */
#include "kv_cache.h"

#include <string.h>

#include "error.h"

int tl_kv_slot_count(const tl_hparams *hp, int loop_slots) {
    return hp->n_pre + loop_slots * hp->n_core + hp->n_post;
}

int tl_kv_slot_pre(const tl_hparams *hp, int b) { return b; }

int tl_kv_slot_core(const tl_hparams *hp, int loop_slots, int iteration, int c) {
    return hp->n_pre + ((iteration - 1) % loop_slots) * hp->n_core + c;
}

/* Coda slots sit after the loop's slots (as many as the context's deepest depth when
 * exact), so a sequence's depth does not move them. */
int tl_kv_slot_post(const tl_hparams *hp, int loop_slots, int b) {
    return hp->n_pre + loop_slots * hp->n_core + b;
}

tl_status tl_kv_cache_init(tl_kv_cache *kv, tl_backend *be, int n_slots, int max_seq,
                           int kv_dim) {
    memset(kv, 0, sizeof *kv);
    kv->be = be;
    kv->n_slots = n_slots;
    kv->max_seq = max_seq;
    kv->kv_dim = kv_dim;
    size_t count = (size_t)n_slots * (size_t)max_seq * (size_t)kv_dim;
    if (count == 0) return TL_OK;
    tl_status st = be->ops->buf_alloc(be, count, &kv->k);
    if (st == TL_OK) st = be->ops->buf_alloc(be, count, &kv->v);
    if (st != TL_OK) {
        tl_kv_cache_free(kv);
        return tl_fail(TL_ERR_OUT_OF_MEMORY,
                       "cannot allocate the KV cache: %d slots x %d positions x %d floats, "
                       "twice (%zu bytes); lower max_seq_len or max_depth",
                       n_slots, max_seq, kv_dim, 2 * count * sizeof(float));
    }
    return TL_OK;
}

void tl_kv_cache_free(tl_kv_cache *kv) {
    if (kv->k) kv->be->ops->buf_free(kv->k);
    if (kv->v) kv->be->ops->buf_free(kv->v);
    kv->k = kv->v = NULL;
}

size_t tl_kv_cache_bytes(const tl_kv_cache *kv) {
    return 2 * (size_t)kv->n_slots * (size_t)kv->max_seq * (size_t)kv->kv_dim * sizeof(float);
}

static size_t slot_offset(const tl_kv_cache *kv, int slot) {
    return (size_t)slot * (size_t)kv->max_seq * (size_t)kv->kv_dim;
}

tl_act tl_kv_keys(const tl_kv_cache *kv, int slot) { return tl_act_at(kv->k, slot_offset(kv, slot)); }

tl_act tl_kv_values(const tl_kv_cache *kv, int slot) {
    return tl_act_at(kv->v, slot_offset(kv, slot));
}

void tl_kv_cache_copy(tl_kv_cache *dst, const tl_kv_cache *src, tl_exec *ex, int n_rows) {
    if (n_rows <= 0 || !src->k) return;
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
    /* one strided copy per plane: a slot's rows are max_seq rows apart */
    size_t stride = (size_t)kv->max_seq * (size_t)kv->kv_dim, w = (size_t)kv->kv_dim;
    tl_buf *planes[] = { kv->k, kv->v };
    for (int i = 0; i < 2; i++)
        kv->be->ops->copy_rows(ex, tl_act_at(planes[i], (size_t)to * w), stride, tl_act_at(planes[i], (size_t)from * w),
                               stride, kv->n_slots, kv->kv_dim);
}
