/* model.c — builds a tl_model from a validated tl_file: header dims plus architecture
 * options from metadata (docs/format.md), their consistency, and every weight the
 * architecture needs resolved with its exact shape. A tensor the architecture does not
 * use is an error too, so a mislabelled file cannot load as a different model. */
#include "model/model.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model/format.h"

/* Least tensors any block needs (two norms, q k v o, gate up down), to reject headers
 * declaring absurd block counts before allocating per-block arrays. */
#define MIN_TENSORS_PER_BLOCK 9u

/* Return the first failing status (each call has already recorded its message). */
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)

typedef struct builder {
    const tl_file *file;
    const char *path;
    tl_model *model;
    bool *used;            /* per file tensor: claimed by the architecture */
} builder;

/* ------------------------------------------------------------------ metadata options */

static const char *meta_type_name(tl_meta_type type)
{
    switch (type) {
    case TL_META_INT: return "int";
    case TL_META_FLOAT: return "float";
    case TL_META_STRING: return "string";
    }
    return "unknown";
}

static tl_status meta_int(const builder *b, const char *key, int64_t def, int64_t lo, int64_t hi,
                          int64_t *out)
{
    const tl_meta_entry *e = tl_file_meta(b->file, key);
    *out = def;
    if (!e)
        return TL_OK;
    if (e->type != TL_META_INT)
        return tl_fail(TL_ERR_FORMAT, "%s: metadata %s: expected an int, got a %s", b->path, key,
                       meta_type_name(e->type));
    if (e->i < lo || e->i > hi)
        return tl_fail(TL_ERR_FORMAT, "%s: metadata %s: expected %lld..%lld, got %lld", b->path,
                       key, (long long)lo, (long long)hi, (long long)e->i);
    *out = e->i;
    return TL_OK;
}

static tl_status meta_flag(const builder *b, const char *key, int32_t def, int32_t *out)
{
    int64_t v;
    tl_status st = meta_int(b, key, def, 0, 1, &v);
    *out = (int32_t)v;
    return st;
}

/* Floats also accept int entries (a writer may store 10000 for a theta). `positive`
 * requires > 0, otherwise any finite value >= 0 passes. */
static tl_status meta_float(const builder *b, const char *key, double def, bool positive, float *out)
{
    const tl_meta_entry *e = tl_file_meta(b->file, key);
    double v = def;
    if (e && e->type == TL_META_FLOAT)
        v = e->f;
    else if (e && e->type == TL_META_INT)
        v = (double)e->i;
    else if (e)
        return tl_fail(TL_ERR_FORMAT, "%s: metadata %s: expected a float, got a string", b->path, key);
    /* the range check also keeps the conversion to float defined */
    if (!isfinite(v) || v > 3.0e38 || v < 0.0 || (positive && (float)v == 0.0f))
        return tl_fail(TL_ERR_FORMAT, "%s: metadata %s: expected a finite float %s 0, got %g",
                       b->path, key, positive ? ">" : ">=", v);
    *out = (float)v;
    return TL_OK;
}

/* A string option: its index in `values`, or the default (index 0) when absent. */
static tl_status meta_choice(const builder *b, const char *key, const char *const *values,
                             int n_values, int *out)
{
    const tl_meta_entry *e = tl_file_meta(b->file, key);
    char allowed[160] = "";
    for (int i = 0; i < n_values; i++) {
        strncat(allowed, values[i], sizeof allowed - strlen(allowed) - 1);
        if (i + 1 < n_values)
            strncat(allowed, ", ", sizeof allowed - strlen(allowed) - 1);
    }
    *out = 0;
    if (!e)
        return TL_OK;
    if (e->type != TL_META_STRING)
        return tl_fail(TL_ERR_FORMAT, "%s: metadata %s: expected a string (one of %s), got a %s",
                       b->path, key, allowed, meta_type_name(e->type));
    for (int i = 0; i < n_values; i++)
        if (strlen(values[i]) == e->s_len && memcmp(values[i], e->s, e->s_len) == 0) {
            *out = i;
            return TL_OK;
        }
    int shown = e->s_len > 64 ? 64 : (int)e->s_len;
    return tl_fail(TL_ERR_FORMAT, "%s: metadata %s: unknown value \"%.*s\", expected one of %s",
                   b->path, key, shown, e->s, allowed);
}

