/* api_model.c — the library and model calls of tinyloop.h: version and errors, loading
 * and freeing a model (the backend, the file, body_dtype, the KV page pool), its info
 * and metadata, the memory report. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "abi/api_structs.h"
#include "backend/backend.h"
#include "base/error.h"
#include "base/log.h"
#include "cpu/backend_cpu.h"
#include "cpu/threadpool.h"
#include "model/format.h"
#include "model/model.h"
#include "runtime/body_dtype.h"
#include "runtime/context.h"
#include "runtime/kv_cache.h"
#include "tinyloop/tinyloop.h"

#ifndef TL_VERSION_STRING
#define TL_VERSION_STRING "0.1.0"
#endif

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
    if (o->state_init < TL_STATE_INIT_DEFAULT || o->state_init > TL_STATE_INIT_WARM)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "state_init %d is not a tl_state_init_choice (0 = the "
                       "default, 1 = the file's, 2 = warm)", o->state_init);
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
    if (o->state_init == TL_STATE_INIT_WARM && hp->n_core == 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "state_init warm: the model has no loop (n_core = 0), so "
                       "there is no loop state to carry from one position to the next");
    if (!o->state_init) o->state_init = TL_STATE_INIT_FILE;
    o->device = NULL; /* the caller's string is not kept */
    return TL_OK;
}

/* The contexts' cache window (kv_policy.h) from the resolved options, reported when
 * approximate: never a silent change of the model's attention. */
static tl_status resolve_cache_window(tl_model *model) {
    const tl_load_options *o = &model->load_opts;
    tl_status st = tl_cache_window_resolve(o->cache_window, o->cache_window_approx, model->hp.sliding_window,
                                           o->max_seq_len, "tl_load_options", &model->cache_window);
    if (st != TL_OK) return st;
    const tl_cache_window *w = &model->cache_window;
    if (w->size && !model->backend->ops->kv_ring)
        return tl_fail(TL_ERR_UNSUPPORTED, "cache_window %d: the %s backend has no ring KV cache", w->size,
                       model->backend->name);
    if (w->size && tl_model_state_init(model, TL_STATE_INIT_DEFAULT) == TL_INIT_WARM)
        return tl_fail(TL_ERR_UNSUPPORTED, "cache_window %d: a warm state init (the file's or state_init "
                       "warm) keeps every position's final state by position, which a window does not "
                       "bound", w->size);
    if (w->approx)
        tl_log(TL_LOG_WARN, "cache_window %d is approximate for this model (%s): attention sees only the "
               "last %d positions", w->size,
               model->hp.sliding_window ? "its sliding window is wider" : "it has full attention", w->size);
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
    st = tl_backend_open(o.device, tl_backend_cpu_create, &be);
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
    st = tl_body_dtype_apply(model, file->path);   /* before the backend sees the tensors */
    if (st == TL_OK) st = resolve_load_options(&model->hp, &o);
    if (st == TL_OK) st = resolve_kv_dtype(be, &o);
    if (st == TL_OK) {
        model->load_opts = o;
        model->backend = be;
        snprintf(model->device_name, sizeof model->device_name, "%s", be->name);
        st = be->ops->prepare_model(be, model);
    }
    if (st == TL_OK) st = resolve_cache_window(model);
    if (st == TL_OK && o.kv_page_size > 0) {
        if (!be->ops->page_table_create)
            st = tl_fail(TL_ERR_UNSUPPORTED, "kv_page_size %d: the %s backend has no paged KV cache",
                         o.kv_page_size, be->name);
        else
            st = tl_kv_pool_create(be, o.kv_page_size, (uint64_t)o.kv_pool_bytes,
                                   o.kv_dtype == TL_KV_DTYPE_F16, &model->kv_pool);
    }
    if (st == TL_OK && o.kv_policy == TL_KV_STORE_H && model->hp.n_core > 0) st = tl_context_check_store_h(model);
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
    full.cache_window = model->cache_window.size;
    full.cache_window_approx = model->cache_window.approx;
    full.state_init = model->load_opts.state_init;
    const tl_meta_entry *name = tl_file_meta(model->file, "general.name");
    if (name && name->type == TL_META_STRING) {
        size_t n = name->s_len < sizeof full.name - 1 ? (size_t)name->s_len : sizeof full.name - 1;
        memcpy(full.name, name->s, n);
        full.name[n] = '\0';
    }
    write_struct(info, &full, sizeof full);
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
    tl_kv_choice policy = tl_model_kv_policy(model);
    r->kv_policy = policy.kind;
    r->kv_bytes_per_token = tl_kv_bytes_per_position(&model->hp, &policy, model->hp.n_core ? model->hp.max_depth : 0,
                                                     r->kv_dtype == TL_KV_DTYPE_F16);
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
