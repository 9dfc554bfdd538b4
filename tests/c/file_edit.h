/* file_edit.h — helpers for the loader tests: load a .tinyloop file into an aligned
 * buffer, locate header / metadata / directory fields, edit them and recompute the
 * CRCs so the deep validation (not only the CRC check) sees the edit. */
#ifndef TL_TEST_FILE_EDIT_H
#define TL_TEST_FILE_EDIT_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/format.h"

/* Header field offsets (docs/format.md). */
enum {
    H_VERSION = 8, H_HEADER_SIZE = 12, H_FILE_SIZE = 16, H_META_OFFSET = 24, H_META_SIZE = 32,
    H_DIR_OFFSET = 40, H_DIR_SIZE = 48, H_DATA_OFFSET = 56, H_DATA_SIZE = 64, H_N_META = 72,
    H_N_TENSORS = 76, H_DIMS = 80, H_META_CRC = 128, H_DIR_CRC = 132, H_HEADER_CRC = 252
};
/* Index of each dim in the header's dims array. */
enum { D_VOCAB, D_MODEL, D_HEAD, D_KV_HEAD, D_HEAD_DIM, D_FFN, D_PRE, D_CORE, D_POST,
       D_DEFAULT_DEPTH, D_MAX_DEPTH, D_MAX_SEQ };

static inline uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* A 64-byte aligned buffer of exactly `size` bytes, so ASan sees any over-read. */
static inline uint8_t *alloc_aligned(size_t size)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, size ? size : 1) != 0) {
        fprintf(stderr, "out of memory (%zu bytes)\n", size);
        exit(2);
    }
    return p;
}

static inline uint8_t *load_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = alloc_aligned((size_t)n);
    if (n < 0 || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "cannot read %s\n", path);
        exit(2);
    }
    fclose(f);
    *size = (size_t)n;
    return buf;
}

static inline void reseal_header(uint8_t *buf)
{
    put32(buf + H_HEADER_CRC, tl_crc32(buf, H_HEADER_CRC));
}

/* Recompute the metadata and directory CRCs from the (pristine) section bounds
 * `layout`, then the header CRC. */
static inline void reseal_all(uint8_t *buf, const uint8_t *layout)
{
    uint64_t mo = get64(layout + H_META_OFFSET), ms = get64(layout + H_META_SIZE);
    uint64_t dof = get64(layout + H_DIR_OFFSET), ds = get64(layout + H_DIR_SIZE);
    put32(buf + H_META_CRC, tl_crc32(buf + mo, ms));
    put32(buf + H_DIR_CRC, tl_crc32(buf + dof, ds));
    reseal_header(buf);
}

/* Where each field of one directory entry sits in the file. */
typedef struct dir_entry_pos {
    size_t name_len, name, dtype, ndim, group, shape, offset, size, crc;
    uint32_t n_name, n_dim;
} dir_entry_pos;

/* Walks the directory of a valid file; returns the number of entries found. */
static inline uint32_t walk_directory(const uint8_t *buf, dir_entry_pos *out, uint32_t cap)
{
    size_t p = get64(buf + H_DIR_OFFSET);
    uint32_t n = get32(buf + H_N_TENSORS);
    uint32_t i;
    for (i = 0; i < n && i < cap; i++) {
        dir_entry_pos *e = &out[i];
        e->name_len = p;
        e->n_name = get32(buf + p);
        e->name = p + 4;
        e->dtype = e->name + e->n_name;
        e->ndim = e->dtype + 4;
        e->group = e->ndim + 4;
        e->n_dim = get32(buf + e->ndim);
        e->shape = e->group + 4;
        e->offset = e->shape + 8 * (size_t)e->n_dim;
        e->size = e->offset + 8;
        e->crc = e->size + 8;
        p = e->crc + 4;
    }
    return i;
}

/* Where each field of one metadata entry sits. */
typedef struct meta_entry_pos {
    size_t key_len, key, type, value;   /* value: the i64/f64, or the u64 string length */
    uint32_t n_key, kind;
} meta_entry_pos;

static inline uint32_t walk_metadata(const uint8_t *buf, meta_entry_pos *out, uint32_t cap)
{
    size_t p = get64(buf + H_META_OFFSET);
    uint32_t n = get32(buf + H_N_META);
    uint32_t i;
    for (i = 0; i < n && i < cap; i++) {
        meta_entry_pos *e = &out[i];
        e->key_len = p;
        e->n_key = get32(buf + p);
        e->key = p + 4;
        e->type = e->key + e->n_key;
        e->kind = get32(buf + e->type);
        e->value = e->type + 4;
        p = e->value + 8 + (e->kind == TL_META_STRING ? get64(buf + e->value) : 0);
    }
    return i;
}

#endif
