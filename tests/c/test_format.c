/* test_format — checks the .tinyloop reader and the model builder on valid model files
 * (given on the command line) and on hand-made corruptions of them, each of which must
 * fail with the expected status and a message naming the problem.
 *
 * usage: test_format MODEL.tinyloop [MODEL.tinyloop ...] */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/tensor.h"
#include "file_edit.h"
#include "model/format.h"
#include "model/model.h"

static int n_passed, n_failed;

static void check(int ok, const char *what, ...) __attribute__((format(printf, 2, 3)));
static void check(int ok, const char *what, ...)
{
    if (ok) {
        n_passed++;
        return;
    }
    n_failed++;
    va_list args;
    va_start(args, what);
    fprintf(stderr, "FAIL: ");
    vfprintf(stderr, what, args);
    fprintf(stderr, "\n");
    va_end(args);
}

/* Opens buf as a file and builds the model; returns the first failing status. */
static tl_status load(const uint8_t *buf, size_t size, int verify)
{
    tl_file *file = NULL;
    tl_status st = tl_file_open_memory(buf, size, verify, &file);
    if (st != TL_OK)
        return st;
    tl_load_options opts;
    tl_load_options_default(&opts);
    tl_model *model = NULL;
    st = tl_model_from_file(file, &opts, &model);
    if (st != TL_OK) {
        tl_file_close(file);
        return st;
    }
    tl_model_destroy(model);
    return TL_OK;
}

/* Loads an edited copy and checks status and message substring. */
static void expect(const char *label, const uint8_t *buf, size_t size, int verify,
                   tl_status want, const char *substring)
{
    tl_clear_error();
    tl_status st = load(buf, size, verify);
    const char *msg = tl_error_message();
    check(st == want && (want == TL_OK || strstr(msg, substring) != NULL),
          "%s: expected status %d with \"%s\", got %d: %s", label, want, substring ? substring : "",
          st, msg);
}

/* ------------------------------------------------------------------ valid file */

static void check_tensor_view(const tl_file *f, const tl_tensor *t)
{
    const uint8_t *data = t->data;
    const uint8_t *lo = f->map + f->data_offset, *hi = f->map + f->size;
    check(data >= lo && data + t->nbytes <= hi, "%s: view outside the data section", t->name);
    check((uintptr_t)data % 64 == 0, "%s: data not 64-byte aligned", t->name);
    int64_t outer = 1;
    for (int k = 0; k + 1 < t->ndim; k++)
        outer *= t->shape[k];
    check(t->rows == outer && t->cols == t->shape[t->ndim - 1], "%s: 2-D view %lld x %lld",
          t->name, (long long)t->rows, (long long)t->cols);
    check(t->nbytes == tl_dtype_nbytes(t->dtype, t->rows, t->cols, t->group),
          "%s: nbytes %llu", t->name, (unsigned long long)t->nbytes);
    if (tl_dtype_is_quantized(t->dtype)) {
        uint64_t n = (uint64_t)(t->rows * t->cols), groups = n / (uint64_t)t->group;
        uint64_t qs = t->dtype == TL_DTYPE_Q8 ? n : t->dtype == TL_DTYPE_Q4 ? n / 2 : n / 4;
        check((const uint8_t *)t->scales == data + qs, "%s: scales plane offset", t->name);
        if (t->dtype == TL_DTYPE_Q8)
            check(t->mins == NULL, "%s: q8 has no mins", t->name);
        else
            check(t->mins == t->scales + groups && (const uint8_t *)(t->mins + groups) == data + t->nbytes,
                  "%s: mins plane offset", t->name);
    } else {
        check(t->scales == NULL && t->mins == NULL && t->group == 0, "%s: float tensor has quant planes",
              t->name);
    }
}

