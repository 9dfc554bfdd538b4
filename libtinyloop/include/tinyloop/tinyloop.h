/*
 * tinyloop.h — the one public header of libtinyloop, a runtime for weight-shared
 * looped transformers (prelude blocks, a shared core run L times, coda blocks).
 *
 * ABI rules (see docs/api.md):
 *  - every call returns tl_status; tl_last_error() gives a thread-local message;
 *  - options/result structs start with `uint32_t struct_size` and have a
 *    tl_*_default() initialiser, so fields can be appended without breaking callers;
 *  - handles are opaque; weights (tl_model) are immutable and shared by threads,
 *    mutable state lives in tl_context (one per thread / sequence);
 *  - model-level convenience calls use an internal context under a lock.
 *
 * The region between TL_CDEF_BEGIN and TL_CDEF_END is parsed by the Python
 * binding (cffi ABI mode): keep it free of preprocessor logic and macros
 * other than plain integer #defines.
 */
#ifndef TINYLOOP_TINYLOOP_H
#define TINYLOOP_TINYLOOP_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define TL_API __declspec(dllexport)
#else
#define TL_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* TL_CDEF_BEGIN */

#define TL_ABI_VERSION 1

typedef enum tl_status {
    TL_OK = 0,
    TL_ERR_INVALID_ARGUMENT = 1, /* a bad pointer, size, option value or token id   */
    TL_ERR_IO = 2,               /* a file could not be opened, read or mapped        */
    TL_ERR_FORMAT = 3,           /* a model file is corrupt, truncated or inconsistent */
    TL_ERR_OUT_OF_MEMORY = 4,
    TL_ERR_UNSUPPORTED = 5,      /* valid request this build or device cannot serve  */
    TL_ERR_CONTEXT_FULL = 6,     /* sequence would exceed the context's max_seq_len  */
    TL_ERR_BACKEND = 7,          /* the compute backend failed (e.g. a CUDA error)    */
    TL_ERR_ABORTED = 8,          /* a callback asked to stop                          */
    TL_ERR_NOT_IMPLEMENTED = 9,  /* declared for ABI stability, not yet available     */
    TL_ERR_INTERNAL = 10
} tl_status;

typedef enum tl_stop_reason {
    TL_STOP_NONE = 0,       /* still running (streams)                 */
    TL_STOP_MAX_TOKENS = 1,
    TL_STOP_EOS = 2,        /* EOS picked, or the grammar completed     */
    TL_STOP_SEQUENCE = 3,   /* a stop token-sequence matched the suffix */
    TL_STOP_GRAMMAR = 4,    /* grammar dead end: no token can go on    */
    TL_STOP_ABORTED = 5,    /* the callback returned non-zero          */
    TL_STOP_CONTEXT_FULL = 6
} tl_stop_reason;

typedef struct tl_model tl_model;         /* immutable weights, shared by threads   */
typedef struct tl_context tl_context;     /* buffers + KV cache of one sequence      */
typedef struct tl_stream tl_stream;       /* pull iterator over generated tokens     */
typedef struct tl_prefix_cache tl_prefix_cache;   /* read-only snapshot of a prefix  */
typedef struct tl_resume_handle tl_resume_handle; /* a sequence to go on with deeper */
typedef struct tl_prefix_pool tl_prefix_pool;     /* thread-safe set of prefix caches */
typedef struct tl_grammar tl_grammar;     /* immutable compiled grammar, shared by threads */

/* ---- version and errors ------------------------------------------------ */
TL_API uint32_t tl_abi_version(void);
TL_API const char *tl_version_string(void);
TL_API const char *tl_last_error(void);          /* thread-local, never NULL */
TL_API const char *tl_status_name(tl_status status);

/* ---- log messages (docs/api.md, "Log messages") -------------------------------------
 * What the library has to say beyond a status (a setting it ignored, a fallback it took)
 * goes to one process-wide callback; the library itself never prints. message is one
 * line of UTF-8 without a trailing newline, valid during the call only. The callback may
 * run on any thread that calls into the library, several at once; it must not call
 * tl_log_set. Without a callback (the default, and after tl_log_set(NULL, NULL)) messages
 * are dropped, but the last 16 warnings and errors are kept and handed to the next
 * callback set, before tl_log_set returns. tl_log_set returns once no call of the
 * callback it replaces is running, so its user_data may be freed then. */
typedef enum tl_log_level {
    TL_LOG_ERROR = 0,
    TL_LOG_WARN = 1,
    TL_LOG_INFO = 2,
    TL_LOG_DEBUG = 3
} tl_log_level;

typedef void (*tl_log_callback)(tl_log_level level, const char *message, void *user_data);

TL_API tl_status tl_log_set(tl_log_callback callback, void *user_data);

/* ---- lifecycle ----------------------------------------------------------- */
/* How loop iterations use the KV cache (docs/model.md, "Approximate KV policies" and
 * "The store_h KV policy"). TL_KV_SHARE_LAST and TL_KV_RING are approximate by design:
 * within one forward call rows see each other's K/V of the same iteration exactly, earlier
 * positions are seen through a shared slot as last written, so results depend on where
 * calls split the sequence. TL_KV_EXACT and TL_KV_STORE_H compute the same function. */
typedef enum tl_kv_policy {
    TL_KV_DEFAULT = 0,     /* a context: the model's load option; at load: exact      */
    TL_KV_EXACT = 1,       /* one slot per loop iteration and core block              */
    TL_KV_SHARE_LAST = 2,  /* one slot per core block: iterations share it, later
                              calls see an earlier position's last iteration         */
    TL_KV_RING = 3,        /* kv_ring_slots slots per core block: iteration i uses
                              slot (i - 1) mod N (N >= the depth: exact)             */
    TL_KV_STORE_H = 4      /* exact: keep each core block's input (d floats) per
                              iteration and position instead of its K/V, and recompute
                              the K/V of earlier positions when attended (memory for
                              compute; CPU only, not with paged KV or tree speculation) */
} tl_kv_policy;

