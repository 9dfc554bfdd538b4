/* format.h — validating reader of the .tinyloop file (docs/format.md). The file is
 * mmapped read-only; every length and offset is checked before it is used, so a
 * corrupt or hostile file yields TL_ERR_FORMAT with a message, never a crash. */
#ifndef TL_FORMAT_H
#define TL_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#include "base/tensor.h"
#include "tinyloop/tinyloop.h"

#define TL_FILE_MAGIC "TINYLOOP"
#define TL_FILE_VERSION 1u
#define TL_FILE_HEADER_SIZE 256u
#define TL_FILE_ALIGN 64u

typedef enum { TL_META_INT = 1, TL_META_FLOAT = 2, TL_META_STRING = 3 } tl_meta_type;

typedef struct tl_meta_entry {
    char *key;                 /* NUL-terminated heap copy */
    tl_meta_type type;
    int64_t i;                 /* TL_META_INT */
    double f;                  /* TL_META_FLOAT */
    const char *s;             /* TL_META_STRING: points into the mapping, not NUL-terminated */
    uint64_t s_len;
} tl_meta_entry;

typedef struct tl_file_dims {
    uint32_t vocab_size, d_model, n_head, n_kv_head, head_dim, ffn_dim;
    uint32_t n_pre, n_core, n_post, default_depth, max_depth, max_seq_len;
} tl_file_dims;

typedef struct tl_file {
    char *path;
    const uint8_t *map;        /* whole file, read-only */
    uint64_t size;
    uint32_t version;
    tl_file_dims dims;
    tl_meta_entry *meta;
    uint32_t n_meta;
    tl_tensor *tensors;        /* views into the mapping, names are heap copies */
    uint32_t n_tensors;
    uint64_t data_offset, data_size; /* the data section */
    char *strings;             /* one allocation holding the tensor name copies */
    int mapped;                /* 1: map came from mmap and is unmapped on close */
} tl_file;

/* Open, map and validate structure (header, sections, CRCs of header/meta/dir, every
 * entry's bounds, tensor sizes/offsets/overlap). verify_checksums also checks every
 * tensor's CRC-32. */
tl_status tl_file_open(const char *path, int verify_checksums, tl_file **out);
/* Same checks on a buffer owned by the caller (used by the fuzz harness). The buffer
 * must be 64-byte aligned, as a mapping is, so tensor views are aligned, and must
 * outlive the tl_file. */
tl_status tl_file_open_memory(const void *data, uint64_t size, int verify_checksums,
                              tl_file **out);
void tl_file_close(tl_file *file);

/* Lookups; NULL when absent. Entries are kept sorted by key / name. */
const tl_meta_entry *tl_file_meta(const tl_file *file, const char *key);
const tl_tensor *tl_file_tensor(const tl_file *file, const char *name);

uint32_t tl_crc32(const void *data, size_t len);

#endif