static void check_valid_file(const char *path)
{
    tl_file *f = NULL;
    tl_status st = tl_file_open(path, 1, &f);
    check(st == TL_OK, "%s: open with checksums: %s", path, tl_error_message());
    if (st != TL_OK)
        return;
    check(f->version == 1 && f->dims.vocab_size > 0 && f->dims.d_model > 0, "%s: dims", path);
    check(f->data_offset % 64 == 0, "%s: data_offset aligned", path);
    for (uint32_t i = 0; i < f->n_tensors; i++) {
        check_tensor_view(f, &f->tensors[i]);
        check(tl_file_tensor(f, f->tensors[i].name) == &f->tensors[i], "lookup %s", f->tensors[i].name);
    }
    const tl_tensor *embed = tl_file_tensor(f, "embed.weight");
    check(embed && embed->ndim == 2 && embed->shape[0] == f->dims.vocab_size &&
              embed->shape[1] == f->dims.d_model, "%s: embed.weight is [V, d]", path);
    check(tl_file_tensor(f, "no.such.tensor") == NULL, "lookup of a missing tensor is NULL");
    check(tl_file_meta(f, "no.such.key") == NULL, "lookup of a missing key is NULL");
    const tl_meta_entry *name = tl_file_meta(f, "general.name");
    if (name)
        check(name->type == TL_META_STRING && name->s_len > 0, "general.name is a string");

    tl_load_options opts;
    tl_load_options_default(&opts);
    tl_model *m = NULL;
    st = tl_model_from_file(f, &opts, &m);
    check(st == TL_OK, "%s: model: %s", path, tl_error_message());
    if (st != TL_OK) {
        tl_file_close(f);
        return;
    }
    const tl_hparams *hp = &m->hp;
    check(hp->vocab == (int32_t)f->dims.vocab_size && hp->d == (int32_t)f->dims.d_model &&
              hp->n_core == (int32_t)f->dims.n_core && hp->max_depth == (int32_t)f->dims.max_depth,
          "%s: hparams mirror the header", path);
    check(hp->rope_dims > 0 && hp->rope_dims <= hp->head_dim && hp->norm_eps > 0 && hp->attn_scale > 0,
          "%s: option defaults", path);
    check(m->embed.data == embed->data, "%s: model.embed is the file's view", path);
    check(!hp->tied_embeddings || m->output.data == m->embed.data, "%s: tied head is embed", path);
    int n_blocks = hp->n_pre + hp->n_core + hp->n_post;
    tl_block_weights *groups[3] = {m->pre, m->core, m->post};
    int counts[3] = {hp->n_pre, hp->n_core, hp->n_post};
    int seen = 0;
    for (int g = 0; g < 3; g++)
        for (int i = 0; i < counts[g]; i++) {
            const tl_block_weights *w = &groups[g][i];
            seen += w->wq.data && w->wk.data && w->wv.data && w->wo.data && w->w_gate.data &&
                    w->w_up.data && w->w_down.data && w->attn_norm.weight.data && w->mlp_norm.weight.data;
            check(w->wq.rows == (int64_t)hp->n_head * hp->head_dim && w->wq.cols == hp->d, "wq shape");
        }
    check(seen == n_blocks, "%s: every block's weights resolved (%d of %d)", path, seen, n_blocks);
    tl_model_destroy(m);

    st = tl_file_open("/nonexistent/dir/model.tinyloop", 0, &f);
    check(st == TL_ERR_IO && strstr(tl_error_message(), "/nonexistent/dir/model.tinyloop: cannot open"),
          "missing file: %s", tl_error_message());
}

/* ------------------------------------------------------------------ corruptions */

typedef struct edit_ctx {
    const uint8_t *good;
    size_t size;
    uint8_t *buf;
} edit_ctx;

static uint8_t *fresh(edit_ctx *c)
{
    memcpy(c->buf, c->good, c->size);
    return c->buf;
}

static void set_dim(uint8_t *b, int dim, uint32_t value)
{
    put32(b + H_DIMS + 4 * dim, value);
    reseal_header(b);
}

