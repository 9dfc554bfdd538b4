/* format.c — mmap reader of the .tinyloop file (docs/format.md).
 *
 * Every field is read through bounds-checked cursors with byte-wise little-endian
 * decoding (no unaligned loads), every sum of untrusted values is overflow-checked,
 * and each failure names the path, the field or tensor, and expected vs found. */
#define _GNU_SOURCE
#include "model/format.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/utf8.h"

#define MEMORY_PATH "<memory>"

/* Smallest possible entries, used to bound counts before allocating. */
#define MIN_META_ENTRY (4u + 1u + 4u + 8u)
#define MIN_DIR_ENTRY (4u + 1u + 12u + 8u + 8u + 8u + 4u)

/* ------------------------------------------------------------------ CRC-32 */

/* Slicing-by-8 tables for the reflected polynomial 0xEDB88320 (zlib's CRC-32). */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1u) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xffu];
}

uint32_t tl_crc32(const void *data, size_t len)
{
    pthread_once(&crc_once, crc_init);
    const uint8_t *p = data;
    uint32_t c = 0xFFFFFFFFu;
    while (len >= 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        c = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^ crc_table[5][(lo >> 16) & 0xff] ^
            crc_table[4][lo >> 24] ^ crc_table[3][p[4]] ^ crc_table[2][p[5]] ^ crc_table[1][p[6]] ^
            crc_table[0][p[7]];
        p += 8;
        len -= 8;
    }
    while (len--)
        c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xffu];
    return c ^ 0xFFFFFFFFu;
}

/* ------------------------------------------------------------------ decoding */

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p)
{
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

/* A bounds-checked reader over [pos, end) of the mapping. */
typedef struct cursor {
    const uint8_t *base;
    uint64_t pos, end;
    const char *path, *section;
} cursor;

static tl_status take(cursor *c, uint64_t n, const char *what, const uint8_t **out)
{
    if (n > c->end - c->pos)
        return tl_fail(TL_ERR_FORMAT,
                       "%s: %s: %s needs %llu bytes at offset %llu, only %llu left in the section",
                       c->path, c->section, what, (unsigned long long)n,
                       (unsigned long long)c->pos, (unsigned long long)(c->end - c->pos));
    *out = c->base + c->pos;
    c->pos += n;
    return TL_OK;
}

static tl_status take_u32(cursor *c, const char *what, uint32_t *v)
{
    const uint8_t *p = NULL;
    tl_status st = take(c, 4, what, &p);
    if (st == TL_OK)
        *v = le32(p);
    return st;
}

static tl_status take_u64(cursor *c, const char *what, uint64_t *v)
{
    const uint8_t *p = NULL;
    tl_status st = take(c, 8, what, &p);
    if (st == TL_OK)
        *v = le64(p);
    return st;
}

static int is_utf8(const uint8_t *s, uint64_t n)
{
    for (uint64_t i = 0; i < n;) {
        uint32_t cp;
        size_t len = tl_utf8_decode(s + i, (size_t)(n - i), &cp);
        if (len == 0)
            return 0;
        i += len;
    }
    return 1;
}

static int is_printable_ascii(const uint8_t *s, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] > 0x7E)
            return 0;
    return 1;
}

static uint64_t align64(uint64_t v)
{
    return (v + (TL_FILE_ALIGN - 1)) & ~(uint64_t)(TL_FILE_ALIGN - 1);
}


/* ------------------------------------------------------------------ header */

static tl_status check_header(tl_file *f, const uint8_t *h)
{
    const char *path = f->path;
    if (memcmp(h, TL_FILE_MAGIC, 8) != 0) {
        char shown[9];
        for (int i = 0; i < 8; i++)
            shown[i] = (h[i] >= 0x20 && h[i] <= 0x7E) ? (char)h[i] : '?';
        shown[8] = '\0';
        return tl_fail(TL_ERR_FORMAT, "%s: bad magic: expected \"TINYLOOP\", got \"%s\" (not a .tinyloop file?)",
                       path, shown);
    }
    f->version = le32(h + 8);
    if (f->version != TL_FILE_VERSION)
        return tl_fail(TL_ERR_FORMAT, "%s: unsupported version: expected %u, got %u", path,
                       TL_FILE_VERSION, f->version);
    if (le32(h + 12) != TL_FILE_HEADER_SIZE)
        return tl_fail(TL_ERR_FORMAT, "%s: header_size: expected %u, got %u", path,
                       TL_FILE_HEADER_SIZE, le32(h + 12));
    uint32_t stored = le32(h + 252), computed = tl_crc32(h, 252);
    if (stored != computed)
        return tl_fail(TL_ERR_FORMAT, "%s: header CRC-32 mismatch: stored 0x%08x, computed 0x%08x",
                       path, stored, computed);
    for (int i = 136; i < 252; i++)
        if (h[i] != 0)
            return tl_fail(TL_ERR_FORMAT, "%s: reserved header byte %d must be zero, got 0x%02x",
                           path, i, h[i]);
    return TL_OK;
}

