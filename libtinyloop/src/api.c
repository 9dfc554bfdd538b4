/* api.c — every function of tinyloop.h: argument and struct_size checks, defaults,
 * then a call into the runtime (context.c, generate.c). Model-level calls run on
 * the model's internal context under its lock; tl_context calls run on the caller's
 * context and need no lock (one context = one thread at a time). */
#include <limits.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api_structs.h"
#include "backend.h"
#include "body_dtype.h"
#include "context.h"
#include "cpu/threadpool.h"
#include "error.h"
#include "escalation.h"
#include "format.h"
#include "generate.h"
#include "model.h"
#include "tinyloop/tinyloop.h"

#ifndef TL_VERSION_STRING
#define TL_VERSION_STRING "0.1.0"
#endif

/* A struct_size above this is taken for an uninitialised struct, not a newer one. */
#define TL_STRUCT_SIZE_LIMIT 4096u

/* ---- struct_size handling ----------------------------------------------------
 * Callers built against an older header pass a smaller struct: accept any size from
 * the first release's (min_size) upwards, read/write only the bytes both sides know,
 * and keep defaults for the rest. */

tl_status check_struct_size(const void *s, size_t min_size, const char *what) {
    uint32_t size;
    memcpy(&size, s, sizeof size);
    if (size < min_size || size > TL_STRUCT_SIZE_LIMIT)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "%s.struct_size is %u, expected at least %zu: initialise it with %s_default()",
                       what, size, min_size, what);
    return TL_OK;
}

/* dst (full size, already defaulted) <- the caller's src (NULL = keep defaults). */
tl_status read_struct(void *dst, size_t full, const void *src, size_t min_size,
                      const char *what) {
    if (!src) return TL_OK;
    tl_status st = check_struct_size(src, min_size, what);
    if (st != TL_OK) return st;
    uint32_t size;
    memcpy(&size, src, sizeof size);
    size_t n = size < full ? size : full;
    memcpy((char *)dst + sizeof(uint32_t), (const char *)src + sizeof(uint32_t),
           n - sizeof(uint32_t));
    return TL_OK;
}

/* The caller's dst <- src (full size), as much as dst's struct_size holds. */
void write_struct(void *dst, const void *src, size_t full) {
    uint32_t size;
    memcpy(&size, dst, sizeof size);
    size_t n = size < full ? size : full;
    memcpy((char *)dst + sizeof(uint32_t), (const char *)src + sizeof(uint32_t),
           n - sizeof(uint32_t));
}

/* ---- version and errors ---------------------------------------------------------- */

uint32_t tl_abi_version(void) { return TL_ABI_VERSION; }

const char *tl_version_string(void) { return TL_VERSION_STRING; }

const char *tl_last_error(void) { return tl_error_message(); }

const char *tl_status_name(tl_status status) {
    switch (status) {
    case TL_OK: return "TL_OK";
    case TL_ERR_INVALID_ARGUMENT: return "TL_ERR_INVALID_ARGUMENT";
    case TL_ERR_IO: return "TL_ERR_IO";
    case TL_ERR_FORMAT: return "TL_ERR_FORMAT";
    case TL_ERR_OUT_OF_MEMORY: return "TL_ERR_OUT_OF_MEMORY";
    case TL_ERR_UNSUPPORTED: return "TL_ERR_UNSUPPORTED";
    case TL_ERR_CONTEXT_FULL: return "TL_ERR_CONTEXT_FULL";
    case TL_ERR_BACKEND: return "TL_ERR_BACKEND";
    case TL_ERR_ABORTED: return "TL_ERR_ABORTED";
    case TL_ERR_NOT_IMPLEMENTED: return "TL_ERR_NOT_IMPLEMENTED";
    case TL_ERR_INTERNAL: return "TL_ERR_INTERNAL";
    }
    return "TL_ERR_UNKNOWN";
}

/* ---- defaults ---------------------------------------------------------------- */

/* Every option/result struct starts with its size (the ABI's versioning): zero the
 * struct and record the size this library was built with. */
#define ZERO_VERSIONED(p)                               \
    do {                                                \
        memset((p), 0, sizeof *(p));                    \
        (p)->struct_size = (uint32_t)sizeof *(p);       \
    } while (0)

void tl_load_options_default(tl_load_options *o) {
    if (!o) return;
    ZERO_VERSIONED(o);
    o->device = "cpu";
    o->draft_vocab = -1;
}

void tl_model_info_default(tl_model_info *info) {
    if (!info) return;
    ZERO_VERSIONED(info);
}

void tl_memory_report_default(tl_memory_report *r) {
    if (!r) return;
    ZERO_VERSIONED(r);
}

void tl_context_options_default(tl_context_options *o) {
    if (!o) return;
    ZERO_VERSIONED(o);
}

void tl_score_options_default(tl_score_options *o) {
    if (!o) return;
    ZERO_VERSIONED(o);
}

void tl_escalation_options_default(tl_escalation_options *o) {
    if (!o) return;
    ZERO_VERSIONED(o);
    o->min_depth = 1;
    o->max_changed = 0.05f;
}

