/* model.h — the loaded model: dimensions, architecture options and weight views.
 * Filled by model.c from a validated tl_file (format.h); immutable after load. */
#ifndef TL_MODEL_H
#define TL_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include <pthread.h>

#include "base/tensor.h"
#include "model/draft_vocab.h"
#include "model/kv_policy.h"
#include "tinyloop/tinyloop.h"

typedef enum { TL_NORM_PRE = 0, TL_NORM_SANDWICH_OUTER = 1, TL_NORM_SANDWICH_BRANCH = 2 } tl_norm_placement;
typedef enum { TL_NORMTYPE_RMS = 0, TL_NORMTYPE_LAYER = 1 } tl_norm_type;
typedef enum { TL_ROPE_HALF = 0, TL_ROPE_INTERLEAVED = 1 } tl_rope_style;
typedef enum { TL_ACT_SILU = 0, TL_ACT_GELU_TANH = 1 } tl_activation;
typedef enum { TL_INJECT_NONE = 0, TL_INJECT_ADD = 1, TL_INJECT_CONCAT = 2 } tl_injection;
typedef enum { TL_INIT_PRELUDE = 0, TL_INIT_ZEROS = 1, TL_INIT_NOISE = 2, TL_INIT_WARM = 3 } tl_state_init;

typedef struct tl_hparams {
    int32_t vocab, d, n_head, n_kv_head, head_dim, ffn;
    int32_t n_pre, n_core, n_post;
    int32_t default_depth, max_depth, max_seq_len;
    /* architecture options, defaults as in docs/format.md */
    tl_norm_placement norm_placement;
    tl_norm_type norm_type;
    int32_t norm_unit_offset;
    float norm_eps;
    tl_rope_style rope_style;
    float rope_theta;
    int32_t rope_dims;
    tl_activation activation;
    int32_t qkv_bias;
    int32_t sliding_window;
    float attn_scale;
    float embed_scale;
    int32_t tied_embeddings;
    int32_t final_norm;        /* 0: no norm before the head */
    tl_injection injection;
    int32_t injection_bias;
    tl_state_init state_init;
    float noise_sigma;
    uint64_t noise_seed;
    float noise_truncation;    /* noise init: |n| <= this (0 = untruncated) */
    int32_t loop_norm;
    int32_t post_norm;         /* one norm after the last iteration, before the coda */
    int32_t exit_gate;         /* exit_gate.* present (scoring only) */
    int32_t bos_id, eos_id;
    int32_t draft_vocab_size;  /* the file's recommended draft vocabulary; 0 = none */
    int32_t draft_depth, n_draft; /* the file's recommended drafting; 0 = none */
} tl_hparams;

/* A norm: weight always, bias for layernorm. */
typedef struct tl_norm_weights {
    tl_tensor weight;
    tl_tensor bias;     /* .data == NULL when absent */
} tl_norm_weights;

typedef struct tl_block_weights {
    tl_norm_weights attn_norm;       /* N1 */
    tl_norm_weights attn_post_norm;  /* N2 (sandwich placements only) */
    tl_norm_weights mlp_norm;        /* N2 of pre, N3 of sandwiches */
    tl_norm_weights mlp_post_norm;   /* N4 (sandwich placements only) */
    tl_tensor wq, wk, wv, wo;
    tl_tensor bq, bk, bv;            /* .data == NULL without qkv bias */
    tl_tensor w_gate, w_up, w_down;
} tl_block_weights;

struct tl_file;   /* format.h */
struct tl_backend; /* backend.h */

struct tl_model {
    tl_hparams hp;
    struct tl_file *file;              /* owns the mapping the tensors point into */
    tl_tensor embed;                   /* [V, d] */
    tl_tensor output;                  /* [V, d]; == embed when tied */
    tl_norm_weights final_norm;
    tl_norm_weights loop_norm;         /* when hp.loop_norm */
    tl_norm_weights post_loop_norm;    /* when hp.post_norm */
    tl_tensor exit_gate_w, exit_gate_b; /* [1, d] and [1], when hp.exit_gate */
    tl_tensor inject_w, inject_b;      /* concat injection */
    tl_block_weights *pre, *core, *post;
    tl_tensor token_frequency;         /* [V] vocab.frequency; .data == NULL when absent */
    const float *rope_factors;         /* [rope_dims/2] rope.freq_factors (f32, in the
                                          mapping), or NULL: frequencies as computed */
    tl_draft_vocab draft;              /* the drafts' tokens and head (load option) */
    void *body_copy;                   /* the body's matrices as body_dtype asks, or NULL
                                          (runtime/body_dtype.h); core views point into
                                          it; freed with the model */

    tl_load_options load_opts;         /* as resolved at load (device string not kept) */
    tl_cache_window cache_window;      /* contexts' window from load_opts (kv_policy.h) */
    char device_name[64];
    struct tl_backend *backend;
    struct tl_kv_pool *kv_pool;        /* paged KV's pages (kv_cache.h); NULL = contiguous */

    /* live contexts' memory, for the memory report (guarded by stats_lock) */
    pthread_mutex_t stats_lock;
    uint64_t ctx_buffer_bytes, ctx_kv_bytes;
    uint64_t prefix_cache_bytes;       /* live prefix caches (prefix_cache.c) */

    /* internal context for the model-level convenience calls */
    pthread_mutex_t default_ctx_lock;
    struct tl_context *default_ctx;
};

/* Build a model from an opened file (takes ownership of file on success; on failure
 * the caller still owns and closes it) with the load options opts, a whole struct with
 * its defaults filled in (tl_load_options_default). backend and default_ctx are left
 * NULL, the body as stored (body_dtype is the loader's next step, runtime/body_dtype.h). */
tl_status tl_model_from_file(struct tl_file *file, const tl_load_options *opts, struct tl_model **out);
/* Frees what tl_model_from_file built, the file included. The backend and the default
 * context are released by their owners before this is called. */
void tl_model_destroy(struct tl_model *model);
/* The loop depth a call that passes 0 runs at: the load option's, else the file's. */
/* The KV policy of the model's contexts, from its load options (checked at load). */
static inline tl_kv_choice tl_model_kv_policy(const struct tl_model *model) {
    tl_kv_choice c = { model->load_opts.kv_policy, model->load_opts.kv_ring_slots };
    return c;
}

/* The state init a context runs with for a tl_state_init_choice (0 = the model's load
 * option, checked at load): the file's, or warm. */
static inline tl_state_init tl_model_state_init(const struct tl_model *model, int32_t choice) {
    if (choice == TL_STATE_INIT_DEFAULT) choice = model->load_opts.state_init;
    return choice == TL_STATE_INIT_WARM ? TL_INIT_WARM : model->hp.state_init;
}

/* A warm start's first position has no previous state: it starts as the file declares,
 * or from the prelude's output when the file itself declares warm. */
static inline tl_state_init tl_first_state_init(const tl_hparams *hp) {
    return hp->state_init == TL_INIT_WARM ? TL_INIT_PRELUDE : hp->state_init;
}

static inline int32_t tl_model_default_depth(const struct tl_model *model) {
    return model->load_opts.default_depth > 0 ? model->load_opts.default_depth
                                              : model->hp.default_depth;
}

#endif