static void check_header_corruptions(edit_ctx *c)
{
    uint8_t *b;
    expect("header only", fresh(c), 100, 0, TL_ERR_FORMAT, "smaller than the 256-byte header");
    expect("truncated by one byte", fresh(c), c->size - 1, 0, TL_ERR_FORMAT, "file_size field says");

    b = fresh(c); memcpy(b, "GGUF\0\0\0\0", 8);
    expect("bad magic", b, c->size, 0, TL_ERR_FORMAT, "bad magic: expected \"TINYLOOP\", got \"GGUF????\"");

    b = fresh(c); put32(b + H_VERSION, 2); reseal_header(b);
    expect("version 2", b, c->size, 0, TL_ERR_FORMAT, "unsupported version: expected 1, got 2");

    b = fresh(c); b[H_DIMS + 1] ^= 0x40;
    expect("header bit flip", b, c->size, 0, TL_ERR_FORMAT, "header CRC-32 mismatch");

    b = fresh(c); b[200] = 7; reseal_header(b);
    expect("reserved byte", b, c->size, 0, TL_ERR_FORMAT, "reserved header byte 200 must be zero");

    b = fresh(c); put64(b + H_DATA_OFFSET, get64(b + H_DATA_OFFSET) + 64); reseal_header(b);
    expect("data_offset moved", b, c->size, 0, TL_ERR_FORMAT, "data_offset: expected");

    b = fresh(c); put64(b + H_META_SIZE, UINT64_MAX - 100); reseal_header(b);
    expect("huge meta_size", b, c->size, 0, TL_ERR_FORMAT, "meta_size");

    b = fresh(c); set_dim(b, D_KV_HEAD, 3);
    expect("n_head % n_kv_head", b, c->size, 0, TL_ERR_FORMAT, "must be a multiple of n_kv_head (3)");

    b = fresh(c); set_dim(b, D_MAX_SEQ, 0);
    expect("max_seq_len 0", b, c->size, 0, TL_ERR_FORMAT, "max_seq_len must be > 0");

    b = fresh(c); set_dim(b, D_DEFAULT_DEPTH, get32(b + H_DIMS + 4 * D_MAX_DEPTH) + 1);
    expect("default_depth > max_depth", b, c->size, 0, TL_ERR_FORMAT, "must be <= max_depth");

    b = fresh(c); set_dim(b, D_MODEL, get32(b + H_DIMS + 4 * D_MODEL) + 1);
    expect("d_model off by one", b, c->size, 0, TL_ERR_FORMAT, "tensor embed.weight: expected shape [");

    b = fresh(c); set_dim(b, D_PRE, 100000000);
    expect("absurd block count", b, c->size, 0, TL_ERR_FORMAT, "which need at least");

    b = fresh(c); set_dim(b, D_HEAD_DIM, 0x80000000u);
    expect("head_dim beyond int32", b, c->size, 0, TL_ERR_FORMAT, "head_dim: expected at most");

    /* one block fewer than the file holds: its tensors are unexpected */
    b = fresh(c);
    int dim = get32(b + H_DIMS + 4 * D_PRE) ? D_PRE : D_POST;
    if (get32(b + H_DIMS + 4 * dim) > 0) {
        set_dim(b, dim, get32(b + H_DIMS + 4 * dim) - 1);
        expect("extra block", b, c->size, 0, TL_ERR_FORMAT, "unexpected tensor ");
    }

    b = fresh(c); put32(b + H_N_TENSORS, 0); reseal_header(b);
    expect("n_tensors 0", b, c->size, 0, TL_ERR_FORMAT, "bytes left after 0 entries");

    b = fresh(c); put32(b + H_N_META, get32(b + H_N_META) + 1); reseal_header(b);
    expect("one metadata entry too many", b, c->size, 0, TL_ERR_FORMAT, "metadata: key length needs 4 bytes");
}