void tl_generate_options_default(tl_generate_options *o) {
    if (!o) return;
    ZERO_VERSIONED(o);
    o->max_tokens = 128;
    o->temperature = 0.8f;
    o->top_k = 40;
    o->top_p = 0.95f;
    o->min_p = 0.05f;
    o->repetition_penalty = 1.0f;
    o->repetition_window = 64;
    o->eos_token = -1;
}

void tl_generate_result_default(tl_generate_result *r) {
    if (!r) return;
    ZERO_VERSIONED(r);
}

/* ---- lifecycle ---------------------------------------------------------------- */

static tl_status check_load_options(const tl_load_options *o) {
    if (o->n_threads < 0 || o->n_threads > 1024)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_threads %d is out of range [0, 1024] (0 = cores)",
                       o->n_threads);
    if (o->max_seq_len < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_seq_len %d is negative (0 = the model's)",
                       o->max_seq_len);
    if (o->prefill_chunk < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "prefill_chunk %d is negative (0 = the backend's default)",
                       o->prefill_chunk);
    if (o->default_depth < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "default_depth %d is negative (0 = the model's)",
                       o->default_depth);
    if (o->draft_vocab < -1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_vocab %lld is out of range (N > 0 tokens, "
                       "0 = the whole vocabulary, -1 = the file's recommendation)",
                       (long long)o->draft_vocab);
    int ps = o->kv_page_size;
    if (ps != 0 && (ps < TL_KV_PAGE_MIN || ps > TL_KV_PAGE_MAX || (ps & (ps - 1)) != 0))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "kv_page_size %d is not a power of two in [%d, %d] "
                       "(positions per KV page; 0 = contiguous KV caches)", ps, TL_KV_PAGE_MIN, TL_KV_PAGE_MAX);
    if (o->kv_pool_bytes < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "kv_pool_bytes %lld is negative (0 = no cap)",
                       (long long)o->kv_pool_bytes);
    if (o->kv_pool_bytes > 0 && ps == 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "kv_pool_bytes %lld caps the KV page pool, which "
                       "needs kv_page_size > 0", (long long)o->kv_pool_bytes);
    if (o->kv_dtype < TL_KV_DTYPE_DEFAULT || o->kv_dtype > TL_KV_DTYPE_F16)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "kv_dtype %d is not a tl_kv_dtype (0 = the backend's "
                       "default, 1 = f32, 2 = f16)", o->kv_dtype);
    tl_status st = tl_body_dtype_check(o->body_dtype);
    if (st != TL_OK) return st;
    tl_kv_choice kv;
    return tl_kv_choice_resolve(o->kv_policy, o->kv_ring_slots, NULL, "tl_load_options", &kv);
}

/* Resolve the 0 = default fields against the file now that its dims are known. */
static tl_status resolve_load_options(const tl_hparams *hp, tl_load_options *o) {
    if (o->max_seq_len > hp->max_seq_len)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_seq_len %d exceeds the model's %d",
                       o->max_seq_len, hp->max_seq_len);
    if (hp->n_core > 0 && o->default_depth > hp->max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "default_depth %d exceeds the model's max_depth %d", o->default_depth,
                       hp->max_depth);
    if (!o->max_seq_len) o->max_seq_len = hp->max_seq_len;
    if (!o->default_depth) o->default_depth = hp->default_depth;
    if (!o->n_threads) o->n_threads = tl_num_cores();
    if (!o->kv_policy) o->kv_policy = TL_KV_EXACT;
    o->device = NULL; /* the caller's string is not kept */
    return TL_OK;
}

/* kv_dtype against the backend: its default for 0; f16 only where it stores fp16. */
static tl_status resolve_kv_dtype(const tl_backend *be, tl_load_options *o) {
    if (o->kv_dtype == TL_KV_DTYPE_DEFAULT)
        o->kv_dtype = be->kv_dtype == TL_KV_DTYPE_F16 && be->ops->buf_alloc_f16 ? TL_KV_DTYPE_F16 : TL_KV_DTYPE_F32;
    if (o->kv_dtype == TL_KV_DTYPE_F16 && !be->ops->buf_alloc_f16)
        return tl_fail(TL_ERR_UNSUPPORTED, "kv_dtype f16: the %s backend keeps its KV cache in f32 "
                       "(load with kv_dtype 0 or 1)", be->name);
    return TL_OK;
}

tl_status tl_load_model(const char *path, const tl_load_options *opts, tl_model **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(path, "path");
    tl_load_options o;
    tl_load_options_default(&o);
    /* the first release's struct ends with default_depth (and, where int64 is 8-aligned,
     * 4 bytes of padding before draft_vocab) */
    tl_status st = read_struct(&o, sizeof o, opts,
                               offsetof(tl_load_options, default_depth) + sizeof o.default_depth,
                               "tl_load_options");
    if (st == TL_OK) st = check_load_options(&o);
    if (st != TL_OK) return st;

    tl_backend *be = NULL;
    st = tl_backend_open(o.device, &be);
    if (st != TL_OK) return st;
    tl_file *file = NULL;
    st = tl_file_open(path, o.verify_checksums, &file);
    if (st != TL_OK) {
        tl_backend_close(be);
        return st;
    }
    tl_model *model = NULL;
    st = tl_model_from_file(file, &o, &model);
    if (st != TL_OK) {
        tl_file_close(file);
        tl_backend_close(be);
        return st;
    }
    st = resolve_load_options(&model->hp, &o);
    if (st == TL_OK) st = resolve_kv_dtype(be, &o);
    if (st == TL_OK) {
        model->load_opts = o;
        model->backend = be;
        snprintf(model->device_name, sizeof model->device_name, "%s", be->name);
        st = be->ops->prepare_model(be, model);
    }
    if (st == TL_OK && o.kv_page_size > 0) {
        if (!be->ops->page_table_create)
            st = tl_fail(TL_ERR_UNSUPPORTED, "kv_page_size %d: the %s backend has no paged KV cache",
                         o.kv_page_size, be->name);
        else
            st = tl_kv_pool_create(be, o.kv_page_size, (uint64_t)o.kv_pool_bytes,
                                   o.kv_dtype == TL_KV_DTYPE_F16, &model->kv_pool);
    }
    if (st != TL_OK) {
        model->backend = NULL;
        tl_backend_close(be);
        tl_model_destroy(model);
        return st;
    }
    *out = model;
    return TL_OK;
}