/* How the loop body's weight matrices are held in memory (docs/api.md, "Body dtype"):
 * the core blocks' attention and MLP matrices, and the concat injection's W_a, which are
 * read L times per token. TL_BODY_F16 / TL_BODY_F32 decode them at load (q8/q4/q2:
 * w = scale * q + min; bf16, f16, f32 values) and keep them as f16 / f32, so the body's
 * matmuls run on float weights with no per-read decoding, at the price of memory. The
 * prelude, coda, norms, biases and embedding stay as stored. Not for a model without a
 * loop body (n_core = 0): TL_ERR_INVALID_ARGUMENT. */
typedef enum tl_body_dtype {
    TL_BODY_AS_STORED = 0, /* the file's encoding (default)                           */
    TL_BODY_F16 = 1,       /* fp16 (round to nearest even; a value beyond fp16's
                              range is an error naming the tensor)                   */
    TL_BODY_F32 = 2        /* f32: the decoded values exactly (exactness studies)     */
} tl_body_dtype;

/* The element type of the KV cache in memory (docs/api.md, "KV dtype"): keys (after
 * RoPE) and values of every context, prefix cache and KV page of the model. fp16 halves
 * the cache (and the bytes decode attention reads); attention still computes in fp32.
 * The CPU backend keeps f32 only (f16 there is TL_ERR_UNSUPPORTED at load). */
typedef enum tl_kv_dtype {
    TL_KV_DTYPE_DEFAULT = 0, /* the backend's: f16 on CUDA, f32 on the CPU           */
    TL_KV_DTYPE_F32 = 1,     /* fp32, as computed                                    */
    TL_KV_DTYPE_F16 = 2      /* fp16, rounded to nearest even, saturated at +-65504  */
} tl_kv_dtype;

/* Where each position's loop starts (docs/model.md, "Warm start"). The file declares a
 * state init (loop.state_init: prelude, zeros, noise or warm); warm can also be chosen at
 * run time for any looped model: position p's loop then starts from position p-1's final
 * loop state, position 0 from the file's init (prelude when the file declares warm). */
typedef enum tl_state_init_choice {
    TL_STATE_INIT_DEFAULT = 0, /* a context: the model's load option; at load: the file's  */
    TL_STATE_INIT_FILE = 1,    /* the file's loop.state_init                               */
    TL_STATE_INIT_WARM = 2     /* warm start                                               */
} tl_state_init_choice;

typedef struct tl_load_options {
    uint32_t struct_size;
    const char *device;        /* "cpu" | "cuda" | "cuda:N" | "auto"; NULL = "cpu"   */
    int32_t n_threads;         /* CPU worker threads; 0 = number of cores            */
    int32_t max_seq_len;       /* context length of contexts; 0 = model's max        */
    int32_t prefill_chunk;     /* tokens per prefill chunk; 0 = 256 (CPU), 512 (GPU) */
    int32_t verify_checksums;  /* 1 = check every tensor's CRC-32 at load            */
    int32_t default_depth;     /* loop depth when a call passes 0; 0 = model default */
    int64_t draft_vocab;       /* speculative drafts score only the N most frequent
                                  tokens (the file's vocab.frequency): N > 0; 0 = the
                                  whole vocabulary; -1 = the file's draft.vocab_size, or
                                  the whole vocabulary without one (default). 64-bit so
                                  that it lies past the first release's struct, whose
                                  tail padding a caller may have left unset          */
    int32_t kv_policy;         /* contexts' KV policy, a tl_kv_policy (below); 0 = exact */
    int32_t kv_ring_slots;     /* TL_KV_RING: slots per core block, >= 1; else 0     */
    int32_t kv_page_size;      /* paged KV: positions per page, a power of two in
                                  [TL_KV_PAGE_MIN, TL_KV_PAGE_MAX]; pages of the model's
                                  pool are taken as sequences grow and shared by forks
                                  and prefix caches (docs/api.md, "Paged KV");
                                  0 = one contiguous cache per context (default)      */
    int32_t body_dtype;        /* the loop body's matrices in memory, a tl_body_dtype
                                  (above); 0 = as stored in the file                 */
    int64_t kv_pool_bytes;     /* paged KV: cap on the pool's bytes; a call that needs
                                  a page past it fails with TL_ERR_OUT_OF_MEMORY and
                                  leaves the sequence as it was; 0 = no cap           */
    int32_t kv_dtype;          /* the KV cache's element type, a tl_kv_dtype (above);
                                  0 = the backend's default                          */
    int32_t cache_window;      /* sliding-window KV (docs/api.md, "Cache window"): each
                                  context keeps the K/V of the last W positions of its
                                  sequence per virtual layer, in a ring, so its KV memory
                                  no longer grows with max_seq_len and a sequence goes on
                                  past max_seq_len (positions keep counting). Exact for
                                  a model with arch.sliding_window <= W; for any other
                                  model it needs cache_window_approx; 1..max_seq_len,
                                  0 = off (default)                                  */
    int32_t cache_window_approx; /* 1: allow cache_window on a model whose attention
                                  sees more than W positions (full attention, or a wider
                                  sliding window): attention then sees only the last W
                                  positions, an approximate mode (tl_model_info reports
                                  it); 0 = refuse that (default)                      */
    int32_t state_init;        /* contexts' state init, a tl_state_init_choice (above);
                                  0 = the file's. Warm on a model without a loop is
                                  TL_ERR_UNSUPPORTED                                 */
} tl_load_options;