static void check_directory_corruptions(edit_ctx *c)
{
    dir_entry_pos e[4096];
    uint32_t n = walk_directory(c->good, e, 4096);
    if (n < 2) {
        check(0, "the model file needs at least two tensors");
        return;
    }
    uint8_t *b;
    char want[160];

    b = fresh(c); b[e[0].name] ^= 1;
    expect("directory flip", b, c->size, 0, TL_ERR_FORMAT, "directory CRC-32 mismatch");

    b = fresh(c); put32(b + e[0].dtype, 9); reseal_all(b, c->good);
    expect("dtype 9", b, c->size, 0, TL_ERR_FORMAT, "unknown dtype code 9");

    b = fresh(c); put32(b + e[0].ndim, 5); reseal_all(b, c->good);
    expect("ndim 5", b, c->size, 0, TL_ERR_FORMAT, "ndim must be 1..4, got 5");

    b = fresh(c); put64(b + e[0].size, get64(b + e[0].size) + 1); reseal_all(b, c->good);
    expect("size + 1", b, c->size, 0, TL_ERR_FORMAT, "size: expected");

    b = fresh(c); put64(b + e[0].offset, get64(b + e[0].offset) + 8); reseal_all(b, c->good);
    expect("misaligned offset", b, c->size, 0, TL_ERR_FORMAT, "is not a multiple of 64");

    b = fresh(c); put64(b + e[0].offset, UINT64_MAX - 63); reseal_all(b, c->good);
    expect("offset past the end", b, c->size, 0, TL_ERR_FORMAT, "lie outside the data section");

    b = fresh(c); put64(b + e[1].offset, get64(b + e[0].offset)); reseal_all(b, c->good);
    expect("overlap", b, c->size, 0, TL_ERR_FORMAT, "overlap in the data section");

    b = fresh(c); put64(b + e[0].shape, 0); reseal_all(b, c->good);
    expect("zero dim", b, c->size, 0, TL_ERR_FORMAT, "shape[0] must be in 1..2^40, got 0");

    b = fresh(c); b[e[0].name] = '\n'; reseal_all(b, c->good);
    expect("non-printable name", b, c->size, 0, TL_ERR_FORMAT, "name must be non-empty printable ASCII");

    b = fresh(c); put32(b + e[0].name_len, 0x7fffffff); reseal_all(b, c->good);
    expect("name length past the section", b, c->size, 0, TL_ERR_FORMAT, "name needs 2147483647 bytes");

    /* same length, other name: the first two become one name */
    if (e[0].n_name == e[1].n_name) {
        b = fresh(c); memcpy(b + e[1].name, c->good + e[0].name, e[0].n_name); reseal_all(b, c->good);
        snprintf(want, sizeof want, "tensor %.*s appears twice", (int)e[0].n_name, (const char *)c->good + e[0].name);
        expect("duplicate name", b, c->size, 0, TL_ERR_FORMAT, want);
    }

    /* renaming a needed tensor: the builder names the missing one */
    b = fresh(c); b[e[0].name + e[0].n_name - 1] = '~'; reseal_all(b, c->good);
    snprintf(want, sizeof want, "tensor %.*s is missing", (int)e[0].n_name, (const char *)c->good + e[0].name);
    expect("renamed tensor", b, c->size, 0, TL_ERR_FORMAT, want);

    /* a 2-D matrix given as quantized with a group that does not divide cols */
    for (uint32_t i = 0; i < n; i++) {
        if (e[i].n_dim != 2)
            continue;
        b = fresh(c); put32(b + e[i].dtype, TL_DTYPE_Q4); put32(b + e[i].group, 48); reseal_all(b, c->good);
        expect("q4 group 48", b, c->size, 0, TL_ERR_FORMAT, "group_size must be 32, 64 or 128");
        break;
    }
    /* a norm (1-D) must not be quantized-sized, and a wrong shape is named */
    for (uint32_t i = 0; i < n; i++) {
        if (e[i].n_dim != 1)
            continue;
        b = fresh(c); put32(b + e[i].dtype, TL_DTYPE_Q8); put32(b + e[i].group, 32); reseal_all(b, c->good);
        expect("1-D q8", b, c->size, 0, TL_ERR_FORMAT, "quantized tensors must be 2-D");
        break;
    }

    /* a data flip is found only when checksums are verified */
    b = fresh(c); b[get64(b + H_DATA_OFFSET) + get64(b + e[0].offset)] ^= 0x10;
    expect("data flip, no verify", b, c->size, 0, TL_OK, NULL);
    snprintf(want, sizeof want, "tensor %.*s: CRC-32 mismatch", (int)e[0].n_name, (const char *)c->good + e[0].name);
    expect("data flip, verify", b, c->size, 1, TL_ERR_FORMAT, want);
}