tl_status tl_free_model(tl_model *model) {
    if (!model) return TL_OK;
    tl_context_close(model->default_ctx);
    model->default_ctx = NULL;
    tl_kv_pool_destroy(model->kv_pool);
    model->kv_pool = NULL;
    tl_backend *be = model->backend;
    model->backend = NULL;
    tl_model_destroy(model);
    tl_backend_close(be);
    return TL_OK;
}

tl_status tl_model_get_info(const tl_model *model, tl_model_info *info) {
    NEED(model, "model");
    NEED(info, "info");
    /* a first-release struct ends before draft_vocab */
    tl_status st = check_struct_size(info, offsetof(tl_model_info, draft_vocab), "tl_model_info");
    if (st != TL_OK) return st;
    const tl_hparams *hp = &model->hp;
    tl_model_info full;
    tl_model_info_default(&full);
    full.vocab_size = hp->vocab;
    full.d_model = hp->d;
    full.n_head = hp->n_head;
    full.n_kv_head = hp->n_kv_head;
    full.head_dim = hp->head_dim;
    full.ffn_dim = hp->ffn;
    full.n_pre = hp->n_pre;
    full.n_core = hp->n_core;
    full.n_post = hp->n_post;
    full.default_depth = model->load_opts.default_depth;
    full.max_depth = hp->max_depth;
    full.max_seq_len = model->load_opts.max_seq_len;
    full.bos_token = hp->bos_id;
    full.eos_token = hp->eos_id;
    full.n_threads = model->load_opts.n_threads;
    full.device_index = model->backend->device_index;
    snprintf(full.device_name, sizeof full.device_name, "%s", model->device_name);
    full.draft_vocab = model->draft.n;
    full.body_dtype = model->load_opts.body_dtype;
    full.kv_dtype = model->load_opts.kv_dtype;
    const tl_meta_entry *name = tl_file_meta(model->file, "general.name");
    if (name && name->type == TL_META_STRING) {
        size_t n = name->s_len < sizeof full.name - 1 ? (size_t)name->s_len : sizeof full.name - 1;
        memcpy(full.name, name->s, n);
        full.name[n] = '\0';
    }
    write_struct(info, &full, sizeof full);
    return TL_OK;
}

tl_status tl_model_get_metadata_string(const tl_model *model, const char *key,
                                       const char **value, size_t *len) {
    NEED(model, "model");
    NEED(key, "key");
    NEED(value, "value");
    NEED(len, "len");
    const tl_meta_entry *e = tl_file_meta(model->file, key);
    if (!e) return tl_fail(TL_ERR_INVALID_ARGUMENT, "the model has no metadata key \"%s\"", key);
    if (e->type != TL_META_STRING)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "metadata key \"%s\" is not a string", key);
    *value = e->s;
    *len = (size_t)e->s_len;
    return TL_OK;
}

/* ---- memory ------------------------------------------------------------------ */

static void memory_totals(const tl_model *model, tl_memory_report *r) {
    tl_memory_report_default(r);
    model->backend->ops->memory(model->backend, &r->weights_bytes, &r->repacked_bytes,
                                &r->device_bytes);
    pthread_mutex_lock((pthread_mutex_t *)&model->stats_lock);
    r->buffers_bytes = model->ctx_buffer_bytes;
    r->kv_cache_bytes = model->ctx_kv_bytes;
    r->prefix_cache_bytes = model->prefix_cache_bytes;
    pthread_mutex_unlock((pthread_mutex_t *)&model->stats_lock);
    if (model->kv_pool) {
        r->kv_page_size = model->kv_pool->page_size;
        r->kv_pool_cap_bytes = model->kv_pool->cap_bytes;
        tl_kv_pool_usage(model->kv_pool, &r->kv_pool_bytes, &r->kv_pages_in_use);
        r->kv_cache_bytes += r->kv_pool_bytes;
    }
    r->body_bytes = tl_body_bytes(model);
    r->kv_dtype = model->load_opts.kv_dtype;
    r->total_bytes = r->weights_bytes + r->repacked_bytes + r->buffers_bytes + r->kv_cache_bytes +
                     r->prefix_cache_bytes;
}