/* Each table lists the default first; indexes match the enums of model.h. */
static const char *const NORM_PLACEMENTS[] = {"pre", "sandwich_outer", "sandwich_branch"};
static const char *const NORM_TYPES[] = {"rmsnorm", "layernorm"};
static const char *const ROPE_STYLES[] = {"half", "interleaved"};
static const char *const ACTIVATIONS[] = {"silu", "gelu_tanh"};
static const char *const STATE_INITS[] = {"prelude", "zeros", "noise", "warm"};
/* injection's default is "add", so it maps through its own table */
static const char *const INJECTIONS[] = {"add", "none", "concat"};
static const tl_injection INJECTION_CODES[] = {TL_INJECT_ADD, TL_INJECT_NONE, TL_INJECT_CONCAT};

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

static tl_status read_dims(builder *b)
{
    const tl_file_dims *fd = &b->file->dims;
    tl_hparams *hp = &b->model->hp;
    const uint32_t values[12] = {fd->vocab_size, fd->d_model, fd->n_head, fd->n_kv_head,
                                 fd->head_dim, fd->ffn_dim, fd->n_pre, fd->n_core, fd->n_post,
                                 fd->default_depth, fd->max_depth, fd->max_seq_len};
    int32_t *fields[12] = {&hp->vocab, &hp->d, &hp->n_head, &hp->n_kv_head, &hp->head_dim,
                           &hp->ffn, &hp->n_pre, &hp->n_core, &hp->n_post, &hp->default_depth,
                           &hp->max_depth, &hp->max_seq_len};
    static const char *const names[12] = {"vocab_size", "d_model", "n_head", "n_kv_head",
                                          "head_dim", "ffn_dim", "n_pre", "n_core", "n_post",
                                          "default_depth", "max_depth", "max_seq_len"};
    for (int i = 0; i < 12; i++) {
        if (values[i] > INT32_MAX)
            return tl_fail(TL_ERR_FORMAT, "%s: header %s: expected at most %d, got %u", b->path,
                           names[i], INT32_MAX, values[i]);
        *fields[i] = (int32_t)values[i];
    }
    /* format.c already checked non-zero sizes, n_head % n_kv_head and default <= max */
    if (hp->n_core > 0 && hp->default_depth < 1)
        return tl_fail(TL_ERR_FORMAT, "%s: header default_depth must be >= 1 when n_core > 0, got 0",
                       b->path);
    if ((int64_t)hp->n_head * hp->head_dim > INT32_MAX || (int64_t)hp->d * 2 > INT32_MAX)
        return tl_fail(TL_ERR_FORMAT, "%s: header n_head * head_dim (%d * %d) or 2 * d_model is too large",
                       b->path, hp->n_head, hp->head_dim);
    return TL_OK;
}