/* Section bounds in the fixed order; each value is checked before the next uses it. */
static tl_status check_sections(tl_file *f, const uint8_t *h)
{
    const char *path = f->path;
    const uint64_t size = f->size;
    uint64_t file_size = le64(h + 16), meta_off = le64(h + 24), meta_size = le64(h + 32);
    uint64_t dir_off = le64(h + 40), dir_size = le64(h + 48);
    uint64_t data_off = le64(h + 56), data_size = le64(h + 64);
    if (file_size != size)
        return tl_fail(TL_ERR_FORMAT, "%s: file_size field says %llu bytes, the file has %llu (truncated or padded?)",
                       path, (unsigned long long)file_size, (unsigned long long)size);
    if (meta_off != TL_FILE_HEADER_SIZE)
        return tl_fail(TL_ERR_FORMAT, "%s: meta_offset: expected %u, got %llu", path,
                       TL_FILE_HEADER_SIZE, (unsigned long long)meta_off);
    if (meta_size > size - meta_off)
        return tl_fail(TL_ERR_FORMAT, "%s: meta_size %llu runs past the end of the %llu-byte file",
                       path, (unsigned long long)meta_size, (unsigned long long)size);
    if (dir_off != meta_off + meta_size)
        return tl_fail(TL_ERR_FORMAT, "%s: dir_offset: expected %llu (right after metadata), got %llu",
                       path, (unsigned long long)(meta_off + meta_size), (unsigned long long)dir_off);
    if (dir_size > size - dir_off)
        return tl_fail(TL_ERR_FORMAT, "%s: dir_size %llu runs past the end of the %llu-byte file",
                       path, (unsigned long long)dir_size, (unsigned long long)size);
    uint64_t want_data = align64(dir_off + dir_size); /* both < size, cannot overflow */
    if (data_off != want_data)
        return tl_fail(TL_ERR_FORMAT, "%s: data_offset: expected %llu (directory end aligned to 64), got %llu",
                       path, (unsigned long long)want_data, (unsigned long long)data_off);
    if (data_off > size || data_size != size - data_off)
        return tl_fail(TL_ERR_FORMAT, "%s: data_size: expected %llu (to the end of the file), got %llu",
                       path, (unsigned long long)(data_off > size ? 0 : size - data_off),
                       (unsigned long long)data_size);
    uint32_t meta_crc = tl_crc32(f->map + meta_off, (size_t)meta_size);
    if (meta_crc != le32(h + 128))
        return tl_fail(TL_ERR_FORMAT, "%s: metadata CRC-32 mismatch: stored 0x%08x, computed 0x%08x",
                       path, le32(h + 128), meta_crc);
    uint32_t dir_crc = tl_crc32(f->map + dir_off, (size_t)dir_size);
    if (dir_crc != le32(h + 132))
        return tl_fail(TL_ERR_FORMAT, "%s: directory CRC-32 mismatch: stored 0x%08x, computed 0x%08x",
                       path, le32(h + 132), dir_crc);
    f->data_offset = data_off;
    f->data_size = data_size;
    return TL_OK;
}

