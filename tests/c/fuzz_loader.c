/* fuzz_loader — opens thousands of mutated copies of a valid model file through
 * tl_file_open_memory + tl_model_from_file. Every case must come back cleanly: TL_OK,
 * or an error with a non-empty message; crashes, leaks and undefined behaviour are
 * caught by AddressSanitizer + UBSan.
 *
 * Mutations: random byte flips anywhere, truncations, and hostile edits of header,
 * metadata and directory fields with every CRC recomputed afterwards, so the deep
 * validation runs rather than stopping at a checksum.
 *
 * usage: fuzz_loader MODEL.tinyloop [CASES=5000] [SEED=1] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "file_edit.h"
#include "model/format.h"
#include "model/model.h"

static uint64_t rng_state;

static uint64_t next_u64(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t below(uint64_t n) { return n ? next_u64() % n : 0; }

/* Values that tend to hit edges: zero, one, boundaries, near the old value, random. */
static uint64_t interesting(uint64_t old)
{
    switch (below(12)) {
    case 0: return 0;
    case 1: return 1;
    case 2: return old + 1;
    case 3: return old - 1;
    case 4: return old * 2;
    case 5: return old / 2;
    case 6: return UINT32_MAX;
    case 7: return (uint64_t)INT32_MAX + 1;
    case 8: return UINT64_MAX;
    case 9: return UINT64_MAX - old;
    case 10: return old + 64 * (1 + below(4));
    default: return next_u64() >> below(64);
    }
}

static void mutate_u32(uint8_t *p) { put32(p, (uint32_t)interesting(get32(p))); }
static void mutate_u64(uint8_t *p) { put64(p, interesting(get64(p))); }

typedef struct fuzz_input {
    const uint8_t *good;
    size_t size;
    dir_entry_pos dir[4096];
    uint32_t n_dir;
    meta_entry_pos meta[256];
    uint32_t n_meta;
} fuzz_input;

enum { M_FLIP, M_TRUNCATE, M_HEADER, M_DIRECTORY, M_METADATA, M_SECTION_BYTES, M_DATA, M_GROW, M_KINDS };
static const char *const kind_names[M_KINDS] = {"flip", "truncate", "header", "directory",
                                                "metadata", "section-bytes", "data", "grow"};

static void mutate_header(uint8_t *b)
{
    /* header fields before the CRCs, each 4 or 8 bytes */
    static const struct { int offset, width; } fields[] = {
        {H_VERSION, 4}, {H_HEADER_SIZE, 4}, {H_FILE_SIZE, 8}, {H_META_OFFSET, 8}, {H_META_SIZE, 8},
        {H_DIR_OFFSET, 8}, {H_DIR_SIZE, 8}, {H_DATA_OFFSET, 8}, {H_DATA_SIZE, 8}, {H_N_META, 4},
        {H_N_TENSORS, 4}};
    int n_fields = (int)(sizeof fields / sizeof fields[0]);
    int pick = (int)below((uint64_t)n_fields + 12);
    if (pick < n_fields) {
        if (fields[pick].width == 4)
            mutate_u32(b + fields[pick].offset);
        else
            mutate_u64(b + fields[pick].offset);
    } else {
        mutate_u32(b + H_DIMS + 4 * (pick - n_fields)); /* one of the 12 dims */
    }
}

static void mutate_directory(uint8_t *b, const fuzz_input *in)
{
    if (in->n_dir == 0)
        return;
    const dir_entry_pos *e = &in->dir[below(in->n_dir)];
    switch (below(9)) {
    case 0: mutate_u32(b + e->name_len); break;
    case 1: put32(b + e->dtype, (uint32_t)below(8)); break;
    case 2: put32(b + e->ndim, (uint32_t)below(6)); break;
    case 3: put32(b + e->group, (uint32_t)(below(2) ? 16u << below(5) : interesting(get32(b + e->group)))); break;
    case 4: mutate_u64(b + e->shape + 8 * below(e->n_dim)); break;
    case 5: mutate_u64(b + e->offset); break;
    case 6: mutate_u64(b + e->size); break;
    case 7: b[e->name + below(e->n_name)] = (uint8_t)below(256); break;
    default: /* swap a shape with another entry's: shape mismatch, sizes inconsistent */
        put64(b + e->shape, get64(in->good + in->dir[below(in->n_dir)].shape));
        break;
    }
}

static void mutate_metadata(uint8_t *b, const fuzz_input *in)
{
    if (in->n_meta == 0)
        return;
    const meta_entry_pos *e = &in->meta[below(in->n_meta)];
    switch (below(5)) {
    case 0: mutate_u32(b + e->key_len); break;
    case 1: put32(b + e->type, (uint32_t)below(5)); break;
    case 2: mutate_u64(b + e->value); break; /* int, float bits or string length */
    case 3: b[e->key + below(e->n_key)] = (uint8_t)below(256); break;
    default:
        if (e->kind == TL_META_STRING && get64(in->good + e->value) > 0)
            b[e->value + 8 + below(get64(in->good + e->value))] = (uint8_t)below(256);
        else
            put64(b + e->value, next_u64());
        break;
    }
}