static tl_status read_options(builder *b)
{
    tl_hparams *hp = &b->model->hp;
    int choice;
    int64_t v;
    tl_status st;
    TRY(meta_choice(b, "arch.norm_placement", NORM_PLACEMENTS, COUNT(NORM_PLACEMENTS), &choice));
    hp->norm_placement = (tl_norm_placement)choice;
    TRY(meta_choice(b, "arch.norm_type", NORM_TYPES, COUNT(NORM_TYPES), &choice));
    hp->norm_type = (tl_norm_type)choice;
    TRY(meta_flag(b, "arch.norm_unit_offset", 0, &hp->norm_unit_offset));
    TRY(meta_float(b, "arch.norm_eps", 1e-5, true, &hp->norm_eps));
    TRY(meta_choice(b, "arch.rope_style", ROPE_STYLES, COUNT(ROPE_STYLES), &choice));
    hp->rope_style = (tl_rope_style)choice;
    TRY(meta_float(b, "arch.rope_theta", 10000.0, true, &hp->rope_theta));
    TRY(meta_int(b, "arch.rope_dims", hp->head_dim, 0, hp->head_dim, &v));
    if (v % 2 != 0)
        return tl_fail(TL_ERR_FORMAT, "%s: metadata arch.rope_dims: expected an even number <= head_dim (%d), got %lld",
                       b->path, hp->head_dim, (long long)v);
    hp->rope_dims = (int32_t)v;
    TRY(meta_choice(b, "arch.activation", ACTIVATIONS, COUNT(ACTIVATIONS), &choice));
    hp->activation = (tl_activation)choice;
    TRY(meta_flag(b, "arch.qkv_bias", 0, &hp->qkv_bias));
    TRY(meta_int(b, "arch.sliding_window", 0, 0, INT32_MAX, &v));
    hp->sliding_window = (int32_t)v;
    TRY(meta_float(b, "arch.attn_scale", 1.0 / sqrt((double)hp->head_dim), true, &hp->attn_scale));
    TRY(meta_float(b, "arch.embed_scale", 1.0, true, &hp->embed_scale));
    TRY(meta_flag(b, "arch.tied_embeddings", 1, &hp->tied_embeddings));
    TRY(meta_flag(b, "arch.final_norm", 1, &hp->final_norm));
    TRY(meta_choice(b, "loop.injection", INJECTIONS, COUNT(INJECTIONS), &choice));
    hp->injection = INJECTION_CODES[choice];
    TRY(meta_flag(b, "loop.injection_bias", 0, &hp->injection_bias));
    if (hp->injection_bias && hp->injection != TL_INJECT_CONCAT)
        return tl_fail(TL_ERR_FORMAT, "%s: metadata loop.injection_bias is 1 but loop.injection is %s; "
                       "a bias exists only with concat", b->path, INJECTIONS[choice]);
    TRY(meta_choice(b, "loop.state_init", STATE_INITS, COUNT(STATE_INITS), &choice));
    hp->state_init = (tl_state_init)choice;
    TRY(meta_float(b, "loop.noise_sigma", 1.0, false, &hp->noise_sigma));
    TRY(meta_int(b, "loop.noise_seed", 0, INT64_MIN, INT64_MAX, &v));
    hp->noise_seed = (uint64_t)v;
    TRY(meta_float(b, "loop.noise_truncation", 0.0, false, &hp->noise_truncation));
    TRY(meta_flag(b, "loop.norm", 0, &hp->loop_norm));
    TRY(meta_flag(b, "loop.post_norm", 0, &hp->post_norm));
    TRY(meta_flag(b, "loop.exit_gate", 0, &hp->exit_gate));
    if (hp->exit_gate && hp->n_core == 0)
        return tl_fail(TL_ERR_FORMAT, "%s: metadata loop.exit_gate is 1 but the model has no loop "
                       "(n_core = 0); the gate is read after each iteration", b->path);
    TRY(meta_int(b, "tokenizer.bos_id", -1, -1, hp->vocab - 1, &v));
    hp->bos_id = (int32_t)v;
    TRY(meta_int(b, "tokenizer.eos_id", -1, -1, hp->vocab - 1, &v));
    hp->eos_id = (int32_t)v;
    TRY(meta_int(b, "draft.vocab_size", 0, 0, hp->vocab, &v));
    hp->draft_vocab_size = (int32_t)v;
    TRY(meta_int(b, "draft.depth", 0, 0, hp->max_depth, &v));
    hp->draft_depth = (int32_t)v;
    TRY(meta_int(b, "draft.n_draft", 0, 0, 32, &v));   /* speculative.h TL_MAX_DRAFT */
    hp->n_draft = (int32_t)v;
    return TL_OK;
}