static tl_status check_dims(tl_file *f, const uint8_t *h)
{
    tl_file_dims *d = &f->dims;
    uint32_t *fields[12] = {&d->vocab_size, &d->d_model, &d->n_head, &d->n_kv_head,
                            &d->head_dim, &d->ffn_dim, &d->n_pre, &d->n_core, &d->n_post,
                            &d->default_depth, &d->max_depth, &d->max_seq_len};
    static const char *const names[12] = {"vocab_size", "d_model", "n_head", "n_kv_head",
                                          "head_dim", "ffn_dim", "n_pre", "n_core", "n_post",
                                          "default_depth", "max_depth", "max_seq_len"};
    static const int nonzero[12] = {1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1};
    for (int i = 0; i < 12; i++) {
        *fields[i] = le32(h + 80 + 4 * i);
        if (nonzero[i] && *fields[i] == 0)
            return tl_fail(TL_ERR_FORMAT, "%s: header %s must be > 0, got 0", f->path, names[i]);
    }
    if (d->n_head % d->n_kv_head != 0)
        return tl_fail(TL_ERR_FORMAT, "%s: header n_head (%u) must be a multiple of n_kv_head (%u)",
                       f->path, d->n_head, d->n_kv_head);
    if (d->default_depth > d->max_depth)
        return tl_fail(TL_ERR_FORMAT, "%s: header default_depth (%u) must be <= max_depth (%u)",
                       f->path, d->default_depth, d->max_depth);
    if (d->n_core > 0 && d->max_depth == 0)
        return tl_fail(TL_ERR_FORMAT, "%s: header max_depth must be >= 1 when n_core > 0 (n_core %u), got 0",
                       f->path, d->n_core);
    return TL_OK;
}

/* ------------------------------------------------------------------ metadata */

static int compare_meta(const void *a, const void *b)
{
    return strcmp(((const tl_meta_entry *)a)->key, ((const tl_meta_entry *)b)->key);
}

static tl_status parse_meta(tl_file *f, const uint8_t *h)
{
    cursor c = {f->map, TL_FILE_HEADER_SIZE, TL_FILE_HEADER_SIZE + le64(h + 32), f->path, "metadata"};
    uint32_t n = le32(h + 72);
    if (n > (c.end - c.pos) / MIN_META_ENTRY)
        return tl_fail(TL_ERR_FORMAT, "%s: n_meta %u cannot fit in a %llu-byte metadata section",
                       f->path, n, (unsigned long long)(c.end - c.pos));
    f->meta = calloc(n ? n : 1, sizeof *f->meta);
    if (!f->meta)
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "%s: out of memory for %u metadata entries", f->path, n);
    tl_status st;
    for (uint32_t i = 0; i < n; i++) {
        tl_meta_entry *e = &f->meta[i];
        uint32_t key_len, type;
        const uint8_t *key = NULL;
        if ((st = take_u32(&c, "key length", &key_len)) != TL_OK)
            return st;
        if ((st = take(&c, key_len, "key", &key)) != TL_OK)
            return st;
        if (key_len == 0 || memchr(key, 0, key_len) || !is_utf8(key, key_len))
            return tl_fail(TL_ERR_FORMAT, "%s: metadata entry %u: key must be non-empty UTF-8 without NUL",
                           f->path, i);
        e->key = strndup((const char *)key, key_len);
        if (!e->key)
            return tl_fail(TL_ERR_OUT_OF_MEMORY, "%s: out of memory for metadata keys", f->path);
        f->n_meta = i + 1; /* keys so far are valid strings for messages and cleanup */
        if ((st = take_u32(&c, "type", &type)) != TL_OK)
            return st;
        e->type = (tl_meta_type)type;
        if (type == TL_META_INT) {
            uint64_t v;
            if ((st = take_u64(&c, "int value", &v)) != TL_OK)
                return st;
            memcpy(&e->i, &v, sizeof v);
        } else if (type == TL_META_FLOAT) {
            uint64_t v;
            if ((st = take_u64(&c, "float value", &v)) != TL_OK)
                return st;
            memcpy(&e->f, &v, sizeof v);
        } else if (type == TL_META_STRING) {
            const uint8_t *s = NULL;
            if ((st = take_u64(&c, "string length", &e->s_len)) != TL_OK)
                return st;
            if ((st = take(&c, e->s_len, "string value", &s)) != TL_OK)
                return st;
            if (memchr(s, 0, e->s_len) || !is_utf8(s, e->s_len))
                return tl_fail(TL_ERR_FORMAT, "%s: metadata %s: string must be UTF-8 without NUL",
                               f->path, e->key);
            e->s = (const char *)s;
        } else {
            return tl_fail(TL_ERR_FORMAT, "%s: metadata %s: unknown type %u, expected 1 (int), 2 (float) or 3 (string)",
                           f->path, e->key, type);
        }
    }
    if (c.pos != c.end)
        return tl_fail(TL_ERR_FORMAT, "%s: metadata: %llu bytes left after %u entries", f->path,
                       (unsigned long long)(c.end - c.pos), n);
    qsort(f->meta, n, sizeof *f->meta, compare_meta);
    for (uint32_t i = 1; i < n; i++)
        if (strcmp(f->meta[i - 1].key, f->meta[i].key) == 0)
            return tl_fail(TL_ERR_FORMAT, "%s: metadata key %s appears twice", f->path, f->meta[i].key);
    return TL_OK;
}