#define TL_KV_PAGE_MIN 1
#define TL_KV_PAGE_MAX 4096

TL_API void tl_load_options_default(tl_load_options *opts);
TL_API tl_status tl_load_model(const char *path, const tl_load_options *opts, tl_model **out);
TL_API tl_status tl_free_model(tl_model *model);

typedef struct tl_model_info {
    uint32_t struct_size;
    int32_t vocab_size;
    int32_t d_model;
    int32_t n_head;
    int32_t n_kv_head;
    int32_t head_dim;
    int32_t ffn_dim;
    int32_t n_pre;
    int32_t n_core;
    int32_t n_post;
    int32_t default_depth;
    int32_t max_depth;
    int32_t max_seq_len;       /* of this loaded model (load option or file)  */
    int32_t bos_token;         /* -1 when the model has none                  */
    int32_t eos_token;         /* -1 when the model has none                  */
    int32_t n_threads;
    int32_t device_index;      /* -1 for CPU                                   */
    char device_name[64];      /* "cpu (avx512vnni)", "cpu (avx2)", "cpu (generic)",
                                  "cuda:0 (...)"                                  */
    char name[128];            /* general.name metadata, may be empty          */
    int32_t draft_vocab;       /* tokens the drafts score; 0 = the whole vocabulary */
    int32_t body_dtype;        /* the load option body_dtype (a tl_body_dtype)     */
    int32_t kv_dtype;          /* the KV cache's element type as loaded (a
                                  tl_kv_dtype: 1 = f32, 2 = f16)                   */
    int32_t cache_window;      /* the load option cache_window (0 = off)          */
    int32_t cache_window_approx; /* 1 when that window is approximate for this model
                                  (attention sees fewer positions than its own)    */
    int32_t state_init;        /* the load option state_init as resolved (a
                                  tl_state_init_choice: 1 = the file's, 2 = warm)   */
} tl_model_info;

TL_API void tl_model_info_default(tl_model_info *info);
TL_API tl_status tl_model_get_info(const tl_model *model, tl_model_info *info);

/* ---- metadata (docs/api.md, "Metadata") -----------------------------------------
 * The file's typed key/value entries (docs/format.md, "Metadata keys"), unknown keys
 * included. Enumerate with tl_model_metadata_count and tl_model_metadata_key (index
 * 0..count-1, keys in byte order), then read each value with the getter of its type.
 * The type codes are the file's; a later format version may add codes, which a caller
 * skips. Keys and string values point into the model and live as long as it (never
 * free them). A missing key, an index out of range or a getter of another type is
 * TL_ERR_INVALID_ARGUMENT naming the key. */
typedef enum tl_metadata_type {
    TL_METADATA_INT = 1,       /* int64_t  */
    TL_METADATA_FLOAT = 2,     /* double   */
    TL_METADATA_STRING = 3     /* UTF-8 bytes, not NUL-terminated */
} tl_metadata_type;

TL_API tl_status tl_model_metadata_count(const tl_model *model, size_t *count);
/* *key: NUL-terminated; *type (may be NULL): the entry's tl_metadata_type. */
TL_API tl_status tl_model_metadata_key(const tl_model *model, size_t index, const char **key,
                                       tl_metadata_type *type);
TL_API tl_status tl_model_get_metadata_int(const tl_model *model, const char *key, int64_t *value);
TL_API tl_status tl_model_get_metadata_float(const tl_model *model, const char *key, double *value);
/* A string (e.g. "tokenizer.json", "tokenizer.chat_template", "general.name"): *value is
 * not NUL-terminated: use *len. */
TL_API tl_status tl_model_get_metadata_string(const tl_model *model, const char *key,
                                              const char **value, size_t *len);

/* ---- memory ---------------------------------------------------------------- */
typedef struct tl_memory_report {
    uint32_t struct_size;
    uint64_t weights_bytes;     /* resident weights (mapped file pages or device)    */
    uint64_t repacked_bytes;    /* weights repacked by the backend at load           */
    uint64_t buffers_bytes;     /* activation buffers of all live contexts           */
    uint64_t kv_cache_bytes;    /* KV caches of all live contexts                    */
    uint64_t total_bytes;       /* the sum of the above                               */
    uint64_t device_bytes;      /* bytes allocated on an accelerator (0 on CPU)       */
    uint64_t prefix_cache_bytes; /* live prefix caches (in total_bytes too)           */
    /* paged KV (kv_page_size > 0; else 0): the pool's pages, in kv_cache_bytes too.
       A page shared by contexts and prefix caches counts once. */
    int32_t kv_page_size;       /* positions per page                                 */
    uint64_t kv_pages_in_use;   /* pages held by contexts and prefix caches           */
    uint64_t kv_pool_bytes;     /* their bytes                                        */
    uint64_t kv_pool_cap_bytes; /* the cap (kv_pool_bytes load option); 0 = none      */
    uint64_t body_bytes;        /* the loop body's matrices as held (stored, or the
                                  body_dtype copy), already in weights_bytes          */
    int32_t kv_dtype;           /* the KV cache's element type (tl_kv_dtype: 1 = f32,
                                  2 = f16): kv_cache_bytes and kv_pool_bytes are of it */
    int32_t kv_policy;          /* the contexts' KV policy (the load option, a tl_kv_policy) */
    uint64_t kv_bytes_per_token; /* what a context caching the model's max depth holds per
                                  position under that policy: its K/V slots (of kv_dtype),
                                  plus under store_h the core blocks' inputs (n_core x
                                  max_depth x d_model floats) in place of the loop's K/V */
} tl_memory_report;