/* ------------------------------------------------------------------ tensors */

static void format_shape(char *buf, size_t cap, int ndim, const int64_t *shape)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < ndim && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%lld", i ? ", " : "[", (long long)shape[i]);
    if (len < cap)
        snprintf(buf + len, cap - len, "]");
}

/* Claims tensor `name` with the exact shape [rows, cols] (cols < 0: 1-D [rows]).
 * Vectors (norms, biases) must be f32/f16/bf16; matrices may use any dtype. */
static tl_status claim(builder *b, const char *name, int64_t rows, int64_t cols, tl_tensor *out)
{
    int ndim = cols < 0 ? 1 : 2;
    int64_t want[2] = {rows, cols};
    char want_s[64], got_s[128];
    format_shape(want_s, sizeof want_s, ndim, want);
    const tl_tensor *t = tl_file_tensor(b->file, name);
    if (!t)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor %s is missing (expected shape %s)", b->path, name, want_s);
    if (t->ndim != ndim || t->shape[0] != rows || (ndim == 2 && t->shape[1] != cols)) {
        format_shape(got_s, sizeof got_s, t->ndim, t->shape);
        return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: expected shape %s, got %s", b->path, name,
                       want_s, got_s);
    }
    if (ndim == 1 && tl_dtype_is_quantized(t->dtype))
        return tl_fail(TL_ERR_FORMAT, "%s: tensor %s: expected dtype f32, f16 or bf16 for a vector, got %s",
                       b->path, name, tl_dtype_name(t->dtype));
    b->used[t - b->file->tensors] = true;
    *out = *t;
    return TL_OK;
}

static tl_status claim_norm(builder *b, const char *prefix, tl_norm_weights *out)
{
    char name[128]; /* prefix (< 96 bytes) + ".weight" */
    tl_status st;
    snprintf(name, sizeof name, "%s.weight", prefix);
    if ((st = claim(b, name, b->model->hp.d, -1, &out->weight)) != TL_OK)
        return st;
    if (b->model->hp.norm_type != TL_NORMTYPE_LAYER)
        return TL_OK;
    snprintf(name, sizeof name, "%s.bias", prefix);
    return claim(b, name, b->model->hp.d, -1, &out->bias);
}

static tl_status claim_block(builder *b, const char *kind, int index, tl_block_weights *w)
{
    const tl_hparams *hp = &b->model->hp;
    const int64_t d = hp->d, q_rows = (int64_t)hp->n_head * hp->head_dim;
    const int64_t kv_rows = (int64_t)hp->n_kv_head * hp->head_dim, f = hp->ffn;
    const bool sandwich = hp->norm_placement != TL_NORM_PRE;
    char name[96];
    tl_status st;
#define NAME(suffix) (snprintf(name, sizeof name, "%s.%d.%s", kind, index, suffix), name)
    TRY(claim_norm(b, NAME("attn_norm"), &w->attn_norm));
    TRY(claim_norm(b, NAME("mlp_norm"), &w->mlp_norm));
    if (sandwich) {
        TRY(claim_norm(b, NAME("attn_post_norm"), &w->attn_post_norm));
        TRY(claim_norm(b, NAME("mlp_post_norm"), &w->mlp_post_norm));
    }
    TRY(claim(b, NAME("attn.q.weight"), q_rows, d, &w->wq));
    TRY(claim(b, NAME("attn.k.weight"), kv_rows, d, &w->wk));
    TRY(claim(b, NAME("attn.v.weight"), kv_rows, d, &w->wv));
    TRY(claim(b, NAME("attn.o.weight"), d, q_rows, &w->wo));
    if (hp->qkv_bias) {
        TRY(claim(b, NAME("attn.q.bias"), q_rows, -1, &w->bq));
        TRY(claim(b, NAME("attn.k.bias"), kv_rows, -1, &w->bk));
        TRY(claim(b, NAME("attn.v.bias"), kv_rows, -1, &w->bv));
    }
    TRY(claim(b, NAME("mlp.gate.weight"), f, d, &w->w_gate));
    TRY(claim(b, NAME("mlp.up.weight"), f, d, &w->w_up));
    TRY(claim(b, NAME("mlp.down.weight"), d, f, &w->w_down));
#undef NAME
    return TL_OK;
}