/* ------------------------------------------------------------------ tensor directory */

static int compare_tensor_name(const void *a, const void *b)
{
    return strcmp(((const tl_tensor *)a)->name, ((const tl_tensor *)b)->name);
}

static int compare_tensor_data(const void *a, const void *b)
{
    const uint8_t *x = ((const tl_tensor *)a)->data, *y = ((const tl_tensor *)b)->data;
    return (x > y) - (x < y);
}

/* Why a shape/dtype/group combination has no valid byte size. */
static const char *shape_problem(const tl_tensor *t, uint32_t group)
{
    if (!tl_dtype_is_quantized(t->dtype))
        return group != 0 ? "group_size must be 0 for f32/f16/bf16" : "too many elements";
    if (t->ndim != 2)
        return "quantized tensors must be 2-D";
    if (group != 32 && group != 64 && group != 128)
        return "group_size must be 32, 64 or 128";
    if (t->cols % group != 0)
        return "cols must be a multiple of group_size";
    return "too many elements";
}

/* Decodes one directory entry into t (name already set) and checks it. */
static tl_status parse_tensor(tl_file *f, cursor *c, tl_tensor *t)
{
    const char *path = f->path, *name = t->name;
    uint32_t dtype, ndim, group;
    tl_status st;
    if ((st = take_u32(c, "dtype", &dtype)) != TL_OK || (st = take_u32(c, "ndim", &ndim)) != TL_OK ||
        (st = take_u32(c, "group_size", &group)) != TL_OK)
        return st;
    if (dtype >= TL_DTYPE_COUNT)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: unknown dtype code %u, expected 0..%d", path,
                       name, dtype, TL_DTYPE_COUNT - 1);
    if (ndim < 1 || ndim > 4)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: ndim must be 1..4, got %u", path, name, ndim);
    t->dtype = (tl_dtype)dtype;
    t->ndim = (int32_t)ndim;
    t->rows = 1;
    for (uint32_t k = 0; k < ndim; k++) {
        uint64_t dim;
        if ((st = take_u64(c, "shape", &dim)) != TL_OK)
            return st;
        if (dim == 0 || dim > (UINT64_C(1) << 40))
            return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: shape[%u] must be in 1..2^40, got %llu",
                           path, name, k, (unsigned long long)dim);
        t->shape[k] = (int64_t)dim;
        if (k + 1 < ndim && __builtin_mul_overflow(t->rows, t->shape[k], &t->rows))
            return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: shape overflows 64 bits", path, name);
    }
    t->cols = t->shape[ndim - 1];
    uint64_t offset, size;
    const uint8_t *crc = NULL;
    if ((st = take_u64(c, "offset", &offset)) != TL_OK || (st = take_u64(c, "size", &size)) != TL_OK ||
        (st = take(c, 4, "crc32", &crc)) != TL_OK)
        return st;
    t->crc32 = le32(crc);
    uint64_t want = 0;
    if (group <= 128 && (ndim == 2 || !tl_dtype_is_quantized(t->dtype)))
        want = tl_dtype_nbytes(t->dtype, t->rows, t->cols, (int32_t)group);
    if (want == 0)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: %s (dtype %s, ndim %u, cols %lld, group_size %u)",
                       path, name, shape_problem(t, group), tl_dtype_name(t->dtype), ndim,
                       (long long)t->cols, group);
    if (size != want)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: size: expected %llu bytes for %s [%lld x %lld] group %u, got %llu",
                       path, name, (unsigned long long)want, tl_dtype_name(t->dtype),
                       (long long)t->rows, (long long)t->cols, group, (unsigned long long)size);
    if (offset % TL_FILE_ALIGN != 0)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: offset %llu is not a multiple of %u", path,
                       name, (unsigned long long)offset, TL_FILE_ALIGN);
    if (offset > f->data_size || size > f->data_size - offset)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: %llu bytes at offset %llu lie outside the data section of %llu bytes",
                       path, name, (unsigned long long)size, (unsigned long long)offset,
                       (unsigned long long)f->data_size);
    /* plane layout: qs, then scales (f16 per group), then mins (q4/q2) */
    const uint8_t *data = f->map + f->data_offset + offset;
    t->group = (int32_t)group;
    t->data = data;
    t->nbytes = size;
    if (tl_dtype_is_quantized(t->dtype)) {
        uint64_t n = (uint64_t)t->rows * (uint64_t)t->cols;
        t->scales = (const uint16_t *)(const void *)(data + tl_dtype_values_bytes(t->dtype, n));
        t->mins = t->dtype == TL_DTYPE_Q8 ? NULL : t->scales + n / (uint64_t)group;
    }
    return TL_OK;
}