/* Builds one mutated case in *out (a fresh exact-size buffer); returns its size. */
static size_t make_case(const fuzz_input *in, int kind, uint8_t **out, int *verify)
{
    size_t size = in->size;
    if (kind == M_TRUNCATE)
        size = below(4) == 0 ? below(TL_FILE_HEADER_SIZE + 1) : below(in->size);
    if (kind == M_GROW)
        size = in->size + 64 * (1 + below(4));
    uint8_t *b = alloc_aligned(size);
    memcpy(b, in->good, size < in->size ? size : in->size);
    if (size > in->size)
        memset(b + in->size, 0, size - in->size);
    *verify = (int)below(2);
    uint64_t data_offset = get64(in->good + H_DATA_OFFSET);
    switch (kind) {
    case M_FLIP:
        for (uint64_t k = 1 + below(8); k > 0; k--)
            b[below(size)] ^= (uint8_t)(1u << below(8));
        break;
    case M_HEADER:
        for (uint64_t k = 1 + below(2); k > 0; k--)
            mutate_header(b);
        reseal_all(b, in->good);
        break;
    case M_DIRECTORY:
        for (uint64_t k = 1 + below(3); k > 0; k--)
            mutate_directory(b, in);
        reseal_all(b, in->good);
        break;
    case M_METADATA:
        mutate_metadata(b, in);
        reseal_all(b, in->good);
        break;
    case M_SECTION_BYTES: { /* random bytes inside metadata + directory, CRCs fixed up */
        uint64_t lo = TL_FILE_HEADER_SIZE, hi = get64(in->good + H_DIR_OFFSET) + get64(in->good + H_DIR_SIZE);
        for (uint64_t k = 1 + below(4); k > 0; k--)
            b[lo + below(hi - lo)] = (uint8_t)next_u64();
        reseal_all(b, in->good);
        break;
    }
    case M_DATA:
        if (size > data_offset)
            b[data_offset + below(size - data_offset)] ^= 0x01;
        *verify = 1;
        break;
    case M_GROW: /* a longer data section is valid when the header says so */
        put64(b + H_FILE_SIZE, size);
        put64(b + H_DATA_SIZE, size - data_offset);
        reseal_all(b, in->good);
        break;
    default:
        break; /* M_TRUNCATE: the shorter copy is the mutation */
    }
    *out = b;
    return size;
}

/* Reads the first and last byte of every view, so ASan flags any view that points
 * outside the buffer. */
static unsigned touch_views(const tl_file *f)
{
    unsigned sum = 0;
    for (uint32_t i = 0; i < f->n_tensors; i++) {
        const uint8_t *p = f->tensors[i].data;
        sum += p[0] + p[f->tensors[i].nbytes - 1];
        if (f->tensors[i].scales)
            sum += (unsigned)f->tensors[i].scales[0];
    }
    return sum;
}

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 4) {
        fprintf(stderr, "usage: %s MODEL.tinyloop [CASES=5000] [SEED=1]\n", argv[0]);
        return 2;
    }
    long cases = argc > 2 ? strtol(argv[2], NULL, 10) : 5000;
    rng_state = argc > 3 ? strtoull(argv[3], NULL, 10) : 1;
    static fuzz_input in;
    uint8_t *good = load_file(argv[1], &in.size);
    in.good = good;
    in.n_dir = walk_directory(good, in.dir, 4096);
    in.n_meta = walk_metadata(good, in.meta, 256);

    /* the unmutated file must load, or the mutations prove nothing */
    tl_load_options opts;
    tl_load_options_default(&opts);
    tl_file *f = NULL;
    tl_model *m = NULL;
    if (tl_file_open_memory(good, in.size, 1, &f) != TL_OK || tl_model_from_file(f, &opts, &m) != TL_OK) {
        fprintf(stderr, "fuzz_loader: %s does not load: %s\n", argv[1], tl_error_message());
        return 1;
    }
    tl_model_destroy(m);

    long failed = 0, loaded = 0, per_kind_ok[M_KINDS] = {0}, per_kind[M_KINDS] = {0};
    long per_status[TL_ERR_INTERNAL + 1] = {0};
    unsigned sink = 0;
    for (long i = 0; i < cases; i++) {
        int kind = (int)below(M_KINDS), verify;
        uint8_t *buf;
        size_t size = make_case(&in, kind, &buf, &verify);
        tl_clear_error();
        f = NULL;
        m = NULL;
        tl_status st = tl_file_open_memory(buf, size, verify, &f);
        if (st == TL_OK) {
            sink += touch_views(f);
            st = tl_model_from_file(f, &opts, &m);
            if (st == TL_OK)
                tl_model_destroy(m);
            else
                tl_file_close(f);
        }
        per_kind[kind]++;
        if (st == TL_OK) {
            loaded++;
            per_kind_ok[kind]++;
        } else if (tl_error_message()[0] == '\0' || st < 0 || st > TL_ERR_INTERNAL) {
            failed++;
            fprintf(stderr, "case %ld (%s): status %d without a message\n", i, kind_names[kind], st);
        }
        if (st >= 0 && st <= TL_ERR_INTERNAL)
            per_status[st]++;
        free(buf);
    }
    free(good);
    printf("fuzz_loader: %ld cases, %ld loaded, %ld format errors, %ld other errors (view checksum %u)\n",
           cases, loaded, per_status[TL_ERR_FORMAT], cases - loaded - per_status[TL_ERR_FORMAT], sink);
    for (int k = 0; k < M_KINDS; k++)
        printf("  %-14s %6ld cases, %6ld loaded\n", kind_names[k], per_kind[k], per_kind_ok[k]);
    printf("fuzz_loader: %ld passed, %ld failed\n", cases - failed, failed);
    return failed ? 1 : 0;
}