TL_API void tl_memory_report_default(tl_memory_report *report);
TL_API tl_status tl_memory_report_get(const tl_model *model, tl_memory_report *report);
/* Device memory in use (CUDA); on CPU the same total as the memory report. */
TL_API tl_status tl_vram_usage_bytes(const tl_model *model, uint64_t *bytes);

/* ---- contexts (mutable state, one per thread or sequence) ------------------- */
typedef struct tl_context_options {
    uint32_t struct_size;
    int32_t max_seq_len;       /* 0 = the model's */
    int32_t max_depth;         /* deepest loop depth this context caches; 0 = model max */
    int32_t prefill_chunk;     /* 0 = the model's load option */
    int32_t keep_loop_states;  /* 1: keep each position's loop state (2 x max_seq_len x
                                  d_model floats) so that tl_context_deepen can continue the
                                  sequence at a deeper depth; 0 = no (the default); not
                                  with an approximate kv_policy */
    int32_t kv_policy;         /* a tl_kv_policy; 0 = the model's load option       */
    int32_t kv_ring_slots;     /* TL_KV_RING: slots per core block, >= 1; else 0     */
    int32_t cache_window;      /* as the load option, for this context: W > 0, 0 = the
                                  model's load option, -1 = none (a full cache)       */
    int32_t cache_window_approx; /* with cache_window > 0: as the load option (0 =
                                  refuse an approximate window)                     */
    int32_t state_init;        /* a tl_state_init_choice; 0 = the model's load option */
} tl_context_options;

TL_API void tl_context_options_default(tl_context_options *opts);
TL_API tl_status tl_context_create(tl_model *model, const tl_context_options *opts,
                                   tl_context **out);
TL_API tl_status tl_context_free(tl_context *ctx);

/* Low-level sequence primitives. A context holds one sequence; every token in it is
 * computed at one depth (the first append fixes it until reset/truncate to 0). */
TL_API tl_status tl_context_append(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                   int32_t depth, float *last_logits /* vocab floats or NULL */);
TL_API tl_status tl_context_truncate(tl_context *ctx, size_t n_keep);
TL_API tl_status tl_context_reset(tl_context *ctx);
TL_API tl_status tl_context_length(const tl_context *ctx, size_t *n_tokens);
/* A new context holding a copy of the sequence (paged KV: sharing its pages, copied when
 * either writes a shared one). */
TL_API tl_status tl_context_fork(const tl_context *ctx, tl_context **out);
/* Continue the whole sequence at a deeper loop depth (at most the context's max_depth),
 * from where its loop stopped: the prelude and the iterations already run are not
 * repeated, and the result is the sequence computed at `depth` from the start. Needs a
 * context created with keep_loop_states and a sequence of at least one token; appends
 * then run at `depth`. logprobs (n_tokens - 1 floats, or NULL): as tl_context_score
 * gives them for the sequence at `depth`; last_logits (vocab floats, or NULL): the
 * logits after the last token. On failure the sequence is emptied. */
TL_API tl_status tl_context_deepen(tl_context *ctx, int32_t depth, float *logprobs,
                                   float *last_logits);
/* A batched decode step: tokens[i] is appended to contexts[i] (n distinct contexts of one
 * model, each with room for one more token) at its sequence's depth (the model's default
 * for an empty one), and logits (n x vocab floats, or NULL) gets each one's logits after
 * it. The contexts' matmuls run as one pass over n rows, so a step of n sequences costs
 * far less than n steps. Refused arguments (checked first) change no sequence, nor does a
 * failure during the pass, except with a warm state init, whose rows run one by one. */
TL_API tl_status tl_context_append_batch(tl_context *const *contexts, const int32_t *tokens,
                                         size_t n, float *logits);

/* ---- adaptive depth ---------------------------------------------------------- */
/* When a token's loop stops before the depth of its sequence (docs/model.md, "Adaptive
 * depth"): after each iteration it >= min_depth (and before the last) the rule looks at
 * the token and stops its loop when it has converged. The iterations it skipped are not
 * computed; their K/V slots hold its last iteration's K/V. */
typedef enum tl_exit_kind {
    TL_EXIT_FIXED = 0,          /* every token runs the full depth (the default)       */
    TL_EXIT_KL = 1,             /* KL(p_it || p_it-1) < threshold (nats), p the next-token
                                   distribution of the state after iteration it (coda and
                                   head on a copy; over the draft vocabulary when the model
                                   has one)                                            */
    TL_EXIT_ENTROPY_DELTA = 2,  /* |H(p_it) - H(p_it-1)| < threshold (nats)            */
    TL_EXIT_LATENT_DELTA = 3,   /* |s_it - s_it-1| / |s_it| < threshold (the loop state) */
    TL_EXIT_ARGMAX_STABLE = 4,  /* the same most likely token for `patience` iterations */
    TL_EXIT_GATE = 5,           /* the model's learned exit gate (loop.exit_gate): the
                                   first iteration whose exit CDF >= threshold          */
} tl_exit_kind;

typedef struct tl_exit_rule {
    tl_exit_kind kind;
    float threshold;            /* see the kinds; finite, >= 0 (gate: in (0, 1])        */
    int32_t min_depth;          /* no exit before this iteration; 0 = 1                 */
    int32_t patience;           /* ARGMAX_STABLE: iterations, >= 1; 0 = 2                */
} tl_exit_rule;

/* ---- scoring ---------------------------------------------------------------- */
typedef struct tl_score_options {
    uint32_t struct_size;
    int32_t depth;             /* 0 = model default                                    */
    tl_exit_rule exit;         /* adaptive depth per position; kind 0 = fixed (default) */
    const int32_t *given_depths; /* or each position's depth given, n_tokens values in
                                  1..depth (e.g. those a generation reported); NULL = none.
                                  Not with an exit rule                                 */
    int32_t *depths;           /* out, or NULL: the depth each position ran, n_tokens values
                                  (logprobs[i] is of position i's pass)                 */
} tl_score_options;