static tl_status parse_directory(tl_file *f, const uint8_t *h)
{
    uint64_t dir_off = le64(h + 40);
    cursor c = {f->map, dir_off, dir_off + le64(h + 48), f->path, "tensor directory"};
    uint32_t n = le32(h + 76);
    if (n > (c.end - c.pos) / MIN_DIR_ENTRY)
        return tl_fail(TL_ERR_FORMAT, "%s: n_tensors %u cannot fit in a %llu-byte tensor directory",
                       f->path, n, (unsigned long long)(c.end - c.pos));
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    /* names are copied into one block: their bytes plus a NUL each fit in the section size */
    f->strings = malloc((size_t)(c.end - c.pos) + n + 1);
    if (!f->tensors || !f->strings)
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "%s: out of memory for %u tensor entries", f->path, n);
    char *arena = f->strings;
    tl_status st;
    for (uint32_t i = 0; i < n; i++) {
        tl_tensor *t = &f->tensors[i];
        uint32_t name_len;
        const uint8_t *name = NULL;
        if ((st = take_u32(&c, "name length", &name_len)) != TL_OK ||
            (st = take(&c, name_len, "name", &name)) != TL_OK)
            return st;
        if (name_len == 0 || !is_printable_ascii(name, name_len))
            return tl_fail(TL_ERR_FORMAT, "%s: tensor entry %u: name must be non-empty printable ASCII",
                           f->path, i);
        memcpy(arena, name, name_len);
        arena[name_len] = '\0';
        t->name = arena;
        arena += name_len + 1;
        f->n_tensors = i + 1;
        if ((st = parse_tensor(f, &c, t)) != TL_OK)
            return st;
    }
    if (c.pos != c.end)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor directory: %llu bytes left after %u entries",
                       f->path, (unsigned long long)(c.end - c.pos), n);

    /* overlap: neighbours in data order must not intersect */
    qsort(f->tensors, n, sizeof *f->tensors, compare_tensor_data);
    for (uint32_t i = 1; i < n; i++) {
        const tl_tensor *a = &f->tensors[i - 1], *b = &f->tensors[i];
        if ((const uint8_t *)a->data + a->nbytes > (const uint8_t *)b->data)
            return tl_fail(TL_ERR_FORMAT, "%s: tensors %s and %s overlap in the data section",
                           f->path, a->name, b->name);
    }
    qsort(f->tensors, n, sizeof *f->tensors, compare_tensor_name);
    for (uint32_t i = 1; i < n; i++)
        if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0)
            return tl_fail(TL_ERR_FORMAT, "%s: tensor %s appears twice", f->path, f->tensors[i].name);
    return TL_OK;
}

static tl_status verify_tensor_checksums(const tl_file *f)
{
    for (uint32_t i = 0; i < f->n_tensors; i++) {
        const tl_tensor *t = &f->tensors[i];
        uint32_t got = tl_crc32(t->data, (size_t)t->nbytes);
        if (got != t->crc32)
            return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: CRC-32 mismatch: directory says 0x%08x, data gives 0x%08x",
                           f->path, t->name, t->crc32, got);
    }
    return TL_OK;
}