tl_status tl_memory_report_get(const tl_model *model, tl_memory_report *report) {
    NEED(model, "model");
    NEED(report, "report");
    /* a first-release struct ends before prefix_cache_bytes */
    tl_status st = check_struct_size(report, offsetof(tl_memory_report, prefix_cache_bytes),
                                     "tl_memory_report");
    if (st != TL_OK) return st;
    tl_memory_report full;
    memory_totals(model, &full);
    write_struct(report, &full, sizeof full);
    return TL_OK;
}

tl_status tl_vram_usage_bytes(const tl_model *model, uint64_t *bytes) {
    NEED(model, "model");
    NEED(bytes, "bytes");
    tl_memory_report r;
    memory_totals(model, &r);
    *bytes = model->backend->device_index >= 0 ? r.device_bytes : r.total_bytes;
    return TL_OK;
}

/* ---- contexts ------------------------------------------------------------------ */

tl_status tl_context_create(tl_model *model, const tl_context_options *opts, tl_context **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(model, "model");
    tl_context_options o;
    tl_context_options_default(&o);
    /* a first-release struct ends before keep_loop_states */
    tl_status st = read_struct(&o, sizeof o, opts, offsetof(tl_context_options, keep_loop_states),
                               "tl_context_options");
    if (st != TL_OK) return st;
    if (o.keep_loop_states != 0 && o.keep_loop_states != 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "keep_loop_states is %d, not 0 or 1",
                       o.keep_loop_states);
    tl_kv_choice model_kv = tl_model_kv_policy(model), kv;
    st = tl_kv_choice_resolve(o.kv_policy, o.kv_ring_slots, &model_kv, "tl_context_options", &kv);
    if (st != TL_OK) return st;
    tl_context *ctx = NULL;
    st = tl_context_open_with(model, o.max_seq_len, o.max_depth, o.prefill_chunk, &kv, &ctx);
    if (st == TL_OK && o.keep_loop_states) st = tl_context_keep_loop_states(ctx, NULL);
    if (st != TL_OK) {
        tl_context_close(ctx);
        return st;
    }
    *out = ctx;
    return TL_OK;
}

tl_status tl_context_free(tl_context *ctx) {
    if (ctx && ctx->stream) tl_stream_detach(ctx->stream);
    tl_context_close(ctx);
    return TL_OK;
}

static tl_status check_tokens_arg(const int32_t *tokens, size_t n, size_t min_n) {
    if (n < min_n)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_tokens is %zu, need at least %zu", n, min_n);
    if (n > 0 && !tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tokens is NULL with n_tokens %zu", n);
    return TL_OK;
}

tl_status tl_context_append(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                            int32_t depth, float *last_logits) {
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, last_logits ? 1 : 0);
    if (st != TL_OK) return st;
    tl_forward_out out = { .last_logits = last_logits };
    return tl_context_eval(ctx, tokens, n_tokens, depth, &out);
}

tl_status tl_context_deepen(tl_context *ctx, int32_t depth, float *logprobs, float *last_logits) {
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    if (!ctx->loop_s)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the context keeps no loop states to continue "
                                                "from: create it with keep_loop_states = 1");
    if (ctx->n_tokens == 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the sequence is empty: nothing to deepen");
    if (depth < ctx->depth || depth > ctx->max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "depth %d is out of range [%d, %d] (the sequence's depth, the context's "
                       "max_depth)", depth, ctx->depth, ctx->max_depth);
    tl_forward_out out = { .last_logits = last_logits };
    if (logprobs && ctx->n_tokens > 1) {
        out.targets = ctx->tokens + 1;
        out.logprobs = logprobs;
        out.n_targets = ctx->n_tokens - 1;
    }
    return tl_context_eval_deeper(ctx, depth, &out);
}

tl_status tl_context_append_batch(tl_context *const *contexts, const int32_t *tokens, size_t n,
                                  float *logits) {
    if (n == 0) return TL_OK;
    NEED(contexts, "contexts");
    NEED(tokens, "tokens");
    tl_forward_out *outs = calloc(n, sizeof *outs);
    if (!outs) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a batch of %zu", n);
    tl_status st = TL_OK;
    for (size_t i = 0; i < n && st == TL_OK; i++) {
        if (!contexts[i]) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "contexts[%zu] is NULL", i);
        else st = tl_context_check_free(contexts[i]);
        if (st == TL_OK && logits) outs[i].last_logits = logits + i * (size_t)contexts[0]->model->hp.vocab;
    }
    if (st == TL_OK) st = tl_context_eval_batch(contexts, tokens, n, outs);
    free(outs);
    return st;
}

tl_status tl_context_truncate(tl_context *ctx, size_t n_keep) {
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    if (n_keep > ctx->n_tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "cannot truncate to %zu tokens: the sequence holds %zu", n_keep,
                       ctx->n_tokens);
    tl_context_set_length(ctx, n_keep);
    tl_context_trim(ctx);
    return TL_OK;
}

tl_status tl_context_reset(tl_context *ctx) {
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    tl_context_set_length(ctx, 0);
    tl_context_trim(ctx);
    return TL_OK;
}

tl_status tl_context_length(const tl_context *ctx, size_t *n_tokens) {
    NEED(ctx, "ctx");
    NEED(n_tokens, "n_tokens");
    *n_tokens = ctx->n_tokens;
    return TL_OK;
}