TL_API void tl_score_options_default(tl_score_options *opts);
/* logprobs[i] = log p(tokens[i+1] | tokens[0..i]) for i in [0, n_tokens-1). */
TL_API tl_status tl_score(tl_model *model, const int32_t *tokens, size_t n_tokens,
                          const tl_score_options *opts, float *logprobs);
TL_API tl_status tl_context_score(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                  const tl_score_options *opts, float *logprobs);
/* tl_score plus how unsure each prediction is: entropies[i] = the entropy (nats) of the
 * distribution p(. | tokens[0..i]) whose log-probability of tokens[i+1] is logprobs[i],
 * for i in [0, n_tokens-1). 0 for a certain prediction, log(vocab) at most. */
TL_API tl_status tl_score_with_uncertainty(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                           const tl_score_options *opts, float *logprobs,
                                           float *entropies);
TL_API tl_status tl_context_score_with_uncertainty(tl_context *ctx, const int32_t *tokens,
                                                   size_t n_tokens, const tl_score_options *opts,
                                                   float *logprobs, float *entropies);
/* tl_score plus, at every position, the top_k most likely next tokens (1..20,
 * TL_MAX_TOP_LOGPROBS): top_ids[i * top_k + j] and top_logprobs[i * top_k + j] for i in
 * [0, n_tokens-1), most likely first (the lower id first on ties), log-probabilities of
 * the model's distribution as logprobs[i] is (log_softmax of the logits). */
#define TL_MAX_TOP_LOGPROBS 20
TL_API tl_status tl_score_top_logprobs(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                       const tl_score_options *opts, int32_t top_k, float *logprobs,
                                       int32_t *top_ids, float *top_logprobs);
TL_API tl_status tl_context_score_top_logprobs(tl_context *ctx, const int32_t *tokens,
                                               size_t n_tokens, const tl_score_options *opts,
                                               int32_t top_k, float *logprobs, int32_t *top_ids,
                                               float *top_logprobs);
/* logits (vocab floats) of the position after the last token. */
TL_API tl_status tl_score_last_token(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                     const tl_score_options *opts, float *logits);
TL_API tl_status tl_context_score_last_token(tl_context *ctx, const int32_t *tokens,
                                             size_t n_tokens, const tl_score_options *opts,
                                             float *logits);
/* Logits of the position after the last token at every depth 1..max_depth (the
 * logit lens of a looped model): out[(depth-1) * vocab + v]; opts->depth is unused. */
TL_API tl_status tl_score_logit_lens(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                     const tl_score_options *opts, int32_t max_depth,
                                     float *logits_per_depth);
/* An embedding of the tokens, run as a fresh sequence at opts->depth (0 = the default):
 * the mean over the positions of the head's input (the final norm's output; the last
 * layer's states for a model without a final norm), d_model floats. */
TL_API tl_status tl_embed(tl_model *model, const int32_t *tokens, size_t n_tokens,
                          const tl_score_options *opts, float *embedding);

/* The exit gate of a model whose file has one (metadata loop.exit_gate: Ouro's early-exit
 * gate; docs/model.md, "Exit gate"): lambda[i * depth + t] = sigmoid(gate) on the loop state
 * after iteration t + 1 at position i, for tokens[0..n_tokens) scored as a fresh sequence at
 * opts->depth (0 = the default), n_tokens x depth floats. Generation does not exit early;
 * these values show where the checkpoint's exit rule would. TL_ERR_UNSUPPORTED for a model
 * without a gate or with a warm state init. The context version leaves ctx empty. */
TL_API tl_status tl_score_exit_gate(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                    const tl_score_options *opts, float *lambda);
TL_API tl_status tl_context_score_exit_gate(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                            const tl_score_options *opts, float *lambda);

/* Scoring that deepens the loop until its predictions stop changing: the tokens are
 * scored at min_depth, then at twice the depth (at most max_depth), and so on, until the
 * share of positions whose greedy prediction (argmax) differs from the depth scored
 * before is at most max_changed, or max_depth is reached. Two depths at least, unless
 * min_depth == max_depth or there is one token (then *depth_used = min_depth). */
typedef struct tl_escalation_options {
    uint32_t struct_size;
    int32_t min_depth;         /* first depth scored; default 1                          */
    int32_t max_depth;         /* deepest; 0 = the model's default depth (default)       */
    float max_changed;         /* in [0, 1]; default 0.05                                 */
} tl_escalation_options;

TL_API void tl_escalation_options_default(tl_escalation_options *opts);
/* logprobs and entropies (n_tokens - 1 floats each; may be NULL when n_tokens == 1) as
 * tl_score_with_uncertainty gives them at *depth_used, the depth it stopped at. */
TL_API tl_status tl_score_with_consistency_escalation(tl_model *model, const int32_t *tokens,
                                                      size_t n_tokens,
                                                      const tl_escalation_options *opts,
                                                      float *logprobs, float *entropies,
                                                      int32_t *depth_used);