/* Edits of specific metadata values (only where the file carries the key). */
static void check_metadata_corruptions(edit_ctx *c)
{
    meta_entry_pos e[256];
    uint32_t n = walk_metadata(c->good, e, 256);
    uint8_t *b = fresh(c);
    if (n > 0) {
        b[get64(b + H_META_OFFSET)] ^= 1;
        expect("metadata flip", b, c->size, 0, TL_ERR_FORMAT, "metadata CRC-32 mismatch");
    }
    for (uint32_t i = 0; i < n; i++) {
        const char *key = (const char *)c->good + e[i].key;
        int klen = (int)e[i].n_key;
        b = fresh(c);
        if (e[i].kind == TL_META_STRING && get64(b + e[i].value) > 0) {
            uint8_t *s = b + e[i].value + 8;
            int is_option = klen > 5 && (memcmp(key, "arch.", 5) == 0 || memcmp(key, "loop.", 5) == 0);
            if (is_option) {
                s[0] = 'Z';
                reseal_all(b, c->good);
                expect("unknown option value", b, c->size, 0, TL_ERR_FORMAT, "unknown value \"Z");
            } else {
                s[0] = 0xFF;
                reseal_all(b, c->good);
                expect("string not UTF-8", b, c->size, 0, TL_ERR_FORMAT, "string must be UTF-8 without NUL");
            }
        } else if (e[i].kind == TL_META_INT && klen == 9 && memcmp(key, "loop.norm", 9) == 0) {
            put64(b + e[i].value, 7);
            reseal_all(b, c->good);
            expect("loop.norm 7", b, c->size, 0, TL_ERR_FORMAT, "metadata loop.norm: expected 0..1, got 7");
        }
    }
    if (n > 0) {
        b = fresh(c); put32(b + e[0].type, 4); reseal_all(b, c->good);
        expect("metadata type 4", b, c->size, 0, TL_ERR_FORMAT, "unknown type 4");
    }
    if (n > 1 && e[0].n_key == e[1].n_key) {
        b = fresh(c); memcpy(b + e[1].key, c->good + e[0].key, e[0].n_key); reseal_all(b, c->good);
        expect("duplicate key", b, c->size, 0, TL_ERR_FORMAT, "appears twice");
    }
}

static void check_file(const char *path)
{
    check_valid_file(path);
    edit_ctx c;
    uint8_t *good = load_file(path, &c.size);
    c.good = good;
    c.buf = alloc_aligned(c.size);
    expect("pristine copy", fresh(&c), c.size, 1, TL_OK, NULL);
    expect("unaligned buffer", c.buf + 1, c.size - 1, 0, TL_ERR_INVALID_ARGUMENT, "64-byte aligned");
    check_header_corruptions(&c);
    check_directory_corruptions(&c);
    check_metadata_corruptions(&c);
    free(c.buf);
    free(good);
}

static void check_half_conversions(void)
{
    check(tl_f32_to_f16(1.0f) == 0x3c00 && tl_f16_to_f32(0x3c00) == 1.0f, "f16 one");
    check(tl_f32_to_f16(65504.0f) == 0x7bff && tl_f32_to_f16(65520.0f) == 0x7c00, "f16 max / overflow");
    check(tl_f16_to_f32(0x0001) == 0x1p-24f && tl_f32_to_f16(0x1p-24f) == 0x0001, "f16 smallest subnormal");
    check(tl_f32_to_f16(0x1p-25f) == 0 && tl_f32_to_f16(0x1.8p-25f) == 1, "f16 subnormal rounding");
    check(tl_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00 && tl_f32_to_f16(1.0f + 0x3p-11f) == 0x3c02,
          "f16 ties to even");
    uint16_t nan = tl_f32_to_f16(__builtin_nanf(""));
    check((nan & 0x7c00) == 0x7c00 && (nan & 0x3ff) != 0, "f16 nan stays nan");
    check(tl_bf16_to_f32(0x3f80) == 1.0f && tl_bf16_to_f32(0xc020) == -2.5f, "bf16 decode");
    check(tl_dtype_nbytes(TL_DTYPE_Q4, 2, 64, 32) == 64 + 16 && tl_dtype_nbytes(TL_DTYPE_Q4, 2, 48, 32) == 0 &&
              tl_dtype_nbytes(TL_DTYPE_Q2, 1, 128, 128) == 32 + 4 && tl_dtype_nbytes(TL_DTYPE_Q8, 1, 64, 64) == 66 &&
              tl_dtype_nbytes(TL_DTYPE_F32, INT64_MAX, INT64_MAX, 0) == 0,
          "dtype byte sizes");
    check(strcmp(tl_dtype_name(TL_DTYPE_BF16), "bf16") == 0 && strcmp(tl_dtype_name((tl_dtype)77), "unknown") == 0,
          "dtype names");
    check(tl_crc32("123456789", 9) == 0xCBF43926u, "CRC-32 check value");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.tinyloop [MODEL.tinyloop ...]\n", argv[0]);
        return 2;
    }
    check_half_conversions();
    for (int i = 1; i < argc; i++)
        check_file(argv[i]);
    printf("test_format: %d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