tl_status tl_context_fork(const tl_context *ctx, tl_context **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    return tl_context_clone(ctx, out);
}

/* The model's internal context, created on first use. Call with the lock held. */
static tl_status default_context(tl_model *model, tl_context **out) {
    if (!model->default_ctx) {
        tl_status st = tl_context_open(model, 0, 0, 0, &model->default_ctx);
        if (st != TL_OK) return st;
    }
    tl_context_set_length(model->default_ctx, 0);
    tl_context_trim(model->default_ctx);
    *out = model->default_ctx;
    return TL_OK;
}

/* ---- scoring ------------------------------------------------------------------- */

static tl_status read_score_options(const tl_score_options *opts, tl_score_options *o) {
    tl_score_options_default(o);
    return read_struct(o, sizeof *o, opts, sizeof *o, "tl_score_options");
}

/* What a scoring call gives besides the log-probs, from each row's logits on the host. */
typedef struct score_extras {
    float *entropies;          /* each prediction's entropy; NULL = not asked */
    int32_t top_k;             /* each position's top_k most likely tokens; 0 = not asked */
    int32_t *top_ids;
    float *top_logprobs;
} score_extras;

/* tl_context_score and the extras (NULL = none). */
static tl_status score_on_context(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                  const tl_score_options *opts, float *logprobs, const score_extras *x) {
    NEED(ctx, "ctx");
    static const score_extras none = { 0 };
    if (!x) x = &none;
    tl_score_options o;
    tl_status st = tl_context_check_free(ctx);
    if (st == TL_OK) st = read_score_options(opts, &o);
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, 1);
    if (st != TL_OK) return st;
    int V = ctx->model->hp.vocab;
    int max_k = V < TL_MAX_TOP_LOGPROBS ? V : TL_MAX_TOP_LOGPROBS;
    if (x->top_k != 0 && (x->top_k < 1 || x->top_k > max_k))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_k %d is out of range [1, %d]", x->top_k, max_k);
    if (n_tokens > 1 && !logprobs) return tl_fail(TL_ERR_INVALID_ARGUMENT, "logprobs must not be NULL");
    if (n_tokens > 1 && x->top_k && (!x->top_ids || !x->top_logprobs))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_ids and top_logprobs must not be NULL");
    tl_forward_out out = { .targets = tokens + 1, .logprobs = logprobs, .n_targets = n_tokens - 1,
                           .entropies = x->entropies, .top_k = x->top_k, .top_ids = x->top_ids,
                           .top_logprobs = x->top_logprobs };
    if (x->entropies || x->top_k) {
        out.host_row = malloc((size_t)V * sizeof *out.host_row);
        if (!out.host_row) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a row of %d logits", V);
    }
    st = tl_context_eval(ctx, tokens, n_tokens, o.depth, &out);
    free(out.host_row);
    return st;
}

tl_status tl_context_score(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                           const tl_score_options *opts, float *logprobs) {
    return score_on_context(ctx, tokens, n_tokens, opts, logprobs, NULL);
}

tl_status tl_context_score_top_logprobs(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                        const tl_score_options *opts, int32_t top_k, float *logprobs,
                                        int32_t *top_ids, float *top_logprobs) {
    if (top_k == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_k 0 is out of range [1, %d]", TL_MAX_TOP_LOGPROBS);
    score_extras x = { .top_k = top_k, .top_ids = top_ids, .top_logprobs = top_logprobs };
    return score_on_context(ctx, tokens, n_tokens, opts, logprobs, &x);
}

tl_status tl_context_score_with_uncertainty(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                            const tl_score_options *opts, float *logprobs,
                                            float *entropies) {
    if (n_tokens > 1 && !entropies) return tl_fail(TL_ERR_INVALID_ARGUMENT, "entropies must not be NULL");
    score_extras x = { .entropies = entropies };
    return score_on_context(ctx, tokens, n_tokens, opts, logprobs, &x);
}

tl_status tl_context_score_last_token(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                      const tl_score_options *opts, float *logits) {
    NEED(ctx, "ctx");
    NEED(logits, "logits");
    tl_score_options o;
    tl_status st = tl_context_check_free(ctx);
    if (st == TL_OK) st = read_score_options(opts, &o);
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, 1);
    if (st != TL_OK) return st;
    tl_forward_out out = { .last_logits = logits };
    return tl_context_eval(ctx, tokens, n_tokens, o.depth, &out);
}