/* ---- generation ---------------------------------------------------------- */
#define TL_TREE_MAX_LEVELS 8   /* levels of a speculative token tree */
typedef struct tl_generate_options {
    uint32_t struct_size;
    int32_t max_tokens;            /* new tokens at most; default 128                  */
    int32_t depth;                 /* 0 = model default                                */
    float temperature;             /* 0 = greedy; default 0.8                          */
    int32_t top_k;                 /* 0 = off; default 40                              */
    float top_p;                   /* 1 = off; default 0.95                            */
    float min_p;                   /* 0 = off; default 0.05                            */
    float repetition_penalty;      /* 1 = off; default 1.0                             */
    int32_t repetition_window;     /* last N tokens penalised; 0 = all; default 64     */
    uint64_t seed;                 /* sampling seed; default 0                         */
    int32_t eos_token;             /* -1 = model's EOS; -2 = never stop on EOS         */
    const int32_t *stop_tokens;    /* stop sequences, concatenated                     */
    const uint32_t *stop_lengths;  /* length of each stop sequence                     */
    uint32_t n_stop_sequences;
    int32_t draft_depth;           /* self-speculative decoding: loop depth of the
                                      drafts, 1..depth; 0 = off; -1 = the model's
                                      draft.depth (at most depth), else 1              */
    int32_t n_draft;               /* tokens drafted per verification, 0..32; 0 = the
                                      model's draft.n_draft, else 4                    */
    double draft_p_min;            /* a round stops drafting at a draft whose most likely
                                      token has a probability below this (softmax of its
                                      logits; sampling: of its distribution); 0..1, 0 =
                                      never (default). 8 bytes: past the end of the struct
                                      before it, whose tail padding may be unset        */
    int32_t tree_widths[TL_TREE_MAX_LEVELS]; /* tree speculation (with draft_depth): the
                                      drafts' branching per level, each 1..8 (level 1 =
                                      the top tree_widths[0] tokens after the pending
                                      one), up to the first 0; all 0 = linear drafts    */
    int32_t tree_budget;           /* drafted nodes of a tree at most, 1..63; 0 = the
                                      shape's full size, capped at 63                   */
    int32_t logprobs;              /* 1: keep each generated token's log-probability for
                                      tl_stream_logprobs (the model's distribution at the
                                      generation's depth, before temperature, filters and
                                      penalty); 0 = off (default). Not with draft_depth  */
    int32_t top_logprobs;          /* with logprobs: also the N most likely tokens of each
                                      step, 0..TL_MAX_TOP_LOGPROBS; default 0          */
    float presence_penalty;        /* OpenAI's: minus this from the logit of every token
                                      generated so far, -2..2; default 0 (off)        */
    float frequency_penalty;       /* OpenAI's: minus this times the number of times a
                                      token was generated so far, -2..2; default 0     */
    const int32_t *logit_bias_ids; /* OpenAI's logit_bias: added to these tokens' logits */
    const float *logit_bias_values;/* -100..100 each; distinct ids                     */
    size_t n_logit_bias;           /* entries of both arrays; 0 = none (default). The
                                      adjustments (docs/sampling.md, step 0) run on the
                                      host; not with draft_depth                       */
    const tl_grammar *grammar;     /* tokens constrained to this grammar (docs/api.md,
                                      "Grammars"); NULL = none (default). On the host;
                                      not with draft_depth                             */
    tl_exit_rule exit;             /* adaptive depth per token, the prompt's too; kind 0 =
                                      fixed (default). Not with draft_depth            */
    int32_t *token_depths;         /* out, or NULL: token_depths[k] = the depth of the pass
                                      that chose generated token k (capacity: max_tokens) */
} tl_generate_options;

typedef struct tl_generate_result {
    uint32_t struct_size;
    uint32_t n_tokens;             /* tokens written to the output buffer              */
    tl_stop_reason stop_reason;
    uint32_t n_prompt_tokens;
    double prefill_seconds;
    double decode_seconds;
    uint32_t n_drafted;            /* speculative: draft tokens verified               */
    uint32_t n_accepted;           /* speculative: of them, kept                       */
    uint32_t n_cached_tokens;      /* prompt tokens loaded from a prefix cache / pool  */
    double mean_depth;             /* mean loop depth of the passes that chose the tokens */
} tl_generate_result;

/* Return non-zero to stop generation (stop_reason = TL_STOP_ABORTED; status TL_OK). */
typedef int (*tl_token_callback)(int32_t token, void *user_data);

TL_API void tl_generate_options_default(tl_generate_options *opts);
TL_API void tl_generate_result_default(tl_generate_result *result);
/* Writes at most out_capacity tokens; max_tokens is clipped to out_capacity. */
TL_API tl_status tl_generate(tl_model *model, const int32_t *prompt, size_t n_prompt,
                             const tl_generate_options *opts, int32_t *out_tokens,
                             size_t out_capacity, tl_generate_result *result);
TL_API tl_status tl_context_generate(tl_context *ctx, const int32_t *prompt, size_t n_prompt,
                                     const tl_generate_options *opts, int32_t *out_tokens,
                                     size_t out_capacity, tl_generate_result *result);
TL_API tl_status tl_generate_stream(tl_model *model, const int32_t *prompt, size_t n_prompt,
                                    const tl_generate_options *opts, tl_token_callback callback,
                                    void *user_data, tl_generate_result *result);

/* Pull iterator: the stream owns a context of its own (or uses ctx when given; other
 * uses of ctx fail with TL_ERR_INVALID_ARGUMENT until the stream is freed, and freeing
 * ctx first ends the stream with TL_STOP_ABORTED). */
TL_API tl_status tl_stream_start(tl_model *model, tl_context *ctx, const int32_t *prompt,
                                 size_t n_prompt, const tl_generate_options *opts,
                                 tl_stream **out);
/* *token = next token, or -1 with *stop_reason set once the stream has ended. */
TL_API tl_status tl_stream_next(tl_stream *stream, int32_t *token, tl_stop_reason *stop_reason);
/* tl_stream_next for n streams of one model at once (distinct streams over distinct
 * contexts): tokens[i], stop_reasons[i] and statuses[i] are stream i's. The streams
 * whose next token takes one plain decode step share one batched forward pass
 * (tl_context_append_batch); the others (drafting, steps chained on a device, a token
 * already computed) step on their own. Returns TL_OK unless the arguments are invalid;
 * a stream's own failure is in statuses[i] (tl_last_error() holds the last message). */
