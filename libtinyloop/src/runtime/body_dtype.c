/* body_dtype.c — decodes the loop body's matrices into f16 or f32 copies at load
 * (tinyloop.h, tl_body_dtype; docs/api.md, "Body dtype").
 *
 * Each matrix is decoded row by row with the CPU backend's reader of the canonical
 * layout (tl_cpu_dequant_row: w = scale * q + min in f32 for q8/q4/q2, the values for
 * f32/f16/bf16) and stored as f16 (round to nearest even) or f32. The tensor view in
 * the model then points at the copy with dtype f16/f32 and no scales, so backends
 * repack or upload it like any float tensor of a file. */
#include "runtime/body_dtype.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/tensor.h"
#include "cpu/kernels.h"
#include "model/model.h"

#define COPY_ALIGN 64

tl_status tl_body_dtype_check(int32_t body_dtype)
{
    if (body_dtype < TL_BODY_AS_STORED || body_dtype > TL_BODY_F32)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "body_dtype %d is not a tl_body_dtype "
                       "(0 = as stored, 1 = f16, 2 = f32)", body_dtype);
    return TL_OK;
}

/* The body's matrices, i = 0, 1, ...: per core block q k v o gate up down, then the
 * concat injection's W_a; NULL past the last one. */
#define MATRICES_PER_BLOCK 7
static tl_tensor *body_matrix(const struct tl_model *m, int i)
{
    if (i < m->hp.n_core * MATRICES_PER_BLOCK) {
        tl_block_weights *b = &m->core[i / MATRICES_PER_BLOCK];
        tl_tensor *ts[MATRICES_PER_BLOCK] = {&b->wq, &b->wk, &b->wv, &b->wo,
                                             &b->w_gate, &b->w_up, &b->w_down};
        return ts[i % MATRICES_PER_BLOCK];
    }
    if (i == m->hp.n_core * MATRICES_PER_BLOCK && m->inject_w.data)
        return (tl_tensor *)&m->inject_w;
    return NULL;
}

static size_t round_up(size_t v) { return (v + COPY_ALIGN - 1) & ~(size_t)(COPY_ALIGN - 1); }

/* Decodes t into dst (rows x cols of `target`); fails on a value f16 cannot hold. */
static tl_status convert(const tl_tensor *t, tl_dtype target, void *dst, float *row,
                         const char *path)
{
    const size_t cols = (size_t)t->cols;
    for (int64_t r = 0; r < t->rows; r++) {
        tl_cpu_dequant_row(t, r, row);
        if (target == TL_DTYPE_F32) {
            memcpy((float *)dst + (size_t)r * cols, row, cols * sizeof(float));
            continue;
        }
        uint16_t *out = (uint16_t *)dst + (size_t)r * cols;
        for (size_t c = 0; c < cols; c++) {
            out[c] = tl_f32_to_f16(row[c]);
            if ((out[c] & 0x7c00u) == 0x7c00u && isfinite(row[c]))
                return tl_fail(TL_ERR_INVALID_ARGUMENT, "body_dtype f16: %s: tensor %s holds %g at "
                               "[%lld, %zu], beyond fp16's range (65504); use body_dtype f32",
                               path, t->name, (double)row[c], (long long)r, c);
        }
    }
    return TL_OK;
}

tl_status tl_body_dtype_apply(struct tl_model *m, const char *path)
{
    const int32_t choice = m->load_opts.body_dtype;
    tl_status st = tl_body_dtype_check(choice);
    if (st != TL_OK || choice == TL_BODY_AS_STORED)
        return st;
    const char *name = choice == TL_BODY_F16 ? "f16" : "f32";
    if (m->hp.n_core == 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "body_dtype %s: %s has no loop body (n_core = 0); "
                       "load it with body_dtype 0 (as stored)", name, path);
    const tl_dtype target = choice == TL_BODY_F16 ? TL_DTYPE_F16 : TL_DTYPE_F32;
    const size_t elem = target == TL_DTYPE_F16 ? 2 : 4;

    size_t total = 0, widest = 0;
    const tl_tensor *t;
    for (int i = 0; (t = body_matrix(m, i)) != NULL; i++) {
        if (t->dtype == target)
            continue;                       /* already what is asked: keep the file's view */
        total += round_up((size_t)t->rows * (size_t)t->cols * elem);
        widest = (size_t)t->cols > widest ? (size_t)t->cols : widest;
    }
    void *arena = NULL;
    float *row = NULL;
    if (total && (posix_memalign(&arena, COPY_ALIGN, total) != 0 ||
                  !(row = malloc(widest * sizeof *row)))) {
        free(arena);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "body_dtype %s: cannot allocate %.1f MiB for the loop body",
                       name, (double)total / 1048576.0);
    }
    unsigned char *cursor = arena;
    tl_tensor *w;
    for (int i = 0; st == TL_OK && (w = body_matrix(m, i)) != NULL; i++) {
        if (w->dtype == target)
            continue;
        st = convert(w, target, cursor, row, path);
        w->dtype = target;
        w->data = cursor;
        w->group = 0;
        w->scales = w->mins = NULL;
        w->nbytes = (uint64_t)w->rows * (uint64_t)w->cols * elem;
        cursor += round_up((size_t)w->nbytes);
    }
    free(row);
    m->body_copy = arena;   /* freed with the model, also on failure */
    return st;
}

uint64_t tl_body_bytes(const struct tl_model *m)
{
    uint64_t sum = 0;
    const tl_tensor *t;
    for (int i = 0; (t = body_matrix(m, i)) != NULL; i++)
        sum += t->nbytes;
    return sum;
}