tl_status tl_score(tl_model *model, const int32_t *tokens, size_t n_tokens,
                   const tl_score_options *opts, float *logprobs) {
    NEED(model, "model");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK) st = tl_context_score(ctx, tokens, n_tokens, opts, logprobs);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_score_with_uncertainty(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                    const tl_score_options *opts, float *logprobs, float *entropies) {
    NEED(model, "model");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK) st = tl_context_score_with_uncertainty(ctx, tokens, n_tokens, opts, logprobs, entropies);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_score_top_logprobs(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                const tl_score_options *opts, int32_t top_k, float *logprobs,
                                int32_t *top_ids, float *top_logprobs) {
    NEED(model, "model");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK)
        st = tl_context_score_top_logprobs(ctx, tokens, n_tokens, opts, top_k, logprobs, top_ids,
                                           top_logprobs);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_score_last_token(tl_model *model, const int32_t *tokens, size_t n_tokens,
                              const tl_score_options *opts, float *logits) {
    NEED(model, "model");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK) st = tl_context_score_last_token(ctx, tokens, n_tokens, opts, logits);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_score_logit_lens(tl_model *model, const int32_t *tokens, size_t n_tokens,
                              const tl_score_options *opts, int32_t max_depth,
                              float *logits_per_depth) {
    NEED(model, "model");
    NEED(logits_per_depth, "logits_per_depth");
    tl_score_options o;
    tl_status st = read_score_options(opts, &o);
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, 1);
    if (st != TL_OK) return st;
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    st = default_context(model, &ctx);
    if (st == TL_OK) st = tl_context_logit_lens(ctx, tokens, n_tokens, max_depth, logits_per_depth);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_score_with_consistency_escalation(tl_model *model, const int32_t *tokens,
                                               size_t n_tokens, const tl_escalation_options *opts,
                                               float *logprobs, float *entropies,
                                               int32_t *depth_used) {
    NEED(model, "model");
    NEED(depth_used, "depth_used");
    tl_escalation_options o;
    tl_escalation_options_default(&o);
    tl_status st = read_struct(&o, sizeof o, opts, sizeof o, "tl_escalation_options");
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, 1);
    if (st != TL_OK) return st;
    if (n_tokens > 1 && (!logprobs || !entropies))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "logprobs and entropies must not be NULL");
    const tl_hparams *hp = &model->hp;
    if (hp->n_core == 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "consistency escalation deepens the loop, and this "
                                           "model has no loop (n_core = 0)");
    int32_t max_depth = o.max_depth ? o.max_depth : tl_model_default_depth(model);
    if (o.max_depth < 0 || max_depth > hp->max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_depth %d is out of range [1, %d] (0 = the "
                                                "default depth)", o.max_depth, hp->max_depth);
    if (o.min_depth < 1 || o.min_depth > max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "min_depth %d is out of range [1, %d] (max_depth)",
                       o.min_depth, max_depth);
    if (!(o.max_changed >= 0.0f && o.max_changed <= 1.0f))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_changed %g is not a share in [0, 1]",
                       (double)o.max_changed);
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    st = default_context(model, &ctx);
    if (st == TL_OK)   /* the tokens are checked by the first pass */
        st = tl_context_escalate(ctx, tokens, n_tokens, o.min_depth, max_depth, o.max_changed,
                                 logprobs, entropies, depth_used);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

/* ---- generation ------------------------------------------------------------------ */

/* The first release's sizes: the speculative fields came later. */
#define GENERATE_OPTIONS_V1_SIZE offsetof(tl_generate_options, draft_depth)
#define GENERATE_RESULT_V1_SIZE offsetof(tl_generate_result, n_drafted)

tl_status read_generate_options(const tl_generate_options *opts, tl_generate_options *o) {
    tl_generate_options_default(o);
    tl_status st = read_struct(o, sizeof *o, opts, GENERATE_OPTIONS_V1_SIZE, "tl_generate_options");
    /* draft_depth sits where the first release's struct had its tail padding: read the
     * speculative fields only from a struct that holds both */
    uint32_t size = 0;
    if (opts) memcpy(&size, opts, sizeof size);
    if (opts && size < offsetof(tl_generate_options, n_draft) + sizeof o->n_draft)
        o->draft_depth = o->n_draft = 0;
    if (opts && size < offsetof(tl_generate_options, draft_p_min) + sizeof o->draft_p_min)
        o->draft_p_min = 0.0;   /* a struct from before it: its tail padding is no value */
    if (opts && size < offsetof(tl_generate_options, tree_budget) + sizeof o->tree_budget) {
        memset(o->tree_widths, 0, sizeof o->tree_widths);   /* a struct from before trees */
        o->tree_budget = 0;
    }
    return st;
}

tl_status check_result_arg(tl_generate_result *result) {
    return result ? check_struct_size(result, GENERATE_RESULT_V1_SIZE, "tl_generate_result") : TL_OK;
}

/* One generation on ctx with the caller's structs checked and the result written back. */
static tl_status generate_on(tl_context *ctx, const int32_t *prompt, size_t n_prompt,
                             const tl_generate_options *opts, int32_t *out_tokens,
                             size_t out_capacity, tl_token_callback callback, void *user_data,
                             tl_generate_result *result) {
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    if (st == TL_OK) st = check_result_arg(result);
    if (st != TL_OK) return st;
    if (out_capacity > 0 && !out_tokens && !callback)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "out_tokens is NULL with out_capacity %zu",
                       out_capacity);
    tl_generate_result full;
    tl_generate_result_default(&full);
    st = tl_generate_run(ctx, prompt, n_prompt, &o, out_tokens, out_capacity, callback, user_data,
                         &full);
    if (result) write_struct(result, &full, sizeof full);
    return st;
}

tl_status tl_context_generate(tl_context *ctx, const int32_t *prompt, size_t n_prompt,
                              const tl_generate_options *opts, int32_t *out_tokens,
                              size_t out_capacity, tl_generate_result *result) {
    NEED(ctx, "ctx");
    NEED(out_tokens, "out_tokens");
    return generate_on(ctx, prompt, n_prompt, opts, out_tokens, out_capacity, NULL, NULL, result);
}