TL_API tl_status tl_stream_next_batch(tl_stream *const *streams, size_t n, int32_t *tokens,
                                      tl_stop_reason *stop_reasons, tl_status *statuses);
TL_API tl_status tl_stream_result(const tl_stream *stream, tl_generate_result *result);
/* The log-probabilities of the token tl_stream_next returned last, for a stream started
 * with opts->logprobs = 1: *token_logprob (may be NULL) its own; top_ids and
 * top_logprobs (opts->top_logprobs entries each, or NULL when that is 0) the most likely
 * tokens of that step, as tl_score_top_logprobs orders them. TL_ERR_INVALID_ARGUMENT
 * for a stream without logprobs or before its first token. */
TL_API tl_status tl_stream_logprobs(const tl_stream *stream, float *token_logprob, int32_t *top_ids,
                                    float *top_logprobs);
/* The loop depth of the pass that chose the token tl_stream_next returned last (the
 * stream's depth, or where opts->exit stopped it). TL_ERR_INVALID_ARGUMENT before the
 * first token. */
TL_API tl_status tl_stream_token_depth(const tl_stream *stream, int32_t *depth);
TL_API tl_status tl_stream_free(tl_stream *stream);

/* One result per prompt (array stride = results[0].struct_size). Each prompt is a fresh
 * sequence; after their prefills, the decode steps of the sequences still going run
 * together as one batched forward pass (tl_context_append_batch), each sequence sampling
 * and stopping on its own (docs/api.md, "Batched decoding"). */
TL_API tl_status tl_generate_batch(tl_model *model, const int32_t *const *prompts,
                                   const size_t *prompt_lengths, size_t n_prompts,
                                   const tl_generate_options *opts, int32_t *const *out_tokens,
                                   size_t out_capacity, tl_generate_result *results);
/* tl_generate with opts->draft_depth and opts->n_draft set to these (draft_depth >= 1):
 * tokens drafted at a shallow loop depth and verified at the full one (greedy: plain
 * greedy decoding's tokens; sampling: plain sampling's distribution). */
TL_API tl_status tl_generate_speculative(tl_model *model, const int32_t *prompt, size_t n_prompt,
                                         const tl_generate_options *opts, int32_t draft_depth,
                                         int32_t n_draft, int32_t *out_tokens,
                                         size_t out_capacity, tl_generate_result *result);

/* tl_generate with opts->draft_depth, tree_widths (n_levels of them, at most
 * TL_TREE_MAX_LEVELS) and tree_budget set to these: tree speculation (greedy: plain
 * greedy decoding's tokens; sampling: plain sampling's distribution). */
TL_API tl_status tl_generate_tree_speculative(tl_model *model, const int32_t *prompt, size_t n_prompt,
                                              const tl_generate_options *opts, int32_t draft_depth,
                                              const int32_t *widths, size_t n_levels, int32_t budget,
                                              int32_t *out_tokens, size_t out_capacity,
                                              tl_generate_result *result);
/* ---- grammars (docs/api.md, "Grammars") ------------------------------------------
 * A GBNF grammar compiled against model's vocabulary: token_bytes[t] / token_lengths[t]
 * are the bytes of text token t stands for, one entry per vocabulary id (NULL or length
 * 0: never allowed, e.g. special tokens; a token may hold part of a character, as
 * byte-level vocabularies' do). Parse errors are TL_ERR_INVALID_ARGUMENT naming
 * the line and column. Immutable: several generations may use one at once; a generation
 * holds a reference, so tl_grammar_free may come before the generations using it end. tl_grammar_accepts: whether text (UTF-8, n bytes) is a sentence of it. */
TL_API tl_status tl_grammar_create(tl_model *model, const char *gbnf, const uint8_t *const *token_bytes,
                                   const size_t *token_lengths, tl_grammar **out);
TL_API tl_status tl_grammar_accepts(const tl_grammar *grammar, const char *text, size_t n, int *accepted);
TL_API tl_status tl_grammar_free(tl_grammar *grammar);

/* ---- prefix caches and pools (docs/api.md, "Prefix caches and pools") ------------
 * A prefix cache is an immutable snapshot of a sequence's first tokens (their KV in
 * every slot, the warm state init's states, kept loop states when the source context
 * keeps them): a context loaded from it continues exactly as one that appended those
 * tokens. Caches are reference counted and read-only, so several threads may load one
 * at once; each tl_prefix_cache_* that returns one gives the caller a reference that it
 * releases with tl_prefix_cache_free. Caches and pools must be freed before their model. */
TL_API tl_status tl_prefix_cache_create(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                        int32_t depth, tl_prefix_cache **out);
/* The first n_tokens of ctx's sequence (0 = all of it; at least 1 must be there). */
TL_API tl_status tl_prefix_cache_from_context(tl_context *ctx, size_t n_tokens,
                                              tl_prefix_cache **out);
TL_API tl_status tl_prefix_cache_free(tl_prefix_cache *cache);
/* Any pointer may be NULL. depth is 0 for a model without a loop. */
TL_API tl_status tl_prefix_cache_get_info(const tl_prefix_cache *cache, size_t *n_tokens,
                                          int32_t *depth, uint64_t *bytes);
/* The context's sequence becomes the cache's prefix (what it held is dropped). */
TL_API tl_status tl_context_load_prefix(tl_context *ctx, const tl_prefix_cache *cache);