static tl_status claim_blocks(builder *b, const char *kind, int32_t count, tl_block_weights **out)
{
    if (count == 0)
        return TL_OK;
    *out = calloc((size_t)count, sizeof **out);
    if (!*out)
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "%s: out of memory for %d %s blocks", b->path, count, kind);
    for (int32_t i = 0; i < count; i++) {
        tl_status st = claim_block(b, kind, i, &(*out)[i]);
        if (st != TL_OK)
            return st;
    }
    return TL_OK;
}

/* rope.freq_factors: one divisor per RoPE pair (Llama 3.x frequency scaling), f32 so the
 * backends read it in place, each finite and > 0. */
static tl_status claim_rope_factors(builder *b)
{
    tl_model *m = b->model;
    tl_tensor t;
    tl_status st;
    TRY(claim(b, "rope.freq_factors", m->hp.rope_dims / 2, -1, &t));
    if (t.dtype != TL_DTYPE_F32)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor rope.freq_factors: expected dtype f32, got %s", b->path,
                       tl_dtype_name(t.dtype));
    const float *f = t.data;
    for (int32_t i = 0; i < m->hp.rope_dims / 2; i++)
        if (!(isfinite(f[i]) && f[i] > 0.0f))
            return tl_fail(TL_ERR_FORMAT, "%s: tensor rope.freq_factors: factor %d is %g; expected a finite "
                           "value > 0", b->path, (int)i, (double)f[i]);
    m->rope_factors = f;
    return TL_OK;
}

static tl_status claim_tensors(builder *b)
{
    tl_model *m = b->model;
    const tl_hparams *hp = &m->hp;
    const uint64_t n_blocks = (uint64_t)hp->n_pre + (uint64_t)hp->n_core + (uint64_t)hp->n_post;
    /* + the embedding: a file without a final norm (arch.final_norm 0) may hold no other */
    if (n_blocks * MIN_TENSORS_PER_BLOCK + 1 > b->file->n_tensors)
        return tl_fail(TL_ERR_FORMAT, "%s: the header declares %llu blocks (n_pre %d + n_core %d + n_post %d), "
                       "which need at least %llu tensors; the file has %u",
                       b->path, (unsigned long long)n_blocks, hp->n_pre, hp->n_core, hp->n_post,
                       (unsigned long long)(n_blocks * MIN_TENSORS_PER_BLOCK + 1), b->file->n_tensors);
    tl_status st;
    TRY(claim(b, "embed.weight", hp->vocab, hp->d, &m->embed));
    if (hp->tied_embeddings)
        m->output = m->embed;
    else
        TRY(claim(b, "output.weight", hp->vocab, hp->d, &m->output));
    if (hp->final_norm)
        TRY(claim_norm(b, "final_norm", &m->final_norm));
    if (hp->loop_norm)
        TRY(claim_norm(b, "loop_norm", &m->loop_norm));
    if (hp->post_norm)
        TRY(claim_norm(b, "post_loop_norm", &m->post_loop_norm));
    if (hp->exit_gate) {
        TRY(claim(b, "exit_gate.weight", 1, hp->d, &m->exit_gate_w));
        TRY(claim(b, "exit_gate.bias", 1, -1, &m->exit_gate_b));
    }
    /* the injection weights exist only where a loop runs */
    if (hp->n_core > 0 && hp->injection == TL_INJECT_CONCAT) {
        TRY(claim(b, "inject.weight", hp->d, 2 * (int64_t)hp->d, &m->inject_w));
        if (hp->injection_bias)
            TRY(claim(b, "inject.bias", hp->d, -1, &m->inject_b));
    }
    if (tl_file_tensor(b->file, "vocab.frequency")) {
        TRY(claim(b, "vocab.frequency", hp->vocab, -1, &m->token_frequency));
        TRY(tl_draft_vocab_check_frequency(&m->token_frequency, b->path));
    }
    if (tl_file_tensor(b->file, "rope.freq_factors"))
        TRY(claim_rope_factors(b));
    TRY(claim_blocks(b, "pre", hp->n_pre, &m->pre));
    TRY(claim_blocks(b, "core", hp->n_core, &m->core));
    TRY(claim_blocks(b, "post", hp->n_post, &m->post));
    for (uint32_t i = 0; i < b->file->n_tensors; i++)
        if (!b->used[i])
            return tl_fail(TL_ERR_FORMAT, "%s: unexpected tensor %s: this architecture does not use it "
                           "(check arch.tied_embeddings, arch.final_norm, arch.norm_type, arch.qkv_bias, loop.* and the block counts)",
                           b->path, b->file->tensors[i].name);
    return TL_OK;
}

