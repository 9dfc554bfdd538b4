/* draft_vocab.c — building the draft vocabulary's head (draft_vocab.h). */
#include "model/draft_vocab.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"

typedef struct {
    float frequency;
    int32_t id;
} ranked_token;

static int by_frequency_then_id(const void *pa, const void *pb) {
    const ranked_token *a = pa, *b = pb;
    if (a->frequency != b->frequency) return a->frequency > b->frequency ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

static int by_id(const void *pa, const void *pb) {
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    return (a > b) - (a < b);
}

static float vector_value(const tl_tensor *t, int64_t i) {
    switch (t->dtype) {
    case TL_DTYPE_F16: return tl_f16_to_f32(((const uint16_t *)t->data)[i]);
    case TL_DTYPE_BF16: return tl_bf16_to_f32(((const uint16_t *)t->data)[i]);
    default: return ((const float *)t->data)[i];
    }
}

/* Bytes of one row in each plane of the file's layout: values / codes, scales, mins. */
static void row_plane_bytes(const tl_tensor *t, size_t bytes[3]) {
    const size_t groups = t->group > 0 ? (size_t)t->cols / (size_t)t->group : 0;
    bytes[0] = (size_t)tl_dtype_values_bytes(t->dtype, (uint64_t)t->cols);
    bytes[1] = t->scales ? 2 * groups : 0;
    bytes[2] = t->mins ? 2 * groups : 0;
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Fills ids with the n most frequent tokens, ascending. */
static tl_status pick_tokens(const tl_tensor *frequency, int32_t vocab, int32_t n, int32_t *ids) {
    ranked_token *rank = malloc((size_t)vocab * sizeof *rank);
    if (!rank) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot rank %d tokens for the draft vocabulary", vocab);
    for (int32_t v = 0; v < vocab; v++) rank[v] = (ranked_token){ vector_value(frequency, v), v };
    qsort(rank, (size_t)vocab, sizeof *rank, by_frequency_then_id);
    for (int32_t i = 0; i < n; i++) ids[i] = rank[i].id;
    free(rank);
    /* ascending ids: the rows are read in file order, and the first of equal logits is
     * the lowest id, as in a whole-vocabulary argmax */
    qsort(ids, (size_t)n, sizeof *ids, by_id);
    return TL_OK;
}

tl_status tl_draft_vocab_check_frequency(const tl_tensor *frequency, const char *path) {
    for (int64_t v = 0; v < frequency->cols; v++) {
        float f = vector_value(frequency, v);
        if (!isfinite(f) || f < 0.0f)
            return tl_fail(TL_ERR_FORMAT, "%s: tensor vocab.frequency: token %lld has frequency %g "
                           "(must be finite and >= 0)", path, (long long)v, (double)f);
    }
    return TL_OK;
}

tl_status tl_draft_vocab_build(const tl_tensor *output, const tl_tensor *frequency, int32_t n,
                               tl_draft_vocab *out) {
    memset(out, 0, sizeof *out);
    const int32_t vocab = (int32_t)output->rows;
    if (n <= 0 || n >= vocab) return TL_OK;
    size_t row[3];
    row_plane_bytes(output, row);
    size_t ids_bytes = align64((size_t)n * sizeof(int32_t)), plane[3], total = ids_bytes;
    for (int p = 0; p < 3; p++) total += plane[p] = align64((size_t)n * row[p]);
    unsigned char *mem = aligned_alloc(64, total);
    if (!mem)
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate the draft vocabulary's head (%d rows, %zu bytes)",
                       n, total);
    int32_t *ids = (int32_t *)(void *)mem;
    tl_status st = pick_tokens(frequency, vocab, n, ids);
    if (st != TL_OK) {
        free(mem);
        return st;
    }
    const unsigned char *src[3] = { output->data, (const unsigned char *)output->scales,
                                    (const unsigned char *)output->mins };
    unsigned char *dst[3], *at = mem + ids_bytes;
    for (int p = 0; p < 3; p++) {
        dst[p] = row[p] ? at : NULL;
        at += plane[p];
    }
    for (int32_t i = 0; i < n; i++)
        for (int p = 0; p < 3; p++)
            if (row[p]) memcpy(dst[p] + (size_t)i * row[p], src[p] + (size_t)ids[i] * row[p], row[p]);
    out->n = n;
    out->ids = ids;
    out->memory = mem;
    out->head = *output;
    out->head.name = "draft vocabulary head";
    out->head.rows = out->head.shape[0] = n;
    out->head.data = dst[0];
    out->head.scales = (const uint16_t *)(void *)dst[1];
    out->head.mins = (const uint16_t *)(void *)dst[2];
    out->head.nbytes = (uint64_t)n * (row[0] + row[1] + row[2]);
    out->head.crc32 = 0;
    out->head.backend_data = NULL;
    out->head_bytes = out->head.nbytes;
    return TL_OK;
}

void tl_draft_vocab_free(tl_draft_vocab *dv) {
    free(dv->memory);
    memset(dv, 0, sizeof *dv);
}

void tl_draft_vocab_scatter(const tl_draft_vocab *dv, float *logits, int32_t vocab) {
    /* backwards: ids[j] >= j, so each value moves up to a slot already read */
    int32_t j = dv->n - 1;
    for (int32_t v = vocab - 1; v >= 0; v--) {
        if (j >= 0 && dv->ids[j] == v) logits[v] = logits[j--];
        else logits[v] = -INFINITY;
    }
}