/* ------------------------------------------------------------------ open / close */

static tl_status parse(tl_file *f, int verify_checksums)
{
    if (f->size < TL_FILE_HEADER_SIZE)
        return tl_fail(TL_ERR_FORMAT, "%s: file is %llu bytes, smaller than the %u-byte header",
                       f->path, (unsigned long long)f->size, TL_FILE_HEADER_SIZE);
    const uint8_t *h = f->map;
    tl_status st;
    if ((st = check_header(f, h)) != TL_OK || (st = check_sections(f, h)) != TL_OK ||
        (st = check_dims(f, h)) != TL_OK)
        return st;
    if ((st = parse_meta(f, h)) != TL_OK || (st = parse_directory(f, h)) != TL_OK)
        return st;
    if (verify_checksums && (st = verify_tensor_checksums(f)) != TL_OK)
        return st;
    return TL_OK;
}

static tl_file *file_new(const char *path)
{
    tl_file *f = calloc(1, sizeof *f);
    if (!f)
        return NULL;
    f->path = strdup(path);
    if (!f->path) {
        free(f);
        return NULL;
    }
    return f;
}

tl_status tl_file_open(const char *path, int verify_checksums, tl_file **out)
{
    if (!path || !out)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_file_open: path and out must not be NULL");
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return tl_fail(TL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int err = errno;
        close(fd);
        return tl_fail(TL_ERR_IO, "%s: cannot stat: %s", path, strerror(err));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return tl_fail(TL_ERR_IO, "%s: not a regular file", path);
    }
    if ((uint64_t)sb.st_size < TL_FILE_HEADER_SIZE) {
        close(fd);
        return tl_fail(TL_ERR_FORMAT, "%s: file is %llu bytes, smaller than the %u-byte header",
                       path, (unsigned long long)sb.st_size, TL_FILE_HEADER_SIZE);
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_err = errno;
    close(fd); /* the mapping stays valid */
    if (map == MAP_FAILED)
        return tl_fail(TL_ERR_IO, "%s: cannot mmap %llu bytes: %s", path,
                       (unsigned long long)sb.st_size, strerror(map_err));
    tl_file *f = file_new(path);
    if (!f) {
        munmap(map, (size_t)sb.st_size);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    f->map = map;
    f->size = (uint64_t)sb.st_size;
    f->mapped = 1;
    tl_status st = parse(f, verify_checksums);
    if (st != TL_OK) {
        tl_file_close(f);
        return st;
    }
    *out = f;
    return TL_OK;
}

tl_status tl_file_open_memory(const void *data, uint64_t size, int verify_checksums, tl_file **out)
{
    if (!out || (!data && size > 0))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_file_open_memory: data and out must not be NULL");
    *out = NULL;
    if ((uintptr_t)data % TL_FILE_ALIGN != 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_file_open_memory: buffer must be %u-byte aligned",
                       TL_FILE_ALIGN);
    tl_file *f = file_new(MEMORY_PATH);
    if (!f)
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "%s: out of memory", MEMORY_PATH);
    f->map = data;
    f->size = size;
    tl_status st = parse(f, verify_checksums);
    if (st != TL_OK) {
        tl_file_close(f);
        return st;
    }
    *out = f;
    return TL_OK;
}

void tl_file_close(tl_file *file)
{
    if (!file)
        return;
    if (file->mapped && file->map)
        munmap((void *)file->map, (size_t)file->size);
    for (uint32_t i = 0; i < file->n_meta; i++)
        free(file->meta[i].key);
    free(file->meta);
    free(file->tensors);
    free(file->strings);
    free(file->path);
    free(file);
}

const tl_meta_entry *tl_file_meta(const tl_file *file, const char *key)
{
    tl_meta_entry probe = {.key = (char *)key};
    return bsearch(&probe, file->meta, file->n_meta, sizeof *file->meta, compare_meta);
}

const tl_tensor *tl_file_tensor(const tl_file *file, const char *name)
{
    tl_tensor probe = {.name = name};
    return bsearch(&probe, file->tensors, file->n_tensors, sizeof *file->tensors, compare_tensor_name);
}