/* ------------------------------------------------------------------ lifecycle */

static void copy_load_options(tl_model *m, const tl_load_options *opts)
{
    m->load_opts = *opts;
    m->load_opts.device = NULL; /* the caller's string is not kept */
}

/* The drafts' vocabulary the load option asks for (tinyloop.h, draft_vocab). */
static tl_status build_draft_vocab(tl_model *m, const char *path)
{
    int64_t n = m->load_opts.draft_vocab;
    if (m->hp.n_core == 0)   /* no loop, no drafts */
        return TL_OK;
    if (n == -1)
        n = m->token_frequency.data ? m->hp.draft_vocab_size : 0;
    if (n == 0)
        return TL_OK;
    if (!m->token_frequency.data)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_vocab %lld: %s carries no token frequencies "
                       "(tensor vocab.frequency) to choose the drafts' tokens by; add them with "
                       "tools/train/token_frequency.py, or pass 0 (the whole vocabulary)",
                       (long long)n, path);
    /* n >= the vocabulary: every token, so the drafts use the head itself */
    return tl_draft_vocab_build(&m->output, &m->token_frequency,
                                n < m->hp.vocab ? (int32_t)n : m->hp.vocab, &m->draft);
}

tl_status tl_model_from_file(struct tl_file *file, const tl_load_options *opts, struct tl_model **out)
{
    if (!file || !opts || !out)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_model_from_file: file, opts and out must not be NULL");
    *out = NULL;
    tl_model *m = calloc(1, sizeof *m);
    bool *used = calloc(file->n_tensors ? file->n_tensors : 1, sizeof *used);
    if (!m || !used) {
        free(m);
        free(used);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "%s: out of memory building the model", file->path);
    }
    pthread_mutex_init(&m->stats_lock, NULL);
    pthread_mutex_init(&m->default_ctx_lock, NULL);
    builder b = {file, file->path, m, used};
    tl_status st = read_dims(&b);
    if (st == TL_OK)
        st = read_options(&b);
    if (st == TL_OK)
        st = claim_tensors(&b);
    free(used);
    if (st == TL_OK) {
        copy_load_options(m, opts);
        st = build_draft_vocab(m, file->path);
    }
    if (st != TL_OK) {
        tl_model_destroy(m); /* the file stays the caller's */
        return st;
    }
    m->file = file;
    *out = m;
    return TL_OK;
}

void tl_model_destroy(struct tl_model *model)
{
    if (!model)
        return;
    pthread_mutex_destroy(&model->stats_lock);
    pthread_mutex_destroy(&model->default_ctx_lock);
    free(model->pre);
    free(model->core);
    free(model->post);
    tl_draft_vocab_free(&model->draft);
    free(model->body_copy);
    tl_file_close(model->file);
    free(model);
}