tl_status tl_generate(tl_model *model, const int32_t *prompt, size_t n_prompt,
                      const tl_generate_options *opts, int32_t *out_tokens, size_t out_capacity,
                      tl_generate_result *result) {
    NEED(model, "model");
    NEED(out_tokens, "out_tokens");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK)
        st = generate_on(ctx, prompt, n_prompt, opts, out_tokens, out_capacity, NULL, NULL, result);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_generate_stream(tl_model *model, const int32_t *prompt, size_t n_prompt,
                             const tl_generate_options *opts, tl_token_callback callback,
                             void *user_data, tl_generate_result *result) {
    NEED(model, "model");
    NEED(callback, "callback");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK)
        st = generate_on(ctx, prompt, n_prompt, opts, NULL, 0, callback, user_data, result);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_stream_start(tl_model *model, tl_context *ctx, const int32_t *prompt,
                          size_t n_prompt, const tl_generate_options *opts, tl_stream **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(model, "model");
    if (ctx && ctx->model != model)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "ctx belongs to a different model");
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    if (st != TL_OK) return st;
    tl_stream *s = malloc(sizeof *s);
    if (!s) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a stream");
    tl_context *own = NULL;
    if (!ctx) {
        st = tl_context_open(model, 0, 0, 0, &own);
        if (st != TL_OK) {
            free(s);
            return st;
        }
    }
    st = tl_stream_begin(s, ctx ? ctx : own, prompt, n_prompt, &o, SIZE_MAX, 1);
    if (st != TL_OK) {
        tl_context_close(own);
        free(s);
        return st;
    }
    s->owned_ctx = own;
    *out = s;
    return TL_OK;
}

tl_status tl_stream_next(tl_stream *stream, int32_t *token, tl_stop_reason *stop_reason) {
    NEED(stream, "stream");
    NEED(token, "token");
    tl_stop_reason reason;
    tl_status st = tl_stream_step(stream, token, &reason);
    if (stop_reason) *stop_reason = reason;
    return st;
}

tl_status tl_stream_next_batch(tl_stream *const *streams, size_t n, int32_t *tokens,
                               tl_stop_reason *stop_reasons, tl_status *statuses) {
    if (n == 0) return TL_OK;
    NEED(streams, "streams");
    NEED(tokens, "tokens");
    NEED(stop_reasons, "stop_reasons");
    NEED(statuses, "statuses");
    struct tl_stream **gs = malloc(n * sizeof *gs);
    if (!gs) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a batch of %zu streams", n);
    tl_status st = TL_OK;
    const struct tl_model *model = NULL;   /* of the first stream that still has a context */
    for (size_t i = 0; i < n && st == TL_OK; i++) {
        if (!streams[i]) {
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "streams[%zu] is NULL", i);
            break;
        }
        gs[i] = streams[i];
        for (size_t j = 0; j < i && st == TL_OK; j++)
            if (streams[j] == streams[i]) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "streams %zu and %zu are the same", j, i);
        if (st != TL_OK || !gs[i]->ctx) continue;   /* a stream whose context was freed has ended */
        if (!model) model = gs[i]->ctx->model;
        else if (gs[i]->ctx->model != model)
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "streams[%zu] belongs to another model", i);
    }
    if (st == TL_OK) tl_streams_step(gs, n, tokens, stop_reasons, statuses);
    free(gs);
    return st;
}

tl_status tl_stream_result(const tl_stream *stream, tl_generate_result *result) {
    NEED(stream, "stream");
    NEED(result, "result");
    tl_status st = check_result_arg(result);
    if (st != TL_OK) return st;
    tl_generate_result full;
    tl_generate_result_default(&full);
    tl_stream_fill_result(stream, &full);
    write_struct(result, &full, sizeof full);
    return TL_OK;
}

tl_status tl_stream_logprobs(const tl_stream *stream, float *token_logprob, int32_t *top_ids,
                             float *top_logprobs) {
    NEED(stream, "stream");
    return tl_stream_token_logprobs(stream, token_logprob, top_ids, top_logprobs);
}

tl_status tl_stream_free(tl_stream *stream) {
    if (!stream) return TL_OK;
    tl_stream_end(stream);
    free(stream);
    return TL_OK;
}

/* The positions a batch member needs: its prompt and every token but the last (which
 * is never fed), within the model's limit (0 = the model's whole length). */
int batch_member_seq(const tl_model *model, size_t n_prompt, const tl_generate_options *o,
                     size_t out_capacity) {
    size_t tokens = o->max_tokens > 0 ? (size_t)o->max_tokens : 0;
    if (tokens > out_capacity) tokens = out_capacity;
    size_t need = n_prompt + (tokens > 0 ? tokens - 1 : 0);
    return need == 0 || need >= (size_t)tl_model_max_seq(model) ? 0 : (int)need;
}

/* Each prompt runs as its own sequence in a context owned by this call, sized for it;
 * after the prompts' prefills, their decode steps run together (tl_streams_step: one
 * forward pass for the sequences that step plainly). */