typedef struct tl_prefix_pool_options {
    uint32_t struct_size;
    int32_t register_prompts;      /* 1: tl_generate_with_pool / tl_stream_start_with_pool
                                      add each prompt it computed beyond its match; default 0 */
    uint64_t max_bytes;            /* budget of the caches the pool holds, least recently
                                      used evicted first; 0 = no limit; default 256 MiB */
} tl_prefix_pool_options;

typedef struct tl_prefix_pool_stats {
    uint32_t struct_size;
    uint32_t n_prefixes;           /* caches held                                      */
    uint64_t bytes;                /* their bytes (at most max_bytes)                  */
    uint64_t max_bytes;
    uint64_t n_hits, n_misses;     /* lookups (and generations) with / without a match */
    uint64_t n_evicted;            /* caches evicted for the budget                    */
} tl_prefix_pool_stats;

TL_API void tl_prefix_pool_options_default(tl_prefix_pool_options *opts);
TL_API void tl_prefix_pool_stats_default(tl_prefix_pool_stats *stats);
TL_API tl_status tl_prefix_pool_create(tl_model *model, const tl_prefix_pool_options *opts,
                                       tl_prefix_pool **out);
/* Caches still in use by a generation or a caller's reference live until released. */
TL_API tl_status tl_prefix_pool_free(tl_prefix_pool *pool);
/* Compute tokens at depth and add them (a prefix already held is only marked used).
 * out (may be NULL) gets a reference to the pool's cache. */
TL_API tl_status tl_prefix_pool_add(tl_prefix_pool *pool, const int32_t *tokens, size_t n_tokens,
                                    int32_t depth, tl_prefix_cache **out);
/* Add an existing cache of the pool's model (the pool takes its own reference). */
TL_API tl_status tl_prefix_pool_add_cache(tl_prefix_pool *pool, tl_prefix_cache *cache);
/* The longest held prefix that the prompt starts with, computed at depth (0 = the
 * model's default): *out = a new reference and *n_matched its length, or NULL and 0. */
TL_API tl_status tl_prefix_pool_lookup(tl_prefix_pool *pool, const int32_t *prompt, size_t n_prompt,
                                       int32_t depth, tl_prefix_cache **out, size_t *n_matched);
TL_API tl_status tl_prefix_pool_get_stats(tl_prefix_pool *pool, tl_prefix_pool_stats *stats);
/* tl_generate on a context of its own, started from the pool's best match at
 * opts->depth (at most n_prompt - 1 of its tokens: the last prompt token is computed for
 * its logits); result->n_cached_tokens says how many came from the pool. Threads may
 * call it at once on one pool. */
TL_API tl_status tl_generate_with_pool(tl_model *model, tl_prefix_pool *pool, const int32_t *prompt,
                                       size_t n_prompt, const tl_generate_options *opts,
                                       int32_t *out_tokens, size_t out_capacity,
                                       tl_generate_result *result);
/* tl_stream_start (a context of its own) from the pool's best match, as above. */
TL_API tl_status tl_stream_start_with_pool(tl_model *model, tl_prefix_pool *pool,
                                           const int32_t *prompt, size_t n_prompt,
                                           const tl_generate_options *opts, tl_stream **out);

/* ---- resume handles (docs/api.md, "Resume handles") ----------------------------------
 * A resume handle is an immutable snapshot of a sequence's first tokens (their K/V and the
 * loop state each position ended with) taken from a context that keeps its loop states:
 * after a generation on it (which leaves the prompt and every generated token but the
 * last), or after appends. tl_resume_generate takes those tokens to a deeper loop depth
 * without a new prefill, continuing their loop from the kept states (the prelude and the
 * iterations already run are not repeated), then generates: the result is a fresh
 * generation at that depth of the handle's tokens followed by `prompt`. The handle does not
 * depend on its context (free or reuse it); threads may resume one handle at once; free
 * handles before their model. */
/* The first n_tokens of ctx's sequence (0 = all of it). ctx must keep its loop states
 * (tl_context_options.keep_loop_states) and hold at least one token; a model without a
 * loop is TL_ERR_UNSUPPORTED. */
TL_API tl_status tl_resume_create(tl_context *ctx, size_t n_tokens, tl_resume_handle **out);
/* Any pointer may be NULL: its tokens, their depth, the bytes it holds. */
TL_API tl_status tl_resume_get_info(const tl_resume_handle *handle, size_t *n_tokens, int32_t *depth,
                                    uint64_t *bytes);
/* tl_generate at loop depth `depth` (0 = the model's default; at least the handle's depth,
 * opts->depth is not read) of the handle's tokens then prompt[0..n_prompt) (n_prompt may be
 * 0: the first new token follows the handle's last one, from the deepened pass). On ctx
 * (which must keep its loop states; its sequence is replaced, and kept without a copy when it
 * already starts with the handle's tokens at the handle's depth) or, with ctx NULL, on a
 * context of its own. result->n_prompt_tokens counts the handle's tokens and the prompt's,
 * n_cached_tokens the handle's. Not with an exit rule (every position runs one depth). */
TL_API tl_status tl_resume_generate(tl_resume_handle *handle, tl_context *ctx, int32_t depth,
                                    const int32_t *prompt, size_t n_prompt,
                                    const tl_generate_options *opts, int32_t *out_tokens,
                                    size_t out_capacity, tl_generate_result *result);
/* tl_resume_generate as a pull iterator (tl_stream_start's rules for ctx and the stream). */
TL_API tl_status tl_resume_stream_start(tl_resume_handle *handle, tl_context *ctx, int32_t depth,
                                        const int32_t *prompt, size_t n_prompt,
                                        const tl_generate_options *opts, tl_stream **out);
TL_API tl_status tl_resume_free(tl_resume_handle *handle);

/* TL_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* TINYLOOP_TINYLOOP_H */
