/* context_state.h — struct tl_context, the mutable state of one sequence: written by
 * context.c (which owns its lifetime), read by the forward pass (forward.c). */
#ifndef TL_CONTEXT_STATE_H
#define TL_CONTEXT_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "model/kv_policy.h"
#include "model/model.h"
#include "runtime/kv_cache.h"

struct tl_stream;   /* generate.h */

struct tl_context {
    struct tl_model *model;
    tl_backend *be;
    tl_exec *ex;
    int max_seq;          /* positions this context can hold (a cache window's:
                             TL_CACHE_WINDOW_MAX_POS) */
    int max_depth;        /* deepest loop depth it caches (0 without a core) */
    int chunk_rows;       /* prefill chunk: rows per forward call */
    int logit_rows;       /* rows of logits computed at once when scoring */
    int depth;            /* the sequence's depth; 0 until its first append */
    size_t n_tokens;      /* length of the sequence */
    int32_t *tokens;      /* the sequence's tokens (token_cap: max_seq, or with a cache
                             window as many as the sequence needs, grown as it does) */
    size_t token_cap;
    tl_cache_window window;   /* the KV ring's (kv_policy.h); size 0 = a full cache */
    tl_kv_cache kv;
    tl_kv_choice kv_policy;   /* how iterations share the loop's K/V slots */
    int loop_slots;           /* K/V slots per core block (tl_kv_loop_slots) */
    tl_state_init state_init; /* where each position's loop starts (the file's or warm) */
    tl_buf *block_in;         /* kv_policy store_h: the input of core block c at iteration i
                                 of every position, [(i - 1) * n_core + c][max_seq][d], from
                                 which its K/V are recomputed into the block's one slot when
                                 attended; or NULL */

    /* activation buffers of chunk_rows rows (docs/api.md, "Memory") */
    tl_buf *h;            /* hidden state / loop state, [rows, d] */
    tl_buf *e;            /* injection source, [rows, d] */
    tl_buf *xn;           /* normed input of a sub-layer, [rows, d] */
    tl_buf *tmp;          /* sub-layer output, [rows, d] */
    tl_buf *q, *att;      /* queries and attention output, [rows, h * hd] */
    tl_buf *kv_new;       /* new keys [rows, kv_dim], then new values [rows, kv_dim] */
    tl_buf *gate, *up;    /* MLP, [rows, f] */
    tl_buf *cat;          /* concat injection input [s ; e], [rows, 2d]; or NULL */
    tl_buf *logits;       /* [logit_rows, V] */
    tl_buf *warm;         /* warm init: final loop state of every position, [max_seq, d];
                             allocated exactly when state_init is warm */
    tl_buf *loop_e, *loop_s;  /* kept loop states (tl_context_keep_loop_states): every
                                 position's injection source and its state after the
                                 sequence's last iteration, [max_seq, d] each; or NULL */

    uint64_t buffer_bytes, kv_bytes;   /* as added to the model's stats */
    struct tl_stream *stream;   /* the generation stream over it while one is open: other
                                   uses of the context are refused until it ends
                                   (generate.c may have a step run ahead in it) */
};

#endif