tl_status tl_generate_batch(tl_model *model, const int32_t *const *prompts,
                            const size_t *prompt_lengths, size_t n_prompts,
                            const tl_generate_options *opts, int32_t *const *out_tokens,
                            size_t out_capacity, tl_generate_result *results) {
    NEED(model, "model");
    if (n_prompts == 0) return TL_OK;
    NEED(prompts, "prompts");
    NEED(prompt_lengths, "prompt_lengths");
    NEED(out_tokens, "out_tokens");
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    if (st == TL_OK) st = check_result_arg(results);
    if (st != TL_OK) return st;
    for (size_t i = 0; i < n_prompts; i++)
        if (!out_tokens[i]) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out_tokens[%zu] is NULL", i);
    /* the caller's array stride is its own struct size */
    uint32_t stride = 0;
    if (results) memcpy(&stride, results, sizeof stride);

    struct tl_stream *streams = calloc(n_prompts, sizeof *streams);
    struct tl_stream **live = calloc(n_prompts, sizeof *live);
    size_t *member = calloc(n_prompts, sizeof *member);
    int32_t *tokens = calloc(n_prompts, sizeof *tokens);
    tl_stop_reason *reasons = calloc(n_prompts, sizeof *reasons);
    tl_status *statuses = calloc(n_prompts, sizeof *statuses);
    if (!streams || !live || !member || !tokens || !reasons || !statuses)
        st = tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a batch of %zu generations", n_prompts);
    size_t begun = 0;
    for (; begun < n_prompts && st == TL_OK; begun++) {
        tl_context *ctx = NULL;
        st = tl_context_open(model, batch_member_seq(model, prompt_lengths[begun], &o, out_capacity), 0, 0, &ctx);
        if (st == TL_OK) {
            /* one prompt keeps a greedy stream's steps chained on the device */
            st = tl_stream_begin(&streams[begun], ctx, prompts[begun], prompt_lengths[begun], &o, out_capacity,
                                 n_prompts == 1);
            if (st == TL_OK) streams[begun].owned_ctx = ctx;
            else tl_context_close(ctx);
        }
        if (st != TL_OK) st = tl_fail(st, "prompt %zu: %s", begun, tl_last_error());
    }
    if (st != TL_OK && begun > 0) begun--;   /* the failed one holds nothing to end */
    size_t n_live = 0;
    for (size_t i = 0; st == TL_OK && i < n_prompts; i++) {
        live[n_live] = &streams[i];
        member[n_live++] = i;
    }
    while (st == TL_OK && n_live > 0) {
        tl_streams_step(live, n_live, tokens, reasons, statuses);
        size_t kept = 0;
        for (size_t j = 0; j < n_live; j++) {
            size_t i = member[j];
            if (statuses[j] != TL_OK && st == TL_OK) st = tl_fail(statuses[j], "prompt %zu: %s", i, tl_last_error());
            if (tokens[j] >= 0) out_tokens[i][streams[i].n_generated - 1] = tokens[j];
            if (!streams[i].finished) {   /* a failed stream has finished too */
                live[kept] = live[j];
                member[kept++] = i;
            }
        }
        n_live = kept;
    }
    for (size_t i = 0; i < begun; i++) {
        if (results) {
            tl_generate_result full;
            tl_generate_result_default(&full);
            tl_stream_fill_result(&streams[i], &full);
            char *r = (char *)results + i * stride;
            memcpy(r, &stride, sizeof stride);
            write_struct(r, &full, sizeof full);
        }
        tl_stream_end(&streams[i]);
    }
    free(streams);
    free(live);
    free(member);
    free(tokens);
    free(reasons);
    free(statuses);
    return st;
}

tl_status tl_generate_speculative(tl_model *model, const int32_t *prompt, size_t n_prompt,
                                  const tl_generate_options *opts, int32_t draft_depth,
                                  int32_t n_draft, int32_t *out_tokens, size_t out_capacity,
                                  tl_generate_result *result) {
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    if (st != TL_OK) return st;
    if (draft_depth < 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_depth %d is out of range (at least 1)",
                       draft_depth);
    o.draft_depth = draft_depth;
    o.n_draft = n_draft;
    return tl_generate(model, prompt, n_prompt, &o, out_tokens, out_capacity, result);
}

tl_status tl_generate_tree_speculative(tl_model *model, const int32_t *prompt, size_t n_prompt,
                                       const tl_generate_options *opts, int32_t draft_depth,
                                       const int32_t *widths, size_t n_levels, int32_t budget,
                                       int32_t *out_tokens, size_t out_capacity, tl_generate_result *result) {
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    if (st != TL_OK) return st;
    NEED(widths, "widths");
    if (n_levels < 1 || n_levels > TL_TREE_MAX_LEVELS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "a token tree has %zu levels, expected 1..%d", n_levels,
                       TL_TREE_MAX_LEVELS);
    for (size_t i = 0; i < n_levels; i++)
        if (widths[i] < 1)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "widths[%zu] is %d: every level of a token tree "
                           "branches at least once", i, widths[i]);
    memset(o.tree_widths, 0, sizeof o.tree_widths);
    memcpy(o.tree_widths, widths, n_levels * sizeof *widths);
    o.draft_depth = draft_depth;
    o.tree_budget = budget;
    return tl_generate(model, prompt, n_prompt, &o, out_tokens, out_capacity, result);
}
