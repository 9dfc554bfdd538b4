/* test_api.c — the public C ABI on real model files: scoring equals cached decode,
 * chunked prefill equals one-shot, generation is deterministic and stops where it
 * should, the stream iterator and callbacks behave, bad input gives clear errors,
 * one model serves two threads with identical results, metadata enumerates, log
 * messages reach the callback, and a backend of another build is refused.
 *
 * usage: test_api MODEL.tinyloop [MODEL.tinyloop ...]
 * Last line: "test_api: N passed, M failed". */
#include <math.h>
#include <stddef.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tinyloop/tinyloop.h"
/* internal: the log (tl_log) and the backend handshake */
#include "backend/backend.h"
#include "cpu/backend_cpu.h"
#include "base/log.h"

static int n_passed, n_failed;
static const char *current_model;

#define CHECK(cond, ...)                                                          \
    do {                                                                          \
        if (cond) {                                                               \
            n_passed++;                                                           \
        } else {                                                                  \
            n_failed++;                                                           \
            fprintf(stderr, "FAIL %s:%d [%s] ", __FILE__, __LINE__, current_model); \
            fprintf(stderr, __VA_ARGS__);                                         \
            fprintf(stderr, " (last error: %s)\n", tl_last_error());              \
        }                                                                         \
    } while (0)

#define CHECK_OK(expr) CHECK((expr) == TL_OK, "%s", #expr)
#define CHECK_STATUS(expr, want) \
    CHECK((expr) == (want), "%s should give %s", #expr, tl_status_name(want))

#define N_TOK 20
#define MAX_SEQ 48

typedef struct fixture {
    tl_model *model;
    int paged;   /* kv_page_size > 0: the KV bytes are the pool's (pages counted once) */
    tl_model_info info;
    int32_t tokens[N_TOK];
} fixture;

static float max_abs_diff(const float *a, const float *b, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        if (!(d <= m)) m = d;   /* NaN counts as a difference */
    }
    return m;
}

static float log_softmax_at(const float *x, int n, int index) {
    float mx = x[0];
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((double)(x[i] - mx));
    return (float)(x[index] - mx - log(sum));
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static tl_context *new_context(tl_model *model, int32_t prefill_chunk) {
    tl_context_options o;
    tl_context_options_default(&o);
    o.prefill_chunk = prefill_chunk;
    tl_context *ctx = NULL;
    if (tl_context_create(model, &o, &ctx) != TL_OK) return NULL;
    return ctx;
}

static tl_generate_options greedy_options(int32_t max_tokens) {
    tl_generate_options o;
    tl_generate_options_default(&o);
    o.temperature = 0.0f;
    o.max_tokens = max_tokens;
    o.eos_token = -2;
    return o;
}

/* ---- scoring ----------------------------------------------------------------- */

static void test_score_equals_decode(fixture *f) {
    int V = f->info.vocab_size;
    float lp[N_TOK - 1];
    CHECK_OK(tl_score(f->model, f->tokens, N_TOK, NULL, lp));
    tl_context *ctx = new_context(f->model, 0);
    CHECK(ctx != NULL, "context create");
    if (!ctx) return;
    float *logits = malloc((size_t)V * sizeof *logits);
    float worst = 0.0f;
    for (int i = 0; i < N_TOK - 1; i++) {
        CHECK_OK(tl_context_append(ctx, &f->tokens[i], 1, 0, logits));
        float d = fabsf(log_softmax_at(logits, V, f->tokens[i + 1]) - lp[i]);
        worst = d > worst ? d : worst;
    }
    CHECK(worst < 1e-3f, "cached decode logprobs differ from scoring by %g", worst);
    size_t len = 0;
    CHECK_OK(tl_context_length(ctx, &len));
    CHECK(len == N_TOK - 1, "context length %zu, expected %d", len, N_TOK - 1);
    free(logits);
    tl_context_free(ctx);
}

/* Scoring with uncertainty: the same log-probs as tl_score, entropies in [0, log V]. */
static void test_score_with_uncertainty(fixture *f) {
    float lp[N_TOK - 1], lp2[N_TOK - 1], ent[N_TOK - 1];
    CHECK_OK(tl_score(f->model, f->tokens, N_TOK, NULL, lp));
    CHECK_OK(tl_score_with_uncertainty(f->model, f->tokens, N_TOK, NULL, lp2, ent));
    CHECK(memcmp(lp, lp2, sizeof lp) == 0, "log-probs differ from tl_score's");
    for (int i = 0; i < N_TOK - 1; i++)
        CHECK(ent[i] >= -1e-5f && ent[i] <= logf((float)f->info.vocab_size) + 1e-4f,
              "entropy %g at %d out of [0, log V]", ent[i], i);
    CHECK_STATUS(tl_score_with_uncertainty(f->model, f->tokens, N_TOK, NULL, lp2, NULL),
                 TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_score_with_uncertainty(NULL, f->tokens, N_TOK, NULL, lp2, ent),
                 TL_ERR_INVALID_ARGUMENT);
}

/* Log-probabilities: tl_score_top_logprobs keeps tl_score's log-probs and ranks each
 * position's tokens; a stream with logprobs gives the greedy tokens of one without and,
 * per token, its log-probability (that of scoring the generated sequence) and the top
 * tokens, the greedy token first. */
static void test_logprobs(fixture *f) {
    enum { K = 3, NEW = 6 };
    float lp[N_TOK - 1], lp2[N_TOK - 1], top_lp[(N_TOK - 1) * K];
    int32_t top_ids[(N_TOK - 1) * K];
    CHECK_OK(tl_score(f->model, f->tokens, N_TOK, NULL, lp));
    CHECK_OK(tl_score_top_logprobs(f->model, f->tokens, N_TOK, NULL, K, lp2, top_ids, top_lp));
    CHECK(memcmp(lp, lp2, sizeof lp) == 0, "log-probs differ from tl_score's");
    for (int i = 0; i < N_TOK - 1; i++) {
        CHECK(top_lp[i * K] >= top_lp[i * K + 1] && top_lp[i * K + 1] >= top_lp[i * K + 2],
              "row %d is not best first", i);
        CHECK(lp[i] <= top_lp[i * K] + 1e-5f, "row %d: a token above the best", i);
    }
    CHECK_STATUS(tl_score_top_logprobs(f->model, f->tokens, N_TOK, NULL, 0, lp2, top_ids, top_lp),
                 TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_score_top_logprobs(f->model, f->tokens, N_TOK, NULL, K, lp2, NULL, top_lp),
                 TL_ERR_INVALID_ARGUMENT);

    tl_generate_options o = greedy_options(NEW);
    int32_t plain[NEW], seq[8 + NEW];
    CHECK_OK(tl_generate(f->model, f->tokens, 8, &o, plain, NEW, NULL));
    o.logprobs = 1;
    o.top_logprobs = K;
    tl_stream *s = NULL;
    CHECK_OK(tl_stream_start(f->model, NULL, f->tokens, 8, &o, &s));
    float token_lp[NEW], step_lp[K];
    int32_t step_ids[K];
    CHECK_STATUS(tl_stream_logprobs(s, token_lp, step_ids, step_lp), TL_ERR_INVALID_ARGUMENT);
    memcpy(seq, f->tokens, 8 * sizeof *seq);
    for (int i = 0; s && i < NEW; i++) {
        int32_t t = -1;
        CHECK_OK(tl_stream_next(s, &t, NULL));
        CHECK(t == plain[i], "token %d: %d with logprobs, %d without", i, t, plain[i]);
        seq[8 + i] = t;
        CHECK_OK(tl_stream_logprobs(s, &token_lp[i], step_ids, step_lp));
        CHECK(step_ids[0] == t && step_lp[0] == token_lp[i], "step %d: greedy token not first", i);
        CHECK_STATUS(tl_stream_logprobs(s, &token_lp[i], NULL, NULL), TL_ERR_INVALID_ARGUMENT);
    }
    tl_stream_free(s);
    float scored[8 + NEW - 1];
    CHECK_OK(tl_score(f->model, seq, 8 + NEW, NULL, scored));
    CHECK(max_abs_diff(token_lp, scored + 7, NEW) < 1e-4f, "stream logprobs differ from scoring by %g",
          max_abs_diff(token_lp, scored + 7, NEW));
    /* EOS is never returned, so its step's log-probabilities are not the last returned
     * token's: after EOS the call still reports that token's, and a stream that ends
     * with EOS at once has returned no token */
    o.eos_token = plain[2];
    o.top_logprobs = 0;
    int eos_at = 0;
    while (eos_at < 2 && plain[eos_at] != plain[2]) eos_at++;
    CHECK_OK(tl_stream_start(f->model, NULL, f->tokens, 8, &o, &s));
    for (int i = 0; s && i <= eos_at; i++) {
        int32_t t = 0;
        tl_stop_reason why = TL_STOP_NONE;
        CHECK_OK(tl_stream_next(s, &t, &why));
        float got = 0.0f;
        if (i < eos_at) {
            CHECK_OK(tl_stream_logprobs(s, &got, NULL, NULL));
            CHECK(got == token_lp[i], "token %d: log-prob %g, %g before", i, got, token_lp[i]);
        } else if (eos_at > 0) {
            CHECK(t == -1 && why == TL_STOP_EOS, "no EOS at step %d", i);
            CHECK_OK(tl_stream_logprobs(s, &got, NULL, NULL));
            CHECK(got == token_lp[i - 1], "after EOS: log-prob %g, not the last token's %g", got,
                  token_lp[i - 1]);
        } else {
            CHECK(t == -1 && why == TL_STOP_EOS, "no EOS at the first step");
            CHECK_STATUS(tl_stream_logprobs(s, &got, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
        }
    }
    tl_stream_free(s);
    o.eos_token = plain[0];   /* the first step is EOS: no token was returned */
    CHECK_OK(tl_stream_start(f->model, NULL, f->tokens, 8, &o, &s));
    if (s) {
        int32_t t = 0;
        float got = 0.0f;
        CHECK_OK(tl_stream_next(s, &t, NULL));
        CHECK(t == -1, "EOS first: token %d returned", t);
        CHECK_STATUS(tl_stream_logprobs(s, &got, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
    }
    tl_stream_free(s);
    o.eos_token = -2;
    o.top_logprobs = K;
    o.draft_depth = f->info.max_depth > 0 ? 1 : 0;
    if (o.draft_depth) CHECK_STATUS(tl_stream_start(f->model, NULL, f->tokens, 8, &o, &s), TL_ERR_UNSUPPORTED);
    o.draft_depth = 0;
    o.logprobs = 0;
    CHECK_STATUS(tl_stream_start(f->model, NULL, f->tokens, 8, &o, &s), TL_ERR_INVALID_ARGUMENT);
}

/* Logit adjustments: a bias of -100 on the greedy first token moves generation off it,
 * penalties run over a whole generation, and a token listed twice is refused. */
static void test_logit_adjustments(fixture *f) {
    enum { NEW = 8 };
    tl_generate_options o = greedy_options(NEW);
    int32_t plain[NEW], got[NEW];
    CHECK_OK(tl_generate(f->model, f->tokens, 8, &o, plain, NEW, NULL));
    int32_t ids[2] = { plain[0], plain[0] };
    float values[2] = { -100.0f, 1.0f };
    o.logit_bias_ids = ids;
    o.logit_bias_values = values;
    o.n_logit_bias = 1;
    CHECK_OK(tl_generate(f->model, f->tokens, 8, &o, got, NEW, NULL));
    CHECK(got[0] != plain[0], "a -100 bias kept token %d first", plain[0]);
    o.n_logit_bias = 2;
    CHECK_STATUS(tl_generate(f->model, f->tokens, 8, &o, got, NEW, NULL), TL_ERR_INVALID_ARGUMENT);
    o.n_logit_bias = 0;
    o.presence_penalty = 1.0f;
    o.frequency_penalty = 0.5f;
    o.temperature = 0.7f;
    CHECK_OK(tl_generate(f->model, f->tokens, 8, &o, got, NEW, NULL));
    o.frequency_penalty = 3.0f;
    CHECK_STATUS(tl_generate(f->model, f->tokens, 8, &o, got, NEW, NULL), TL_ERR_INVALID_ARGUMENT);
}

/* Grammars: a parse error names its place, whole strings are matched, a generation
 * spells a sentence and ends when the grammar is complete (as at an EOS), a dead end
 * stops with TL_STOP_GRAMMAR, drafts are refused; a character cut over two tokens comes
 * out whole, or ends in a dead end when no token finishes it; text that is not UTF-8 is
 * refused. Token t < 26 is the letter 'a' + t, token 26 "ab", tokens 27 and 28 the two
 * bytes of U+00E9; the others have no bytes. */
static void test_grammar(fixture *f) {
    int V = f->info.vocab_size;
    if (V < 29) return;
    enum { NEW = 12 };
    uint8_t letters[29][2];
    const uint8_t **bytes = calloc((size_t)V, sizeof *bytes);
    size_t *lengths = calloc((size_t)V, sizeof *lengths);
    for (int t = 0; t < 26; t++) {
        letters[t][0] = (uint8_t)('a' + t);
        bytes[t] = letters[t];
        lengths[t] = 1;
    }
    letters[26][0] = 'a';
    letters[26][1] = 'b';
    letters[27][0] = 0xC3;
    letters[28][0] = 0xA9;
    bytes[26] = letters[26];
    bytes[27] = letters[27];
    bytes[28] = letters[28];
    lengths[26] = 2;
    lengths[27] = 1;
    lengths[28] = 1;
    tl_grammar *g = NULL;
    CHECK_STATUS(tl_grammar_create(f->model, "root ::= \"ab\" (", bytes, lengths, &g), TL_ERR_INVALID_ARGUMENT);
    CHECK(g == NULL && strstr(tl_last_error(), "line 1 column 16"), "parse error: %s", tl_last_error());
    CHECK_STATUS(tl_grammar_create(f->model, "root ::= \"a\"", NULL, lengths, &g), TL_ERR_INVALID_ARGUMENT);
    CHECK_OK(tl_grammar_create(f->model, "root ::= \"ab\" [cd]? \"e\"  # abe, abce, abde", bytes, lengths, &g));
    int ok = -1;
    CHECK_OK(tl_grammar_accepts(g, "abce", 4, &ok));
    CHECK(ok == 1, "abce not accepted");
    CHECK_OK(tl_grammar_accepts(g, "abc", 3, &ok));
    CHECK(ok == 0, "abc accepted");
    static const char *not_utf8[] = { "ab\xC3", "ab\x80" "e", "ab\xED\xA0\x80" "e", "ab\xC0\xAF" "e",
                                      "ab\xF4\x90\x80\x80" };
    for (size_t i = 0; i < sizeof not_utf8 / sizeof *not_utf8; i++) {
        CHECK_STATUS(tl_grammar_accepts(g, not_utf8[i], strlen(not_utf8[i]), &ok), TL_ERR_INVALID_ARGUMENT);
        CHECK(strstr(tl_last_error(), "not UTF-8 at byte 2"), "text %zu: %s", i, tl_last_error());
    }
    tl_generate_options o = greedy_options(NEW);
    o.grammar = g;
    o.eos_token = -2;
    int32_t out[NEW];
    tl_generate_result r;
    tl_generate_result_default(&r);
    CHECK_OK(tl_generate(f->model, f->tokens, 8, &o, out, NEW, &r));
    char text[2 * NEW + 1];
    size_t n = 0;
    for (uint32_t i = 0; i < r.n_tokens; i++) {
        memcpy(text + n, bytes[out[i]], lengths[out[i]]);
        n += lengths[out[i]];
    }
    text[n] = 0;
    CHECK(r.stop_reason == TL_STOP_EOS && (!strcmp(text, "abe") || !strcmp(text, "abce") || !strcmp(text, "abde")),
          "grammar generation gave \"%s\", stop reason %d", text, (int)r.stop_reason);
    uint32_t n_sentence = r.n_tokens;
    o.draft_depth = f->info.max_depth > 0 ? 1 : 0;
    if (o.draft_depth) CHECK_STATUS(tl_generate(f->model, f->tokens, 8, &o, out, NEW, &r), TL_ERR_UNSUPPORTED);
    o.draft_depth = 0;
    /* a stream keeps the grammar alive past the caller's free */
    tl_stream *s = NULL;
    CHECK_OK(tl_stream_start(f->model, NULL, f->tokens, 8, &o, &s));
    CHECK_OK(tl_grammar_free(g));
    int32_t t = 0;
    size_t n_streamed = 0;
    while (s && tl_stream_next(s, &t, NULL) == TL_OK && t >= 0) n_streamed++;
    CHECK(n_streamed == n_sentence, "stream after the grammar's free: %zu tokens, %u generated", n_streamed,
          n_sentence);
    tl_stream_free(s);
    /* U+00E9 out of its two bytes, and U+00FC, whose second byte no token holds, and
     * U+20AC, whose first none does: dead ends after one token and at once */
    static const struct { const char *gbnf; uint32_t n_tokens; tl_stop_reason stop; } cut[] = {
        { "root ::= \"\u00e9\"", 2, TL_STOP_EOS },
        { "root ::= \"\u00fc\"", 1, TL_STOP_GRAMMAR },
        { "root ::= \"\u20ac\"", 0, TL_STOP_GRAMMAR },
    };
    for (size_t i = 0; i < sizeof cut / sizeof *cut; i++) {
        CHECK_OK(tl_grammar_create(f->model, cut[i].gbnf, bytes, lengths, &g));
        o.grammar = g;
        CHECK_OK(tl_generate(f->model, f->tokens, 8, &o, out, NEW, &r));
        CHECK(r.n_tokens == cut[i].n_tokens && r.stop_reason == cut[i].stop && (r.n_tokens < 1 || out[0] == 27) &&
              (r.n_tokens < 2 || out[1] == 28), "%s: %u tokens, stop reason %d", cut[i].gbnf, r.n_tokens,
              (int)r.stop_reason);
        CHECK_OK(tl_grammar_free(g));
    }
    CHECK_OK(tl_grammar_free(NULL));
    free(bytes);
    free(lengths);
}

/* Consistency escalation: the arrays of tl_score_with_uncertainty at the depth it stops
 * at, that depth within [min, max] and on the doubling schedule; option errors. */
static void test_consistency_escalation(fixture *f) {
    float lp[N_TOK - 1], ent[N_TOK - 1], lp2[N_TOK - 1], ent2[N_TOK - 1];
    int32_t depth = -1;
    tl_escalation_options eo;
    tl_escalation_options_default(&eo);
    if (f->info.n_core == 0) {
        CHECK_STATUS(tl_score_with_consistency_escalation(f->model, f->tokens, N_TOK, &eo, lp, ent, &depth),
                     TL_ERR_UNSUPPORTED);
        return;
    }
    for (int k = 0; k < 3; k++) {
        const float shares[3] = {0.0f, 0.3f, 1.0f};
        eo.max_changed = shares[k];
        eo.max_depth = f->info.max_depth;
        CHECK_OK(tl_score_with_consistency_escalation(f->model, f->tokens, N_TOK, &eo, lp, ent, &depth));
        int on_schedule = depth == f->info.max_depth || depth == 2 || depth == 4 || depth == 8 ||
                          depth == 16 || depth == 32;
        CHECK(on_schedule && depth >= (f->info.max_depth < 2 ? 1 : 2) && depth <= f->info.max_depth,
              "depth %d is not 1, 2, 4, ... capped at %d", depth, f->info.max_depth);
        if (k == 2) CHECK(depth == (f->info.max_depth < 2 ? f->info.max_depth : 2), "a share of 1 stops at 2");
        tl_score_options so;
        tl_score_options_default(&so);
        so.depth = depth;
        CHECK_OK(tl_score_with_uncertainty(f->model, f->tokens, N_TOK, &so, lp2, ent2));
        CHECK(memcmp(lp, lp2, sizeof lp) == 0 && memcmp(ent, ent2, sizeof ent) == 0,
              "arrays differ from tl_score_with_uncertainty's at depth %d", depth);
    }
    tl_escalation_options_default(&eo);
    eo.min_depth = 0;
    CHECK_STATUS(tl_score_with_consistency_escalation(f->model, f->tokens, N_TOK, &eo, lp, ent, &depth),
                 TL_ERR_INVALID_ARGUMENT);
    tl_escalation_options_default(&eo);
    eo.max_depth = f->info.max_depth + 1;
    CHECK_STATUS(tl_score_with_consistency_escalation(f->model, f->tokens, N_TOK, &eo, lp, ent, &depth),
                 TL_ERR_INVALID_ARGUMENT);
    tl_escalation_options_default(&eo);
    eo.max_changed = NAN;
    CHECK_STATUS(tl_score_with_consistency_escalation(f->model, f->tokens, N_TOK, &eo, lp, ent, &depth),
                 TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_score_with_consistency_escalation(f->model, f->tokens, N_TOK, NULL, lp, ent, NULL),
                 TL_ERR_INVALID_ARGUMENT);
}

static void test_chunked_prefill(fixture *f) {
    int V = f->info.vocab_size;
    float *one = malloc((size_t)V * sizeof *one), *chunked = malloc((size_t)V * sizeof *chunked);
    float lp_one[N_TOK - 1], lp_chunked[N_TOK - 1];
    tl_context *a = new_context(f->model, 0), *b = new_context(f->model, 3);
    CHECK(a && b, "context create");
    if (a && b) {
        CHECK_OK(tl_context_score_last_token(a, f->tokens, N_TOK, NULL, one));
        CHECK_OK(tl_context_score_last_token(b, f->tokens, N_TOK, NULL, chunked));
        CHECK(max_abs_diff(one, chunked, (size_t)V) < 1e-4f, "chunked prefill logits differ by %g",
              max_abs_diff(one, chunked, (size_t)V));
        tl_context_reset(a);
        tl_context_reset(b);
        CHECK_OK(tl_context_score(a, f->tokens, N_TOK, NULL, lp_one));
        CHECK_OK(tl_context_score(b, f->tokens, N_TOK, NULL, lp_chunked));
        CHECK(max_abs_diff(lp_one, lp_chunked, N_TOK - 1) < 1e-4f, "chunked scoring differs by %g",
              max_abs_diff(lp_one, lp_chunked, N_TOK - 1));
    }
    tl_context_free(a);
    tl_context_free(b);
    free(one);
    free(chunked);
}

/* truncate then re-append, and fork then continue: both reproduce the same logits */
static void test_truncate_and_fork(fixture *f) {
    int V = f->info.vocab_size;
    float *ref = malloc((size_t)V * sizeof *ref), *got = malloc((size_t)V * sizeof *got);
    tl_context *ctx = new_context(f->model, 0), *fork = NULL;
    CHECK(ctx != NULL, "context create");
    if (ctx) {
        CHECK_OK(tl_context_append(ctx, f->tokens, N_TOK, 0, ref));
        CHECK_OK(tl_context_truncate(ctx, 8));
        CHECK_OK(tl_context_append(ctx, f->tokens + 8, N_TOK - 8, 0, got));
        CHECK(max_abs_diff(ref, got, (size_t)V) < 1e-4f, "truncate + re-append differs by %g",
              max_abs_diff(ref, got, (size_t)V));
        CHECK_STATUS(tl_context_truncate(ctx, N_TOK + 1), TL_ERR_INVALID_ARGUMENT);

        CHECK_OK(tl_context_truncate(ctx, N_TOK - 1));
        CHECK_OK(tl_context_fork(ctx, &fork));
        if (fork) {
            CHECK_OK(tl_context_append(fork, &f->tokens[N_TOK - 1], 1, 0, got));
            CHECK(max_abs_diff(ref, got, (size_t)V) < 1e-4f, "forked context differs by %g",
                  max_abs_diff(ref, got, (size_t)V));
        }
    }
    tl_context_free(fork);
    tl_context_free(ctx);
    free(ref);
    free(got);
}

/* A batched decode step gives each sequence the logits of its own one-token append;
 * a refused batch (a full context, the same context twice, a bad token) changes none. */
static void test_append_batch(fixture *f) {
    int V = f->info.vocab_size;
    float *ref = malloc(2 * (size_t)V * sizeof *ref), *got = malloc(2 * (size_t)V * sizeof *got);
    tl_context *a = new_context(f->model, 0), *b = new_context(f->model, 0), *solo = new_context(f->model, 0);
    CHECK(a && b && solo, "context create");
    if (a && b && solo) {
        CHECK_OK(tl_context_append(solo, f->tokens, 4, 0, NULL));
        CHECK_OK(tl_context_append(solo, f->tokens + 4, 1, 0, ref));
        CHECK_OK(tl_context_reset(solo));
        CHECK_OK(tl_context_append(solo, f->tokens, 9, 0, NULL));
        CHECK_OK(tl_context_append(solo, f->tokens + 9, 1, 0, ref + V));
        CHECK_OK(tl_context_append(a, f->tokens, 4, 0, NULL));
        CHECK_OK(tl_context_append(b, f->tokens, 9, 0, NULL));
        tl_context *pair[2] = { a, b }, *twice[2] = { a, a };
        int32_t next[2] = { f->tokens[4], f->tokens[9] }, bad[2] = { f->tokens[4], V };
        CHECK_STATUS(tl_context_append_batch(twice, next, 2, got), TL_ERR_INVALID_ARGUMENT);
        CHECK_STATUS(tl_context_append_batch(pair, bad, 2, got), TL_ERR_INVALID_ARGUMENT);
        CHECK_STATUS(tl_context_append_batch(NULL, next, 2, got), TL_ERR_INVALID_ARGUMENT);
        size_t la = 0, lb = 0;
        CHECK_OK(tl_context_length(a, &la));
        CHECK_OK(tl_context_length(b, &lb));
        CHECK(la == 4 && lb == 9, "a refused batch changed the lengths: %zu, %zu", la, lb);
        CHECK_OK(tl_context_append_batch(pair, next, 2, got));
        CHECK(max_abs_diff(ref, got, 2 * (size_t)V) < 1e-4f, "batched step differs by %g",
              max_abs_diff(ref, got, 2 * (size_t)V));
        CHECK_OK(tl_context_length(a, &la));
        CHECK_OK(tl_context_length(b, &lb));
        CHECK(la == 5 && lb == 10, "batched step lengths: %zu, %zu", la, lb);
        CHECK_OK(tl_context_append_batch(pair, next, 0, NULL));
    }
    tl_context_free(a);
    tl_context_free(b);
    tl_context_free(solo);
    free(ref);
    free(got);
}

/* A context that keeps its loop states continues its sequence at a deeper depth: the
 * same logits and log-probs (bit for bit on the CPU) as the sequence appended at that
 * depth from the start, over several chunks, after a fork, and decoding goes on from it.
 * A first-release tl_context_options (before keep_loop_states) still creates contexts. */
static tl_context *keeping_context(tl_model *model, int32_t prefill_chunk) {
    tl_context_options o;
    tl_context_options_default(&o);
    o.prefill_chunk = prefill_chunk;
    o.keep_loop_states = 1;
    tl_context *ctx = NULL;
    return tl_context_create(model, &o, &ctx) == TL_OK ? ctx : NULL;
}

static void test_deepen(fixture *f) {
    int V = f->info.vocab_size, top = f->info.max_depth;
    tl_context_options first;
    tl_context_options_default(&first);
    first.struct_size = (uint32_t)offsetof(tl_context_options, keep_loop_states);
    tl_context *old = NULL;
    CHECK_OK(tl_context_create(f->model, &first, &old));
    tl_context_free(old);
    if (f->info.n_core == 0) {
        tl_context_options o;
        tl_context_options_default(&o);
        o.keep_loop_states = 1;
        tl_context *none = NULL;
        CHECK_STATUS(tl_context_create(f->model, &o, &none), TL_ERR_UNSUPPORTED);
        CHECK(none == NULL, "no context on failure");
        return;
    }
    float *ref = malloc((size_t)V * sizeof *ref), *got = malloc((size_t)V * sizeof *got);
    float lp_ref[N_TOK - 1], lp_got[N_TOK - 1];
    tl_context *plain = new_context(f->model, 3), *ctx = keeping_context(f->model, 3), *fork = NULL;
    CHECK(plain && ctx, "context create");
    if (plain && ctx) {
        tl_score_options so;
        tl_score_options_default(&so);
        so.depth = top;
        CHECK_OK(tl_context_score(plain, f->tokens, N_TOK, &so, lp_ref));
        tl_context_reset(plain);
        CHECK_OK(tl_context_append(plain, f->tokens, N_TOK, top, ref));

        CHECK_STATUS(tl_context_deepen(ctx, top, NULL, got), TL_ERR_INVALID_ARGUMENT);  /* empty */
        CHECK_OK(tl_context_append(ctx, f->tokens, N_TOK, 1, NULL));
        CHECK_OK(tl_context_deepen(ctx, 2, NULL, NULL));
        CHECK_STATUS(tl_context_deepen(ctx, 1, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
        CHECK_STATUS(tl_context_deepen(ctx, top + 1, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
        CHECK_OK(tl_context_fork(ctx, &fork));
        CHECK_OK(tl_context_deepen(ctx, top, lp_got, got));
        CHECK(memcmp(ref, got, (size_t)V * sizeof *ref) == 0, "deepened logits differ by %g",
              max_abs_diff(ref, got, (size_t)V));
        CHECK(memcmp(lp_ref, lp_got, sizeof lp_ref) == 0, "deepened log-probs differ by %g",
              max_abs_diff(lp_ref, lp_got, N_TOK - 1));
        if (fork) {
            CHECK_OK(tl_context_deepen(fork, top, NULL, got));
            CHECK(memcmp(ref, got, (size_t)V * sizeof *ref) == 0, "a fork deepens differently");
        }
        /* decoding goes on at the new depth as on the sequence run at it from the start */
        CHECK_OK(tl_context_append(plain, f->tokens, 2, 0, ref));
        CHECK_OK(tl_context_append(ctx, f->tokens, 2, 0, got));
        CHECK(memcmp(ref, got, (size_t)V * sizeof *ref) == 0, "decoding after deepening differs by %g",
              max_abs_diff(ref, got, (size_t)V));
    }
    CHECK_STATUS(tl_context_deepen(plain, top, NULL, NULL), TL_ERR_INVALID_ARGUMENT);  /* not kept */
    CHECK_STATUS(tl_context_deepen(NULL, top, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
    tl_context_free(fork);
    tl_context_free(ctx);
    tl_context_free(plain);
    free(ref);
    free(got);
}

/* ---- generation --------------------------------------------------------------- */

/* A resume handle of a generation's prompt, taken deeper with no prompt of its own: the
 * tokens of a fresh generation at the deeper depth, on a context of its own and on one
 * that keeps its states, by the buffer and the stream forms. */
static void test_resume(fixture *f) {
    enum { N = 5, P = 6 };
    int top = f->info.max_depth;
    tl_context *plain = new_context(f->model, 0);
    tl_resume_handle *h = NULL;
    if (f->info.n_core == 0) {
        tl_context_append(plain, f->tokens, P, 0, NULL);
        CHECK_STATUS(tl_resume_create(plain, 0, &h), TL_ERR_UNSUPPORTED);
        CHECK(h == NULL, "no handle on failure");
        tl_context_free(plain);
        return;
    }
    tl_context *ctx = keeping_context(f->model, 4);
    int32_t shallow[N], expected[N], got[N];
    tl_generate_options o = greedy_options(N);
    tl_generate_result r;
    tl_generate_result_default(&r);
    o.depth = top;
    CHECK_OK(tl_generate(f->model, f->tokens, P, &o, expected, N, &r));
    o.depth = 1;
    CHECK_OK(tl_context_generate(ctx, f->tokens, P, &o, shallow, N, &r));
    CHECK_STATUS(tl_resume_create(plain, 0, &h), TL_ERR_INVALID_ARGUMENT);   /* no kept states */
    CHECK_STATUS(tl_resume_create(ctx, 100, &h), TL_ERR_INVALID_ARGUMENT);
    CHECK_OK(tl_resume_create(ctx, P, &h));
    size_t n = 0;
    int32_t depth = 0;
    CHECK_OK(tl_resume_get_info(h, &n, &depth, NULL));
    CHECK(n == P && depth == 1, "handle of %zu tokens at depth %d", n, depth);
    o.depth = 0;   /* not read */
    CHECK_OK(tl_resume_generate(h, NULL, top, NULL, 0, &o, got, N, &r));
    CHECK(memcmp(got, expected, sizeof got) == 0 && r.n_prompt_tokens == P && r.n_cached_tokens == P,
          "resumed on a context of its own: tokens differ (prompt %u, cached %u)", r.n_prompt_tokens,
          r.n_cached_tokens);
    CHECK_OK(tl_resume_generate(h, ctx, top, NULL, 0, &o, got, N, &r));
    CHECK(memcmp(got, expected, sizeof got) == 0, "resumed on its own context: tokens differ");
    tl_stream *s = NULL;
    CHECK_OK(tl_resume_stream_start(h, NULL, top, NULL, 0, &o, &s));
    int same = s != NULL;
    for (int i = 0; i < N && same; i++) {
        int32_t t = -1;
        same = tl_stream_next(s, &t, NULL) == TL_OK && t == expected[i];
    }
    CHECK(same, "the resumed stream's tokens differ");
    tl_stream_free(s);
    CHECK_STATUS(tl_resume_generate(h, plain, top, NULL, 0, &o, got, N, &r), TL_ERR_INVALID_ARGUMENT);
    if (top > 1) {
        tl_resume_handle *deep = NULL;
        CHECK_OK(tl_resume_create(ctx, P, &deep));   /* ctx now holds the prompt at top */
        CHECK_STATUS(tl_resume_generate(deep, NULL, 1, NULL, 0, &o, got, N, &r), TL_ERR_INVALID_ARGUMENT);
        tl_resume_free(deep);
    }
    o.exit.kind = TL_EXIT_KL;
    o.exit.threshold = 0.1f;
    CHECK_STATUS(tl_resume_generate(h, NULL, top, NULL, 0, &o, got, N, &r), TL_ERR_UNSUPPORTED);
    CHECK_STATUS(tl_resume_generate(NULL, NULL, top, NULL, 0, &o, got, N, &r), TL_ERR_INVALID_ARGUMENT);
    tl_resume_free(h);
    tl_context_free(ctx);
    tl_context_free(plain);
}

static void test_greedy_matches_argmax(fixture *f) {
    enum { N = 6 };
    int V = f->info.vocab_size;
    int32_t out[N];
    tl_generate_options o = greedy_options(N);
    tl_generate_result r;
    tl_generate_result_default(&r);
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &o, out, N, &r));
    CHECK(r.n_tokens == N && r.stop_reason == TL_STOP_MAX_TOKENS && r.n_prompt_tokens == 5,
          "result n_tokens %u stop %d prompt %u", r.n_tokens, r.stop_reason, r.n_prompt_tokens);
    CHECK(r.prefill_seconds >= 0.0 && r.decode_seconds >= 0.0, "timings are set");

    tl_context *ctx = new_context(f->model, 0);
    float *logits = malloc((size_t)V * sizeof *logits);
    int same = ctx != NULL;
    if (ctx) {
        tl_context_append(ctx, f->tokens, 5, 0, logits);
        for (int i = 0; i < N && same; i++) {
            same = argmax(logits, V) == out[i];
            tl_context_append(ctx, &out[i], 1, 0, logits);
        }
    }
    CHECK(same, "greedy generation differs from argmax over cached decode");
    free(logits);
    tl_context_free(ctx);
}

static void test_sampling_determinism(fixture *f) {
    enum { N = 8 };
    int32_t a[N], b[N];
    tl_generate_options o;
    tl_generate_options_default(&o);
    o.max_tokens = N;
    o.eos_token = -2;
    o.temperature = 1.0f;
    o.top_k = 20;
    o.top_p = 0.9f;
    o.min_p = 0.01f;
    o.repetition_penalty = 1.2f;
    o.seed = 1234;
    tl_generate_result ra, rb;
    tl_generate_result_default(&ra);
    tl_generate_result_default(&rb);
    CHECK_OK(tl_generate(f->model, f->tokens, 4, &o, a, N, &ra));
    CHECK_OK(tl_generate(f->model, f->tokens, 4, &o, b, N, &rb));
    CHECK(ra.n_tokens == N && rb.n_tokens == N && memcmp(a, b, sizeof a) == 0,
          "same seed gives different tokens");
    for (int i = 0; i < N; i++)
        CHECK(a[i] >= 0 && a[i] < f->info.vocab_size, "sampled token %d out of range", a[i]);
    o.top_p = 0.0f;
    CHECK_STATUS(tl_generate(f->model, f->tokens, 4, &o, a, N, &ra), TL_ERR_INVALID_ARGUMENT);
}

static void test_stop_conditions(fixture *f) {
    enum { N = 8 };
    int32_t ref[N], out[N];
    tl_generate_options o = greedy_options(N);
    tl_generate_result r;
    tl_generate_result_default(&r);
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &o, ref, N, &r));

    /* stop sequence ref[2..3]: generation ends right after its first occurrence */
    int32_t stop[2] = { ref[2], ref[3] };
    uint32_t stop_len = 2;
    int expect = 4;
    for (int i = 1; i < 4; i++)
        if (ref[i - 1] == stop[0] && ref[i] == stop[1]) {
            expect = i + 1;
            break;
        }
    o.stop_tokens = stop;
    o.stop_lengths = &stop_len;
    o.n_stop_sequences = 1;
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &o, out, N, &r));
    CHECK(r.stop_reason == TL_STOP_SEQUENCE && (int)r.n_tokens == expect,
          "stop sequence: stop %d after %u tokens, expected %d", r.stop_reason, r.n_tokens, expect);

    /* EOS = ref[3]: stops before emitting it */
    o = greedy_options(N);
    o.eos_token = ref[3];
    int first = 3;
    for (int i = 0; i < 3; i++)
        if (ref[i] == ref[3]) {
            first = i;
            break;
        }
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &o, out, N, &r));
    CHECK(r.stop_reason == TL_STOP_EOS && (int)r.n_tokens == first,
          "eos: stop %d after %u tokens, expected %d", r.stop_reason, r.n_tokens, first);

    /* out_capacity clips max_tokens */
    o = greedy_options(100);
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &o, out, 3, &r));
    CHECK(r.n_tokens == 3 && r.stop_reason == TL_STOP_MAX_TOKENS, "capacity clip: %u tokens",
          r.n_tokens);

    /* generation reaching max_seq_len stops with CONTEXT_FULL */
    int32_t *big = calloc(MAX_SEQ + 8, sizeof *big);
    int32_t prompt[MAX_SEQ - 2];
    for (int i = 0; i < MAX_SEQ - 2; i++) prompt[i] = f->tokens[i % N_TOK];
    CHECK_OK(tl_generate(f->model, prompt, MAX_SEQ - 2, &o, big, MAX_SEQ + 8, &r));
    CHECK(r.stop_reason == TL_STOP_CONTEXT_FULL && r.n_tokens == 3,
          "context full: stop %d after %u tokens", r.stop_reason, r.n_tokens);
    free(big);
}

/* Frees a stream's context first: the stream then ends (aborted) without touching it,
 * and is freed after. */
static void free_context_then_stream(tl_context **ctx, tl_stream *s, const char *what) {
    int32_t tok;
    tl_stop_reason why = TL_STOP_NONE;
    tl_context_free(*ctx);
    *ctx = NULL;
    CHECK_OK(tl_stream_next(s, &tok, &why));
    CHECK(tok == -1 && why == TL_STOP_ABORTED, "%s after its context was freed: %d, stop %d", what,
          tok, why);
    tl_stream_free(s);
}

typedef struct abort_state {
    int seen;
    int stop_after;
} abort_state;

static int count_and_abort(int32_t token, void *user) {
    abort_state *s = user;
    return ++s->seen >= s->stop_after;
}

static void test_stream_and_callback(fixture *f) {
    enum { N = 6 };
    int32_t ref[N];
    tl_generate_options o = greedy_options(N);
    tl_generate_result r;
    tl_generate_result_default(&r);
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &o, ref, N, &r));

    tl_stream *s = NULL;
    CHECK_OK(tl_stream_start(f->model, NULL, f->tokens, 5, &o, &s));
    if (s) {
        int32_t tok;
        tl_stop_reason why = TL_STOP_NONE;
        int n = 0, same = 1;
        while (tl_stream_next(s, &tok, &why) == TL_OK && tok >= 0) {
            same &= n < N && tok == ref[n];
            n++;
        }
        CHECK(same && n == N && why == TL_STOP_MAX_TOKENS, "stream gave %d tokens, stop %d", n, why);
        CHECK_OK(tl_stream_next(s, &tok, &why));
        CHECK(tok == -1 && why == TL_STOP_MAX_TOKENS, "a finished stream keeps returning -1");
        CHECK_OK(tl_stream_result(s, &r));
        CHECK(r.n_tokens == N && r.stop_reason == TL_STOP_MAX_TOKENS, "stream result");
        tl_stream_free(s);
    }

    /* a stream over a caller's context: the context refuses other uses while the stream
     * is open; freeing the context ends the stream, which then never touches it */
    tl_context *ctx = NULL;
    CHECK_OK(tl_context_create(f->model, NULL, &ctx));
    s = NULL;
    if (ctx) CHECK_OK(tl_stream_start(f->model, ctx, f->tokens, 5, &o, &s));
    if (s) {
        int32_t tok;
        tl_stop_reason why = TL_STOP_NONE;
        CHECK_OK(tl_stream_next(s, &tok, &why));
        CHECK_STATUS(tl_context_append(ctx, f->tokens, 1, 0, NULL), TL_ERR_INVALID_ARGUMENT);
        CHECK(strstr(tl_last_error(), "still open") != NULL, "in-use message: %s", tl_last_error());
        CHECK_STATUS(tl_context_truncate(ctx, 1), TL_ERR_INVALID_ARGUMENT);
        tl_stream *second = NULL;
        CHECK_STATUS(tl_stream_start(f->model, ctx, f->tokens, 5, &o, &second), TL_ERR_INVALID_ARGUMENT);
        CHECK(second == NULL, "no second stream");
        free_context_then_stream(&ctx, s, "a stream");
    }
    tl_context_free(ctx);

    abort_state st = { 0, 3 };
    CHECK_OK(tl_generate_stream(f->model, f->tokens, 5, &o, count_and_abort, &st, &r));
    CHECK(st.seen == 3 && r.n_tokens == 3 && r.stop_reason == TL_STOP_ABORTED,
          "abort: %d callbacks, %u tokens, stop %d", st.seen, r.n_tokens, r.stop_reason);

    /* batch = each prompt on its own */
    int32_t b0[N], b1[N];
    int32_t *outs[2] = { b0, b1 };
    const int32_t *prompts[2] = { f->tokens, f->tokens + 3 };
    size_t lens[2] = { 5, 4 };
    tl_generate_result rs[2];
    tl_generate_result_default(&rs[0]);
    tl_generate_result_default(&rs[1]);
    CHECK_OK(tl_generate_batch(f->model, prompts, lens, 2, &o, outs, N, rs));
    CHECK(rs[0].n_tokens == N && memcmp(b0, ref, sizeof ref) == 0, "batch prompt 0 differs");
    int32_t single[N];
    CHECK_OK(tl_generate(f->model, f->tokens + 3, 4, &o, single, N, &r));
    CHECK(rs[1].n_tokens == r.n_tokens && memcmp(b1, single, r.n_tokens * sizeof *single) == 0,
          "batch prompt 1 differs");
}

/* ---- errors ------------------------------------------------------------------------- */

static int message_has(const char *needle) { return strstr(tl_last_error(), needle) != NULL; }

static void test_errors(fixture *f, const char *path) {
    int V = f->info.vocab_size;
    float *logits = malloc((size_t)V * sizeof *logits);
    float lp[N_TOK];
    int32_t out[4];
    int32_t bad[3] = { 1, V + 5, 2 };
    tl_generate_options o = greedy_options(4);

    CHECK_STATUS(tl_score(f->model, bad, 3, NULL, lp), TL_ERR_INVALID_ARGUMENT);
    CHECK(message_has("index 1") && message_has("out of range"), "bad token message: %s",
          tl_last_error());
    bad[1] = -1;
    CHECK_STATUS(tl_generate(f->model, bad, 3, &o, out, 4, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate(f->model, f->tokens, 0, &o, out, 4, NULL), TL_ERR_INVALID_ARGUMENT);

    int32_t *longp = calloc(MAX_SEQ + 1, sizeof *longp);
    CHECK_STATUS(tl_generate(f->model, longp, MAX_SEQ + 1, &o, out, 4, NULL), TL_ERR_CONTEXT_FULL);
    CHECK(message_has("max_seq_len"), "too-long prompt message: %s", tl_last_error());
    CHECK_STATUS(tl_score(f->model, longp, MAX_SEQ + 1, NULL, lp), TL_ERR_CONTEXT_FULL);
    free(longp);

    CHECK_STATUS(tl_score(NULL, f->tokens, 3, NULL, lp), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_score(f->model, NULL, 3, NULL, lp), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_score(f->model, f->tokens, 3, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate(f->model, f->tokens, 3, &o, NULL, 4, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_load_model(path, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_model_get_info(NULL, &f->info), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_context_append(NULL, f->tokens, 1, 0, NULL), TL_ERR_INVALID_ARGUMENT);

    tl_score_options so;
    tl_score_options_default(&so);
    so.struct_size = 2; /* garbage */
    CHECK_STATUS(tl_score(f->model, f->tokens, 3, &so, lp), TL_ERR_INVALID_ARGUMENT);
    CHECK(message_has("struct_size"), "struct_size message: %s", tl_last_error());

    if (f->info.n_core > 0) {
        tl_score_options_default(&so);
        so.depth = f->info.max_depth + 1;
        CHECK_STATUS(tl_score(f->model, f->tokens, 3, &so, lp), TL_ERR_INVALID_ARGUMENT);
        CHECK(message_has("depth"), "depth message: %s", tl_last_error());
        so.depth = -1;
        CHECK_STATUS(tl_score(f->model, f->tokens, 3, &so, lp), TL_ERR_INVALID_ARGUMENT);

        tl_context *ctx = new_context(f->model, 0);
        if (ctx) {
            int d1 = 1, d2 = f->info.max_depth > 1 ? 2 : 1;
            CHECK_OK(tl_context_append(ctx, f->tokens, 3, d1, NULL));
            if (d2 != d1) {
                CHECK_STATUS(tl_context_append(ctx, f->tokens, 1, d2, NULL), TL_ERR_INVALID_ARGUMENT);
                CHECK(message_has("reset"), "depth change message: %s", tl_last_error());
            }
            CHECK_OK(tl_context_append(ctx, f->tokens, 1, 0, NULL)); /* 0 = the sequence's */
            CHECK_OK(tl_context_reset(ctx));
            CHECK_OK(tl_context_append(ctx, f->tokens, 1, d2, NULL));
            tl_context_free(ctx);
        }
    }

    /* appending past max_seq_len */
    tl_context *ctx = new_context(f->model, 0);
    if (ctx) {
        int32_t *fill = calloc(MAX_SEQ, sizeof *fill);
        CHECK_OK(tl_context_append(ctx, fill, MAX_SEQ, 0, NULL));
        CHECK_STATUS(tl_context_append(ctx, fill, 1, 0, logits), TL_ERR_CONTEXT_FULL);
        size_t len = 0;
        tl_context_length(ctx, &len);
        CHECK(len == MAX_SEQ, "a failed append keeps the length (%zu)", len);
        free(fill);
        tl_context_free(ctx);
    }

    /* the logit lens: depth d's row is score_last_token at depth d */
    if (f->info.n_core > 0) {
        float *lens = malloc(2 * (size_t)V * sizeof *lens);
        tl_score_options so;
        tl_score_options_default(&so);
        CHECK_OK(tl_score_logit_lens(f->model, f->tokens, 3, NULL, 2, lens));
        for (int d = 1; d <= 2; d++) {
            so.depth = d;
            CHECK_OK(tl_score_last_token(f->model, f->tokens, 3, &so, logits));
            CHECK(max_abs_diff(lens + (size_t)(d - 1) * V, logits, (size_t)V) == 0.0f,
                  "lens row %d equals score_last_token", d);
        }
        CHECK_STATUS(tl_score_logit_lens(f->model, f->tokens, 3, NULL, f->info.max_depth + 1, lens),
                     TL_ERR_INVALID_ARGUMENT);
        CHECK_STATUS(tl_score_logit_lens(f->model, f->tokens, 3, NULL, 0, lens),
                     TL_ERR_INVALID_ARGUMENT);
        CHECK_STATUS(tl_score_logit_lens(f->model, f->tokens, 3, NULL, 2, NULL),
                     TL_ERR_INVALID_ARGUMENT);
        free(lens);
    } else {
        CHECK_STATUS(tl_score_logit_lens(f->model, f->tokens, 3, NULL, 1, logits), TL_ERR_UNSUPPORTED);
    }

    tl_load_options lo;
    tl_load_options_default(&lo);
    tl_model *m = NULL;
    lo.device = "gpu";
    CHECK_STATUS(tl_load_model(path, &lo, &m), TL_ERR_INVALID_ARGUMENT);
    lo.device = "cuda:x";
    CHECK_STATUS(tl_load_model(path, &lo, &m), TL_ERR_INVALID_ARGUMENT);
    lo.device = "cuda";
    tl_status st = tl_load_model(path, &lo, &m);
    CHECK(st == TL_ERR_UNSUPPORTED && m == NULL, "cuda request gives %s", tl_status_name(st));
    lo.device = "auto";
    CHECK_OK(tl_load_model(path, &lo, &m));
    tl_free_model(m);
    CHECK_STATUS(tl_load_model("/nonexistent/model.tinyloop", NULL, &m), TL_ERR_IO);
    free(logits);
}

/* ---- memory and threads ---------------------------------------------------------- */

/* ---- speculative decoding ---------------------------------------------------- */

/* Drafts at every shallower depth give plain greedy decoding's tokens; a draft at the full
 * depth is always kept; bad speculative options are clear errors. */
static void test_speculative(fixture *f) {
    enum { N = 24 };
    int32_t plain[N], spec[N], out[4];
    tl_generate_options o = greedy_options(N);
    tl_generate_result r;
    tl_generate_result_default(&r);
    if (f->info.n_core == 0) {
        CHECK_STATUS(tl_generate_speculative(f->model, f->tokens, 5, &o, 1, 4, spec, N, &r),
                     TL_ERR_UNSUPPORTED);
        return;
    }
    int depth = f->info.default_depth;
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &o, plain, N, &r));
    CHECK(r.n_drafted == 0 && r.n_accepted == 0, "plain decoding drafts nothing");
    for (int draft = 1; draft <= depth; draft++) {
        for (int n_draft = 1; n_draft <= 5; n_draft += 4) {
            tl_generate_result_default(&r);
            memset(spec, 0xff, sizeof spec);
            CHECK_OK(tl_generate_speculative(f->model, f->tokens, 5, &o, draft, n_draft, spec, N, &r));
            CHECK(r.n_tokens == N && memcmp(spec, plain, sizeof plain) == 0,
                  "draft depth %d, %d drafts: %u tokens, not plain greedy's", draft, n_draft,
                  r.n_tokens);
            CHECK(r.n_accepted <= r.n_drafted && r.n_drafted > 0, "counters %u of %u", r.n_accepted,
                  r.n_drafted);
            if (draft == depth && f->info.draft_vocab == 0)   /* a draft vocabulary may miss */
                CHECK(r.n_accepted == r.n_drafted, "full-depth drafts all kept (%u of %u)",
                      r.n_accepted, r.n_drafted);
        }
    }

    CHECK_STATUS(tl_generate_speculative(f->model, f->tokens, 5, &o, 0, 4, out, 4, NULL),
                 TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate_speculative(f->model, f->tokens, 5, &o, depth + 1, 4, out, 4, NULL),
                 TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate_speculative(f->model, f->tokens, 5, &o, 1, 33, out, 4, NULL),
                 TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate_speculative(f->model, f->tokens, 5, &o, 1, -1, out, 4, NULL),
                 TL_ERR_INVALID_ARGUMENT);
    /* sampling: seeded, whole, in range (the distribution is tested from Python); at
     * temperature 0 with a penalty, plain decoding's tokens */
    tl_generate_options sampled = o;
    sampled.temperature = 0.8f;
    sampled.seed = 5;
    int32_t again[N];
    CHECK_OK(tl_generate_speculative(f->model, f->tokens, 5, &sampled, 1, 3, spec, N, &r));
    CHECK_OK(tl_generate_speculative(f->model, f->tokens, 5, &sampled, 1, 3, again, N, NULL));
    CHECK(r.n_tokens == N && memcmp(spec, again, sizeof spec) == 0, "sampled drafts are seeded");
    for (int i = 0; i < N; i++)
        CHECK(spec[i] >= 0 && spec[i] < f->info.vocab_size, "sampled token %d out of range", spec[i]);
    CHECK(r.n_accepted <= r.n_drafted && r.n_drafted > 0, "sampled counters %u of %u", r.n_accepted,
          r.n_drafted);
    sampled.temperature = 0.0f;
    sampled.repetition_penalty = 1.3f;
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &sampled, plain, N, NULL));
    CHECK_OK(tl_generate_speculative(f->model, f->tokens, 5, &sampled, 1, 3, spec, N, NULL));
    CHECK(memcmp(spec, plain, sizeof plain) == 0, "penalized greedy drafts give plain tokens");

    /* a caller built before the speculative fields: its options struct ended with tail
     * padding where draft_depth now sits (garbage here), and its result struct is shorter */
    tl_generate_options older = o;
    older.struct_size = (uint32_t)offsetof(tl_generate_options, n_draft);
    older.draft_depth = 99;
    older.n_draft = 99;
    struct { tl_generate_result r; uint32_t guard; } short_result;
    memset(&short_result, 0x5a, sizeof short_result);
    short_result.r.struct_size = (uint32_t)offsetof(tl_generate_result, n_drafted);
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &o, plain, N, NULL));
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &older, spec, N, &short_result.r));
    CHECK(memcmp(spec, plain, sizeof plain) == 0, "a first-release options struct decodes plainly");
    CHECK(short_result.r.n_drafted == 0x5a5a5a5au && short_result.guard == 0x5a5a5a5au,
          "nothing written past a first-release result struct");

    /* draft_p_min: outside [0, 1] refused; a struct from before it (whose tail padding
     * lies where it sits) never reads it */
    tl_generate_options unsure = o;
    const double bad_p_min[] = { -0.5, 1.5, NAN };
    for (size_t i = 0; i < sizeof bad_p_min / sizeof bad_p_min[0]; i++) {
        unsure.draft_p_min = bad_p_min[i];
        CHECK_STATUS(tl_generate_speculative(f->model, f->tokens, 5, &unsure, 1, 3, out, 4, NULL),
                     TL_ERR_INVALID_ARGUMENT);
    }
    unsure.struct_size = (uint32_t)offsetof(tl_generate_options, draft_p_min);
    unsure.draft_p_min = 7.0;
    tl_generate_result_default(&r);
    CHECK_OK(tl_generate_speculative(f->model, f->tokens, 5, &unsure, 1, 3, spec, N, &r));
    CHECK(memcmp(spec, plain, sizeof plain) == 0 && r.n_drafted > 0,
          "a struct from before draft_p_min drafts as without it (%u drafts)", r.n_drafted);

    /* a drafting stream whose context is freed first: the drafts' states, kept in the
     * context's backend, go with it (the sanitizers watch the rest) */
    tl_context *ctx = NULL;
    tl_stream *s = NULL;
    tl_generate_options drafting = o;
    drafting.draft_depth = 1;
    drafting.n_draft = 3;
    CHECK_OK(tl_context_create(f->model, NULL, &ctx));
    if (ctx) CHECK_OK(tl_stream_start(f->model, ctx, f->tokens, 5, &drafting, &s));
    if (s) {
        int32_t tok;
        tl_stop_reason why = TL_STOP_NONE;
        for (int i = 0; i < 3; i++) CHECK_OK(tl_stream_next(s, &tok, &why));
        free_context_then_stream(&ctx, s, "a drafting stream");
    }
    tl_context_free(ctx);
}

/* Tree speculation: plain greedy tokens for a few shapes, seeded sampling, a pull stream over a
 * context that the caller frees first, a first-release or pre-tree options struct that
 * never turns trees on, and clear refusals. */
static void test_tree_speculative(fixture *f) {
    enum { N = 20 };
    int32_t plain[N], tree[N], out[4];
    tl_generate_options o = greedy_options(N);
    tl_generate_result r;
    const int32_t shapes[][4] = { { 1, 0 }, { 3, 0 }, { 2, 2, 1, 1 } };
    const size_t levels[] = { 1, 1, 4 };
    if (f->info.n_core == 0) {
        CHECK_STATUS(tl_generate_tree_speculative(f->model, f->tokens, 5, &o, 1, shapes[1], 1, 0, tree, N, NULL),
                     TL_ERR_UNSUPPORTED);
        return;
    }
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &o, plain, N, NULL));
    for (int draft = 1; draft <= f->info.default_depth; draft++)
        for (size_t k = 0; k < 3; k++) {
            tl_generate_result_default(&r);
            memset(tree, 0xff, sizeof tree);
            CHECK_OK(tl_generate_tree_speculative(f->model, f->tokens, 5, &o, draft, shapes[k], levels[k], 0, tree,
                                                  N, &r));
            CHECK(r.n_tokens == N && memcmp(tree, plain, sizeof plain) == 0,
                  "draft depth %d, shape %zu: not plain greedy's tokens", draft, k);
            CHECK(r.n_accepted <= r.n_drafted && r.n_drafted > 0, "counters %u of %u", r.n_accepted, r.n_drafted);
        }
    const int32_t zero_width[] = { 2, 0 }, wide[] = { 9 };
    CHECK_STATUS(tl_generate_tree_speculative(f->model, f->tokens, 5, &o, 1, zero_width, 2, 0, out, 4, NULL),
                 TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate_tree_speculative(f->model, f->tokens, 5, &o, 1, wide, 1, 0, out, 4, NULL),
                 TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate_tree_speculative(f->model, f->tokens, 5, &o, 1, shapes[1], 1, 64, out, 4, NULL),
                 TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate_tree_speculative(f->model, f->tokens, 5, &o, 1, NULL, 1, 0, out, 4, NULL),
                 TL_ERR_INVALID_ARGUMENT);
    /* sampled trees: seeded, in range (the distribution is tested from Python) */
    tl_generate_options sampled = o;
    sampled.temperature = 0.8f;
    sampled.seed = 3;
    int32_t again[N];
    CHECK_OK(tl_generate_tree_speculative(f->model, f->tokens, 5, &sampled, 1, shapes[2], 4, 0, tree, N, &r));
    CHECK_OK(tl_generate_tree_speculative(f->model, f->tokens, 5, &sampled, 1, shapes[2], 4, 0, again, N, NULL));
    CHECK(r.n_tokens == N && memcmp(tree, again, sizeof tree) == 0, "sampled trees are seeded");
    for (int i = 0; i < N; i++)
        CHECK(tree[i] >= 0 && tree[i] < f->info.vocab_size, "sampled tree token %d out of range", tree[i]);
    /* a struct from before trees: its tree fields are never read */
    tl_generate_options older = o;
    older.struct_size = (uint32_t)offsetof(tl_generate_options, tree_widths);
    older.tree_widths[0] = 99;
    older.tree_budget = -5;
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &older, tree, N, NULL));
    CHECK(memcmp(tree, plain, sizeof plain) == 0, "a pre-tree options struct decodes plainly");

    tl_context *ctx = NULL;
    tl_stream *s = NULL;
    tl_generate_options drafting = o;
    drafting.draft_depth = 1;
    drafting.tree_widths[0] = 3;
    drafting.tree_widths[1] = 2;
    CHECK_OK(tl_context_create(f->model, NULL, &ctx));
    if (ctx) CHECK_OK(tl_stream_start(f->model, ctx, f->tokens, 5, &drafting, &s));
    if (s) {
        int32_t tok;
        tl_stop_reason why = TL_STOP_NONE;
        for (int i = 0; i < 3; i++) {
            CHECK_OK(tl_stream_next(s, &tok, &why));
            CHECK(tok == plain[i], "tree stream token %d", i);
        }
        free_context_then_stream(&ctx, s, "a tree-drafting stream");
    }
    tl_context_free(ctx);
}

/* The model at path loaded with lo, and its info; NULL (a failed check) if it fails. */
static tl_model *load_with_info(const char *path, const tl_load_options *lo, tl_model_info *info) {
    tl_model *m = NULL;
    CHECK_OK(tl_load_model(path, lo, &m));
    tl_model_info_default(info);
    if (m) CHECK_OK(tl_model_get_info(m, info));
    return m;
}

/* A file with token frequencies: drafts over any draft vocabulary give plain greedy
 * decoding's tokens, and the load option's sizes resolve as documented. */
static void test_draft_vocab(fixture *f, const char *path) {
    enum { N = 24 };
    if (f->info.n_core == 0 || f->info.draft_vocab == 0) return;
    int32_t plain[N], spec[N];
    tl_generate_options o = greedy_options(N);
    CHECK_OK(tl_generate(f->model, f->tokens, 5, &o, plain, N, NULL));
    const int32_t V = f->info.vocab_size;
    const int32_t sizes[][2] = { { 0, 0 }, { 1, 1 }, { 5, 5 }, { V - 1, V - 1 }, { V, 0 }, { V + 9, 0 } };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        tl_load_options lo;
        tl_load_options_default(&lo);
        lo.n_threads = 2;
        lo.draft_vocab = sizes[i][0];
        tl_model_info info;
        tl_model *m = load_with_info(path, &lo, &info);
        if (!m) continue;
        CHECK(info.draft_vocab == sizes[i][1], "draft_vocab %d gives %d tokens, not %d",
              sizes[i][0], info.draft_vocab, sizes[i][1]);
        for (int n_draft = 1; n_draft <= 4; n_draft += 3) {
            memset(spec, 0xff, sizeof spec);
            CHECK_OK(tl_generate_speculative(m, f->tokens, 5, &o, 1, n_draft, spec, N, NULL));
            CHECK(memcmp(spec, plain, sizeof plain) == 0, "draft_vocab %d, %d drafts: not plain greedy's",
                  sizes[i][0], n_draft);
        }
        CHECK_OK(tl_free_model(m));
    }
    /* a first-release caller's struct ends before draft_vocab: the default applies */
    tl_load_options older;
    tl_load_options_default(&older);
    older.struct_size = (uint32_t)offsetof(tl_load_options, draft_vocab);
    older.draft_vocab = 3;
    tl_model_info info;
    tl_model *m = load_with_info(path, &older, &info);
    if (!m) return;
    CHECK(info.draft_vocab == f->info.draft_vocab, "a first-release struct: %d draft tokens, not %d",
          info.draft_vocab, f->info.draft_vocab);
    /* a first-release tl_model_info ends before draft_vocab: filled, nothing written past */
    struct { tl_model_info info; } first;
    memset(&first, 0x5a, sizeof first);
    first.info.struct_size = (uint32_t)offsetof(tl_model_info, draft_vocab);
    CHECK_OK(tl_model_get_info(m, &first.info));
    CHECK(first.info.vocab_size == f->info.vocab_size && first.info.draft_vocab == 0x5a5a5a5a,
          "a first-release tl_model_info: vocab %d, draft_vocab field %d", first.info.vocab_size,
          first.info.draft_vocab);
    CHECK_OK(tl_free_model(m));
}

static void test_memory_report(fixture *f) {
    tl_memory_report before, during, after;
    tl_memory_report_default(&before);
    tl_memory_report_default(&during);
    tl_memory_report_default(&after);
    CHECK_OK(tl_memory_report_get(f->model, &before));
    tl_context *ctx = new_context(f->model, 0);
    CHECK_OK(tl_memory_report_get(f->model, &during));
    tl_context_free(ctx);
    CHECK_OK(tl_memory_report_get(f->model, &after));
    CHECK(before.weights_bytes > 0 && during.kv_cache_bytes > before.kv_cache_bytes &&
              during.buffers_bytes > before.buffers_bytes,
          "a context's memory is counted");
    CHECK(after.kv_cache_bytes == before.kv_cache_bytes &&
              after.buffers_bytes == before.buffers_bytes,
          "a freed context's memory is released");
    CHECK(during.total_bytes == during.weights_bytes + during.repacked_bytes +
                                    during.buffers_bytes + during.kv_cache_bytes,
          "total is the sum");
    uint64_t vram = 0;
    CHECK_OK(tl_vram_usage_bytes(f->model, &vram));
    CHECK(vram == after.total_bytes, "vram_usage_bytes on CPU is the total");
}

static tl_context *policy_context(tl_model *model, int32_t policy, int32_t ring_slots,
                                  int32_t keep_loop_states, tl_status *st) {
    tl_context_options o;
    tl_context_options_default(&o);
    o.kv_policy = policy;
    o.kv_ring_slots = ring_slots;
    o.keep_loop_states = keep_loop_states;
    tl_context *ctx = NULL;
    *st = tl_context_create(model, &o, &ctx);
    return ctx;
}

/* The logits after each of the last n - 7 tokens: a 7-token append, then one at a time. */
static void decode_rows(tl_context *ctx, const int32_t *tokens, int n, float *rows, int V) {
    CHECK_OK(tl_context_append(ctx, tokens, 7, 0, rows));
    for (int i = 7; i < n; i++) CHECK_OK(tl_context_append(ctx, tokens + i, 1, 0, rows + (size_t)(i - 6) * V));
}

/* Approximate KV policies (docs/api.md, "KV policies"): fewer KV bytes, ring N >= the
 * depth is exact, a fork continues as the original, the refusals and bad values. */
static void test_kv_policy(fixture *f) {
    if (f->info.n_core == 0) return;
    int V = f->info.vocab_size, n_rows = N_TOK - 6;
    tl_status st;
    tl_memory_report r0, r1;
    tl_memory_report_default(&r0);
    tl_memory_report_default(&r1);
    CHECK_OK(tl_memory_report_get(f->model, &r0));
    tl_context *shared = policy_context(f->model, TL_KV_SHARE_LAST, 0, 0, &st);
    CHECK_OK(st);
    CHECK_OK(tl_memory_report_get(f->model, &r1));
    uint64_t slot = 2ull * sizeof(float) * MAX_SEQ * (uint64_t)(f->info.n_kv_head * f->info.head_dim);
    CHECK(f->paged || r1.kv_cache_bytes - r0.kv_cache_bytes ==
              slot * (uint64_t)(f->info.n_pre + f->info.n_core + f->info.n_post),
          "share_last holds one loop slot per core block");

    float *a = malloc((size_t)n_rows * V * sizeof *a), *b = malloc((size_t)n_rows * V * sizeof *b);
    tl_context *exact = new_context(f->model, 0);
    tl_context *ring = policy_context(f->model, TL_KV_RING, f->info.max_depth, 0, &st);
    CHECK(exact && ring, "contexts");
    if (exact && ring) {
        decode_rows(exact, f->tokens, N_TOK, a, V);
        decode_rows(ring, f->tokens, N_TOK, b, V);
        CHECK(memcmp(a, b, (size_t)n_rows * V * sizeof *a) == 0, "ring of max_depth slots is exact");
    }
    tl_context *fork = NULL;
    if (shared) {
        decode_rows(shared, f->tokens, N_TOK - 1, a, V);
        CHECK(max_abs_diff(a + (size_t)(n_rows - 2) * V, b + (size_t)(n_rows - 2) * V, (size_t)V) > 1e-6f,
              "share_last is approximate");
        CHECK_OK(tl_context_fork(shared, &fork));
        if (fork) {
            CHECK_OK(tl_context_append(shared, f->tokens + N_TOK - 1, 1, 0, a));
            CHECK_OK(tl_context_append(fork, f->tokens + N_TOK - 1, 1, 0, b));
            CHECK(memcmp(a, b, (size_t)V * sizeof *a) == 0, "a forked share_last context continues alike");
        }
        tl_generate_options o = greedy_options(4);
        o.draft_depth = 1;
        int32_t out[4];
        CHECK_OK(tl_context_reset(shared));
        CHECK_STATUS(tl_context_generate(shared, f->tokens, 5, &o, out, 4, NULL), TL_ERR_UNSUPPORTED);
    }
    tl_context *bad = policy_context(f->model, TL_KV_SHARE_LAST, 0, 1, &st);
    CHECK(st == TL_ERR_UNSUPPORTED && !bad, "share_last refuses keep_loop_states");
    bad = policy_context(f->model, 5, 0, 0, &st);
    CHECK(st == TL_ERR_INVALID_ARGUMENT && !bad, "kv_policy 5 is invalid");
    bad = policy_context(f->model, TL_KV_RING, 0, 0, &st);
    CHECK(st == TL_ERR_INVALID_ARGUMENT && !bad && strstr(tl_last_error(), "kv_ring_slots"), "ring needs slots");
    /* store_h (docs/model.md, "The store_h KV policy"): exact caching's rows from kept
     * block inputs; paged KV refuses it */
    CHECK_OK(tl_memory_report_get(f->model, &r0));
    tl_context *stored = policy_context(f->model, TL_KV_STORE_H, 0, 0, &st);
    CHECK(f->paged ? st == TL_ERR_UNSUPPORTED && !stored && strstr(tl_last_error(), "store_h")
                   : st == TL_OK && stored != NULL,
          "store_h: a contiguous cache keeps it, paged KV refuses it by name");
    if (stored && exact) {
        CHECK_OK(tl_memory_report_get(f->model, &r1));
        uint64_t inputs = sizeof(float) * MAX_SEQ * (uint64_t)f->info.d_model * f->info.n_core * f->info.max_depth;
        CHECK(r1.kv_cache_bytes - r0.kv_cache_bytes ==
                  slot * (uint64_t)(f->info.n_pre + f->info.n_core + f->info.n_post) + inputs,
              "store_h holds a slot per block and the core blocks' inputs");
        CHECK_OK(tl_context_reset(exact));
        decode_rows(exact, f->tokens, N_TOK, a, V);
        decode_rows(stored, f->tokens, N_TOK, b, V);
        CHECK(max_abs_diff(a, b, (size_t)n_rows * V) < 1e-4f, "store_h decodes as exact caching");
    }
    tl_context_free(stored);
    tl_context_free(fork);
    tl_context_free(shared);
    tl_context_free(exact);
    tl_context_free(ring);
    free(a);
    free(b);
}

typedef struct thread_job {
    fixture *f;
    float lp[N_TOK - 1];
    int32_t gen[6];
    tl_status st;
} thread_job;

static void *thread_main(void *p) {
    thread_job *j = p;
    tl_context *ctx = new_context(j->f->model, 0);
    if (!ctx) {
        j->st = TL_ERR_INTERNAL;
        return NULL;
    }
    tl_generate_options o = greedy_options(6);
    j->st = TL_OK;
    for (int rep = 0; rep < 3 && j->st == TL_OK; rep++) {
        tl_context_reset(ctx);
        j->st = tl_context_score(ctx, j->f->tokens, N_TOK, NULL, j->lp);
        tl_context_reset(ctx);
        if (j->st == TL_OK) j->st = tl_context_generate(ctx, j->f->tokens, 5, &o, j->gen, 6, NULL);
    }
    tl_context_free(ctx);
    return NULL;
}

static void test_two_threads(fixture *f) {
    thread_job jobs[2];
    memset(jobs, 0, sizeof jobs);
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        jobs[i].f = f;
        pthread_create(&th[i], NULL, thread_main, &jobs[i]);
    }
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    float lp[N_TOK - 1];
    CHECK_OK(tl_score(f->model, f->tokens, N_TOK, NULL, lp));
    CHECK(jobs[0].st == TL_OK && jobs[1].st == TL_OK, "threads ran");
    CHECK(memcmp(jobs[0].lp, jobs[1].lp, sizeof lp) == 0 && memcmp(jobs[0].lp, lp, sizeof lp) == 0,
          "two threads and the model-level call score identically");
    CHECK(memcmp(jobs[0].gen, jobs[1].gen, sizeof jobs[0].gen) == 0,
          "two threads generate identically");
}

/* ---- prefix caches and pools ---------------------------------------------------- */

#define N_PREFIX 12

/* Logits after appending tokens[0..split) then tokens[split..n) to a fresh context. */
static void logits_after_split(fixture *f, size_t split, size_t n, float *logits) {
    tl_context *ctx = new_context(f->model, 0);
    CHECK_OK(tl_context_append(ctx, f->tokens, split, 0, NULL));
    CHECK_OK(tl_context_append(ctx, f->tokens + split, n - split, 0, logits));
    tl_context_free(ctx);
}

static uint64_t prefix_bytes_now(fixture *f) {
    tl_memory_report r;
    tl_memory_report_default(&r);
    CHECK_OK(tl_memory_report_get(f->model, &r));
    CHECK(r.total_bytes == r.weights_bytes + r.repacked_bytes + r.buffers_bytes +
                               r.kv_cache_bytes + r.prefix_cache_bytes,
          "total includes the prefix caches");
    return r.prefix_cache_bytes;
}

/* A context loaded from a prefix cache continues bit for bit as one that appended it. */
static void test_prefix_cache(fixture *f) {
    int V = f->info.vocab_size;
    float *want = malloc((size_t)V * sizeof *want), *got = malloc((size_t)V * sizeof *got);
    uint64_t before = prefix_bytes_now(f);
    tl_prefix_cache *cache = NULL, *part = NULL;
    CHECK_OK(tl_prefix_cache_create(f->model, f->tokens, N_PREFIX, 0, &cache));
    size_t n = 0;
    int32_t depth = -1;
    uint64_t bytes = 0;
    CHECK_OK(tl_prefix_cache_get_info(cache, &n, &depth, &bytes));
    CHECK(n == N_PREFIX && depth == (f->info.n_core ? f->info.default_depth : 0) && bytes > 0,
          "cache info: %zu tokens at depth %d, %llu bytes", n, depth, (unsigned long long)bytes);
    logits_after_split(f, N_PREFIX, N_TOK, want);
    tl_context *ctx = new_context(f->model, 0);
    CHECK_OK(tl_context_load_prefix(ctx, cache));
    CHECK_OK(tl_context_length(ctx, &n));
    CHECK(n == N_PREFIX, "a loaded context holds the prefix (%zu)", n);
    CHECK_OK(tl_context_append(ctx, f->tokens + N_PREFIX, N_TOK - N_PREFIX, 0, got));
    CHECK(memcmp(want, got, (size_t)V * sizeof *got) == 0, "logits after a loaded prefix are bit "
          "for bit those after appending it (max diff %g)", max_abs_diff(want, got, (size_t)V));

    /* a snapshot of part of a context's sequence; loading again replaces the sequence */
    CHECK_OK(tl_prefix_cache_from_context(ctx, 8, &part));
    CHECK(f->paged || prefix_bytes_now(f) - before > bytes, "two caches are counted in the memory report");
    struct { tl_memory_report r; char tail[8]; } old_report;   /* a first-release report */
    memset(&old_report, 0x5a, sizeof old_report);
    old_report.r.struct_size = (uint32_t)offsetof(tl_memory_report, prefix_cache_bytes);
    CHECK_OK(tl_memory_report_get(f->model, &old_report.r));
    CHECK(old_report.r.weights_bytes > 0 && ((unsigned char *)&old_report.r.prefix_cache_bytes)[0] == 0x5a,
          "a first-release memory report is filled as far as it goes");
    CHECK_OK(tl_context_load_prefix(ctx, part));
    CHECK_OK(tl_context_append(ctx, f->tokens + 8, N_TOK - 8, 0, got));
    logits_after_split(f, 8, N_TOK, want);
    CHECK(memcmp(want, got, (size_t)V * sizeof *got) == 0, "a snapshot of the first 8 tokens");

    /* a stream over a loaded context generates what a plain generation does */
    tl_generate_options o = greedy_options(6);
    int32_t plain[6], streamed[6];
    CHECK_OK(tl_generate(f->model, f->tokens, N_TOK, &o, plain, 6, NULL));
    CHECK_OK(tl_context_load_prefix(ctx, cache));
    tl_stream *s = NULL;
    CHECK_OK(tl_stream_start(f->model, ctx, f->tokens + N_PREFIX, N_TOK - N_PREFIX, &o, &s));
    int k = 0;
    for (int32_t t = 0; k < 6 && tl_stream_next(s, &t, NULL) == TL_OK && t >= 0;) streamed[k++] = t;
    CHECK(k == 6 && memcmp(plain, streamed, sizeof plain) == 0, "a stream from a loaded prefix");
    CHECK_STATUS(tl_context_load_prefix(ctx, cache), TL_ERR_INVALID_ARGUMENT);   /* stream open */
    tl_stream_free(s);
    tl_context_free(ctx);

    if (f->info.n_core > 0) {   /* kept loop states travel with the snapshot: deepen after load */
        tl_context_options co;
        tl_context_options_default(&co);
        co.keep_loop_states = 1;
        tl_context *a = NULL, *b = NULL;
        tl_prefix_cache *states = NULL;
        /* (a warm state init keeps no loop states: TL_ERR_UNSUPPORTED, tested elsewhere) */
        if (tl_context_create(f->model, &co, &a) == TL_OK) {
            CHECK_OK(tl_context_create(f->model, &co, &b));
            CHECK_STATUS(tl_context_load_prefix(b, cache), TL_ERR_INVALID_ARGUMENT);   /* no states */
            CHECK_OK(tl_context_append(a, f->tokens, N_PREFIX, 2, NULL));
            CHECK_OK(tl_prefix_cache_from_context(a, 0, &states));
            CHECK_OK(tl_context_load_prefix(b, states));
            CHECK_OK(tl_context_deepen(a, 4, NULL, want));
            CHECK_OK(tl_context_deepen(b, 4, NULL, got));
            CHECK(memcmp(want, got, (size_t)V * sizeof *got) == 0, "deepening a loaded prefix");
            tl_context_free(a);
            tl_context_free(b);
        }
        /* a prefix deeper than a context caches */
        co.keep_loop_states = 0;
        co.max_depth = 3;
        CHECK_OK(tl_context_create(f->model, &co, &a));
        tl_prefix_cache *deep = NULL;
        CHECK_OK(tl_prefix_cache_create(f->model, f->tokens, 4, 5, &deep));
        CHECK_STATUS(tl_context_load_prefix(a, deep), TL_ERR_INVALID_ARGUMENT);
        tl_context_free(a);
        tl_prefix_cache_free(deep);
        tl_prefix_cache_free(states);
        tl_prefix_cache *bad = NULL;
        CHECK_STATUS(tl_prefix_cache_create(f->model, f->tokens, 4, f->info.max_depth + 1, &bad),
                     TL_ERR_INVALID_ARGUMENT);
        CHECK_STATUS(tl_prefix_cache_create(f->model, f->tokens, 4, -1, &bad), TL_ERR_INVALID_ARGUMENT);
        CHECK(bad == NULL, "no cache on failure");
    }

    /* errors */
    tl_prefix_cache *none = NULL;
    CHECK_STATUS(tl_prefix_cache_create(NULL, f->tokens, 4, 0, &none), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_cache_create(f->model, NULL, 4, 0, &none), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_cache_create(f->model, f->tokens, 0, 0, &none), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_cache_create(f->model, f->tokens, 4, 0, NULL), TL_ERR_INVALID_ARGUMENT);
    int32_t bad_token = V;
    CHECK_STATUS(tl_prefix_cache_create(f->model, &bad_token, 1, 0, &none), TL_ERR_INVALID_ARGUMENT);
    int32_t *long_prompt = calloc(MAX_SEQ + 1, sizeof *long_prompt);
    CHECK_STATUS(tl_prefix_cache_create(f->model, long_prompt, MAX_SEQ + 1, 0, &none), TL_ERR_CONTEXT_FULL);
    free(long_prompt);
    CHECK_STATUS(tl_context_load_prefix(NULL, cache), TL_ERR_INVALID_ARGUMENT);
    tl_context_options small;
    tl_context_options_default(&small);
    small.max_seq_len = 8;
    tl_context *tiny = NULL;
    CHECK_OK(tl_context_create(f->model, &small, &tiny));
    CHECK_STATUS(tl_context_load_prefix(tiny, cache), TL_ERR_CONTEXT_FULL);
    CHECK(strstr(tl_last_error(), "longer than the context") != NULL, "message: %s", tl_last_error());
    CHECK_STATUS(tl_context_load_prefix(tiny, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_cache_from_context(tiny, 0, &none), TL_ERR_INVALID_ARGUMENT);  /* empty */
    tl_context_free(tiny);
    CHECK_STATUS(tl_prefix_cache_get_info(NULL, &n, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_OK(tl_prefix_cache_free(NULL));
    /* another model's cache (the same file loaded twice is another model) */
    tl_load_options lo;
    tl_load_options_default(&lo);
    lo.max_seq_len = MAX_SEQ;
    lo.n_threads = 1;
    tl_model *other = NULL;
    CHECK_OK(tl_load_model(current_model, &lo, &other));
    tl_context *foreign = new_context(other, 0);
    CHECK_STATUS(tl_context_load_prefix(foreign, cache), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "another model") != NULL, "message: %s", tl_last_error());
    tl_prefix_pool *other_pool = NULL;
    CHECK_OK(tl_prefix_pool_create(other, NULL, &other_pool));
    CHECK_STATUS(tl_prefix_pool_add_cache(other_pool, cache), TL_ERR_INVALID_ARGUMENT);
    int32_t out[4];
    CHECK_STATUS(tl_generate_with_pool(f->model, other_pool, f->tokens, 4, &o, out, 4, NULL),
                 TL_ERR_INVALID_ARGUMENT);
    tl_prefix_pool_free(other_pool);
    tl_context_free(foreign);
    tl_free_model(other);

    tl_prefix_cache_free(cache);
    tl_prefix_cache_free(part);
    CHECK(prefix_bytes_now(f) == before, "freed caches leave the memory report");
    free(want);
    free(got);
}

static tl_prefix_pool *new_pool(fixture *f, uint64_t max_bytes, int register_prompts) {
    tl_prefix_pool_options po;
    tl_prefix_pool_options_default(&po);
    po.max_bytes = max_bytes;
    po.register_prompts = register_prompts;
    tl_prefix_pool *pool = NULL;
    CHECK_OK(tl_prefix_pool_create(f->model, &po, &pool));
    return pool;
}

static size_t matched(tl_prefix_pool *pool, const int32_t *prompt, size_t n, int32_t depth) {
    tl_prefix_cache *c = NULL;
    size_t m = 0;
    CHECK_OK(tl_prefix_pool_lookup(pool, prompt, n, depth, &c, &m));
    tl_prefix_cache_free(c);
    return m;
}

/* Generations from a pool give plain generation's tokens and report what they reused. */
static void test_generate_with_pool(fixture *f) {
    tl_prefix_pool *pool = new_pool(f, 0, 0);
    CHECK_OK(tl_prefix_pool_add(pool, f->tokens, N_PREFIX, 0, NULL));
    CHECK_OK(tl_prefix_pool_add(pool, f->tokens, 6, 0, NULL));
    CHECK(matched(pool, f->tokens, N_TOK, 0) == N_PREFIX, "the longest prefix matches");
    CHECK(matched(pool, f->tokens, 8, 0) == 6, "a shorter prompt matches the shorter prefix");
    CHECK(matched(pool, f->tokens + 1, 8, 0) == 0, "no prefix of another prompt");
    if (f->info.n_core > 0) CHECK(matched(pool, f->tokens, N_TOK, 2) == 0, "another depth is no match");
    tl_generate_options opts[2] = { greedy_options(6), greedy_options(6) };
    opts[1].temperature = 0.9f;
    opts[1].seed = 11;
    size_t lengths[2] = { N_TOK, N_PREFIX };   /* the whole prompt a prefix: its last is computed */
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            int32_t plain[6], pooled[6];
            tl_generate_result r;
            tl_generate_result_default(&r);
            CHECK_OK(tl_generate(f->model, f->tokens, lengths[j], &opts[i], plain, 6, NULL));
            CHECK_OK(tl_generate_with_pool(f->model, pool, f->tokens, lengths[j], &opts[i], pooled, 6, &r));
            CHECK(memcmp(plain, pooled, sizeof plain) == 0, "pooled generation %d/%d", i, j);
            CHECK(r.n_tokens == 6 && r.n_prompt_tokens == lengths[j] &&
                      r.n_cached_tokens == (j == 0 ? N_PREFIX : N_PREFIX - 1),
                  "result: %u tokens, %u prompt, %u cached", r.n_tokens, r.n_prompt_tokens, r.n_cached_tokens);
        }
    /* a first-release result struct is written only as far as it goes */
    struct { tl_generate_result r; char tail[16]; } old;
    memset(&old, 0x5a, sizeof old);
    old.r.struct_size = (uint32_t)offsetof(tl_generate_result, n_drafted);
    int32_t out[6];
    CHECK_OK(tl_generate_with_pool(f->model, pool, f->tokens, N_TOK, &opts[0], out, 6, &old.r));
    CHECK(old.r.n_tokens == 6 && ((unsigned char *)&old.r)[offsetof(tl_generate_result, n_drafted)] == 0x5a,
          "a first-release result");
    /* a stream from the pool */
    tl_stream *s = NULL;
    CHECK_OK(tl_stream_start_with_pool(f->model, pool, f->tokens, N_TOK, &opts[0], &s));
    int32_t plain[6], t = 0;
    CHECK_OK(tl_generate(f->model, f->tokens, N_TOK, &opts[0], plain, 6, NULL));
    int k = 0;
    while (k < 6 && tl_stream_next(s, &t, NULL) == TL_OK && t >= 0) out[k++] = t;
    tl_generate_result r;
    tl_generate_result_default(&r);
    CHECK_OK(tl_stream_result(s, &r));
    CHECK(k == 6 && memcmp(plain, out, sizeof plain) == 0 && r.n_cached_tokens == N_PREFIX, "pooled stream");
    tl_stream_free(s);
    /* nothing matches: the whole prompt is computed */
    tl_generate_result_default(&r);
    CHECK_OK(tl_generate_with_pool(f->model, pool, f->tokens + 1, 8, &opts[0], out, 6, &r));
    CHECK(r.n_cached_tokens == 0, "no match, nothing cached");
    tl_prefix_pool_stats st;
    tl_prefix_pool_stats_default(&st);
    CHECK_OK(tl_prefix_pool_get_stats(pool, &st));
    CHECK(st.n_prefixes == 2 && st.n_hits >= 8 && st.n_misses >= 2 && st.n_evicted == 0, "stats");
    /* errors */
    CHECK_STATUS(tl_generate_with_pool(f->model, NULL, f->tokens, 4, &opts[0], out, 6, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate_with_pool(NULL, pool, f->tokens, 4, &opts[0], out, 6, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate_with_pool(f->model, pool, f->tokens, 0, &opts[0], out, 6, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate_with_pool(f->model, pool, NULL, 4, &opts[0], out, 6, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate_with_pool(f->model, pool, f->tokens, 4, &opts[0], NULL, 6, NULL), TL_ERR_INVALID_ARGUMENT);
    tl_generate_options deep = opts[0];
    deep.depth = -1;
    CHECK_STATUS(tl_generate_with_pool(f->model, pool, f->tokens, 4, &deep, out, 6, NULL),
                 f->info.n_core ? TL_ERR_INVALID_ARGUMENT : TL_OK);
    tl_prefix_cache *c = NULL;
    size_t m = 0;
    CHECK_STATUS(tl_prefix_pool_lookup(NULL, f->tokens, 4, 0, &c, &m), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_pool_lookup(pool, NULL, 4, 0, &c, &m), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_pool_add(NULL, f->tokens, 4, 0, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_pool_add_cache(pool, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_stream_start_with_pool(f->model, pool, f->tokens, 0, &opts[0], &s), TL_ERR_INVALID_ARGUMENT);
    CHECK(s == NULL, "no stream on failure");
    tl_prefix_pool_options po;
    tl_prefix_pool_options_default(&po);
    po.register_prompts = 2;
    tl_prefix_pool *bad = NULL;
    CHECK_STATUS(tl_prefix_pool_create(f->model, &po, &bad), TL_ERR_INVALID_ARGUMENT);
    po.struct_size = 3;
    CHECK_STATUS(tl_prefix_pool_create(f->model, &po, &bad), TL_ERR_INVALID_ARGUMENT);
    CHECK_OK(tl_prefix_pool_free(NULL));
    tl_prefix_pool_free(pool);
}

/* Least recently used first; a cache a caller holds outlives its eviction and the pool. */
static void test_prefix_pool_eviction(fixture *f) {
    int V = f->info.vocab_size;
    int32_t prompts[5][10];
    for (int p = 0; p < 5; p++)
        for (int i = 0; i < 10; i++) prompts[p][i] = (int32_t)((p * 31 + i * 7 + 1) % V);
    tl_prefix_cache *probe = NULL;
    CHECK_OK(tl_prefix_cache_create(f->model, prompts[0], 10, 0, &probe));
    uint64_t one = 0;
    CHECK_OK(tl_prefix_cache_get_info(probe, NULL, NULL, &one));
    tl_prefix_pool *pool = new_pool(f, 2 * one + one / 2, 0);
    CHECK_OK(tl_prefix_pool_add_cache(pool, probe));
    tl_prefix_cache_free(probe);   /* the pool holds its own reference */
    CHECK_OK(tl_prefix_pool_add(pool, prompts[1], 10, 0, NULL));
    CHECK(matched(pool, prompts[0], 10, 0) == 10, "0 is held (and now the most recently used)");
    CHECK_OK(tl_prefix_pool_add(pool, prompts[2], 10, 0, NULL));
    CHECK(matched(pool, prompts[1], 10, 0) == 0, "the least recently used (1) was evicted");
    CHECK(matched(pool, prompts[0], 10, 0) == 10 && matched(pool, prompts[2], 10, 0) == 10, "0 and 2 stay");
    tl_prefix_pool_stats st;
    tl_prefix_pool_stats_default(&st);
    CHECK_OK(tl_prefix_pool_get_stats(pool, &st));
    CHECK(st.n_prefixes == 2 && st.bytes == 2 * one && st.n_evicted == 1 && st.max_bytes == 2 * one + one / 2,
          "budget accounting: %u prefixes, %llu bytes", st.n_prefixes, (unsigned long long)st.bytes);
    /* hold 2, evict it, use it */
    tl_prefix_cache *held = NULL;
    size_t m = 0;
    CHECK_OK(tl_prefix_pool_lookup(pool, prompts[2], 10, 0, &held, &m));
    CHECK_OK(tl_prefix_pool_add(pool, prompts[3], 10, 0, NULL));
    CHECK_OK(tl_prefix_pool_add(pool, prompts[4], 10, 0, NULL));
    CHECK(matched(pool, prompts[2], 10, 0) == 0, "2 was evicted from the pool");
    tl_prefix_pool_free(pool);
    float *want = malloc((size_t)V * sizeof *want), *got = malloc((size_t)V * sizeof *got);
    tl_context *ctx = new_context(f->model, 0);
    CHECK_OK(tl_context_append(ctx, prompts[2], 10, 0, want));
    CHECK_OK(tl_context_load_prefix(ctx, held));
    CHECK_OK(tl_context_truncate(ctx, 9));
    CHECK_OK(tl_context_append(ctx, prompts[2] + 9, 1, 0, got));
    CHECK(memcmp(want, got, (size_t)V * sizeof *got) == 0, "a held cache survives eviction and its pool");
    tl_context_free(ctx);
    tl_prefix_cache_free(held);
    /* a single prefix larger than the whole budget */
    pool = new_pool(f, one - 1, 0);
    CHECK_STATUS(tl_prefix_pool_add(pool, prompts[0], 10, 0, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "max_bytes") != NULL, "message: %s", tl_last_error());
    tl_prefix_pool_free(pool);
    free(want);
    free(got);
}

typedef struct pool_job {
    fixture *f;
    tl_prefix_pool *pool;
    const int32_t (*prompts)[N_TOK];
    const int32_t (*want)[6];
    int index, mismatches;
    tl_status st;
} pool_job;

static void *pool_thread_main(void *p) {
    pool_job *j = p;
    tl_generate_options o = greedy_options(6);
    j->st = TL_OK;
    for (int rep = 0; rep < 6 && j->st == TL_OK; rep++) {
        int which = (rep + j->index) % 4;
        int32_t out[6];
        j->st = tl_generate_with_pool(j->f->model, j->pool, j->prompts[which], N_TOK, &o, out, 6, NULL);
        if (j->st == TL_OK && memcmp(out, j->want[which], sizeof out) != 0) j->mismatches++;
    }
    return NULL;
}

/* Four threads generate from one pool that registers their prompts and evicts under
 * them (a budget of two prompts): each gets plain generation's tokens. */
static void test_prefix_pool_threads(fixture *f) {
    int32_t prompts[4][N_TOK];
    int32_t want[4][6];
    tl_generate_options o = greedy_options(6);
    for (int p = 0; p < 4; p++) {
        memcpy(prompts[p], f->tokens, sizeof prompts[p]);
        for (int i = N_PREFIX; i < N_TOK; i++) prompts[p][i] = (int32_t)((p * 13 + i) % f->info.vocab_size);
        CHECK_OK(tl_generate(f->model, prompts[p], N_TOK, &o, want[p], 6, NULL));
    }
    tl_prefix_cache *probe = NULL;
    CHECK_OK(tl_prefix_cache_create(f->model, prompts[0], N_TOK, 0, &probe));
    uint64_t one = 0;
    CHECK_OK(tl_prefix_cache_get_info(probe, NULL, NULL, &one));
    tl_prefix_cache_free(probe);
    tl_prefix_pool *pool = new_pool(f, 2 * one + one / 2, 1);
    for (int p = 0; p < 4; p++) {   /* registers all four, evicting two */
        int32_t out[6];
        CHECK_OK(tl_generate_with_pool(f->model, pool, prompts[p], N_TOK, &o, out, 6, NULL));
    }
    pool_job jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (pool_job){ f, pool, (const int32_t (*)[N_TOK])prompts, (const int32_t (*)[6])want, i, 0, TL_OK };
        pthread_create(&th[i], NULL, pool_thread_main, &jobs[i]);
    }
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++)
        CHECK(jobs[i].st == TL_OK && jobs[i].mismatches == 0, "thread %d: status %s, %d mismatches", i,
              tl_status_name(jobs[i].st), jobs[i].mismatches);
    tl_prefix_pool_stats st;
    tl_prefix_pool_stats_default(&st);
    CHECK_OK(tl_prefix_pool_get_stats(pool, &st));
    CHECK(st.n_hits + st.n_misses == 28 && st.n_prefixes <= 2 && st.bytes <= st.max_bytes &&
              st.n_evicted >= 2,
          "pool after threads: %llu hits, %llu misses, %u held, %llu evicted", (unsigned long long)st.n_hits,
          (unsigned long long)st.n_misses, st.n_prefixes, (unsigned long long)st.n_evicted);
    tl_prefix_pool_free(pool);
}

static void test_version(void) {
    CHECK(tl_abi_version() == TL_ABI_VERSION, "abi version");
    CHECK(tl_version_string() && tl_version_string()[0], "version string");
    CHECK(strcmp(tl_status_name(TL_ERR_CONTEXT_FULL), "TL_ERR_CONTEXT_FULL") == 0, "status name");
}

/* ---- body dtype ---------------------------------------------------------------- */

/* body_dtype: bad values refused, an old struct loads as stored, f16 / f32 bodies load,
 * score close to the stored one and grow the report by the body's decoded size. */
static void test_body_dtype(fixture *f, const char *path) {
    tl_load_options lo;
    tl_load_options_default(&lo);
    lo.max_seq_len = MAX_SEQ;
    lo.n_threads = 2;
    tl_model *m = NULL;
    lo.body_dtype = 3;
    CHECK_STATUS(tl_load_model(path, &lo, &m), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "body_dtype 3") != NULL, "error names body_dtype");
    lo.body_dtype = -1;
    CHECK_STATUS(tl_load_model(path, &lo, &m), TL_ERR_INVALID_ARGUMENT);

    tl_memory_report stored;
    tl_memory_report_default(&stored);
    CHECK_OK(tl_memory_report_get(f->model, &stored));
    float ref[N_TOK - 1], got[N_TOK - 1];
    CHECK_OK(tl_score(f->model, f->tokens, N_TOK, 0, ref));
    for (int32_t choice = TL_BODY_F16; choice <= TL_BODY_F32; choice++) {
        lo.body_dtype = choice;
        tl_status st = tl_load_model(path, &lo, &m);
        if (f->info.n_core == 0) {
            CHECK(st == TL_ERR_INVALID_ARGUMENT && strstr(tl_last_error(), "no loop body"),
                  "body_dtype %d on a model without a loop body is refused", choice);
            continue;
        }
        CHECK(st == TL_OK, "load with body_dtype %d", choice);
        if (st != TL_OK) continue;
        tl_model_info info;
        tl_model_info_default(&info);
        CHECK_OK(tl_model_get_info(m, &info));
        CHECK(info.body_dtype == choice, "info.body_dtype %d", info.body_dtype);
        tl_memory_report r;
        tl_memory_report_default(&r);
        CHECK_OK(tl_memory_report_get(m, &r));
        CHECK(r.body_bytes > 0 && r.weights_bytes - r.body_bytes == stored.weights_bytes - stored.body_bytes,
              "body_dtype %d: only the body's bytes change (%llu vs %llu)", choice,
              (unsigned long long)r.weights_bytes, (unsigned long long)stored.weights_bytes);
        CHECK_OK(tl_score(m, f->tokens, N_TOK, 0, got));
        CHECK(max_abs_diff(ref, got, N_TOK - 1) < 1e-2f, "body_dtype %d scores like the stored body", choice);
        CHECK_OK(tl_free_model(m));
    }
    /* a caller's struct from before the field: the value past its end is not read */
    lo.body_dtype = 9;
    lo.struct_size = (uint32_t)offsetof(tl_load_options, body_dtype);
    CHECK_OK(tl_load_model(path, &lo, &m));
    if (m) {
        tl_model_info info;
        tl_model_info_default(&info);
        CHECK_OK(tl_model_get_info(m, &info));
        CHECK(info.body_dtype == TL_BODY_AS_STORED, "an old struct loads as stored");
        CHECK_OK(tl_free_model(m));
    }
}

/* Load the model at `path` (MAX_SEQ positions, 2 threads, KV pages of page_size
 * positions; 0 = contiguous) into f; 0 when it failed. */
static int open_fixture(fixture *f, const char *path, int32_t page_size) {
    memset(f, 0, sizeof *f);
    tl_load_options lo;
    tl_load_options_default(&lo);
    lo.max_seq_len = MAX_SEQ;
    lo.n_threads = 2;
    lo.kv_page_size = page_size;
    tl_status st = tl_load_model(path, &lo, &f->model);
    CHECK(st == TL_OK, "load %s (kv_page_size %d)", path, page_size);
    if (st != TL_OK) return 0;
    f->paged = page_size > 0;
    tl_model_info_default(&f->info);
    CHECK_OK(tl_model_get_info(f->model, &f->info));
    CHECK(f->info.max_seq_len == MAX_SEQ && f->info.n_threads == 2, "info reflects load options");
    for (int i = 0; i < N_TOK; i++) f->tokens[i] = (int32_t)((i * 7919 + 13) % f->info.vocab_size);
    return 1;
}

/* ---- metadata, log messages, the backend handshake ------------------------------ */

/* Every entry enumerates in strict key order with a known type whose getter reads it,
 * the other getters refuse it, and bad indexes, keys and pointers are errors. */
static void test_metadata(fixture *f) {
    size_t n = 0;
    CHECK_OK(tl_model_metadata_count(f->model, &n));
    CHECK(n > 0, "a random model has metadata (general.name at least)");
    const char *prev = NULL;
    for (size_t i = 0; i < n; i++) {
        const char *key = NULL;
        tl_metadata_type type = 0;
        CHECK_OK(tl_model_metadata_key(f->model, i, &key, &type));
        if (!key) continue;
        CHECK(!prev || strcmp(prev, key) < 0, "metadata keys in byte order: %s then %s", prev, key);
        prev = key;
        int64_t iv;
        double fv;
        const char *sv;
        size_t len;
        tl_status want_int = type == TL_METADATA_INT ? TL_OK : TL_ERR_INVALID_ARGUMENT;
        tl_status want_float = type == TL_METADATA_FLOAT ? TL_OK : TL_ERR_INVALID_ARGUMENT;
        tl_status want_string = type == TL_METADATA_STRING ? TL_OK : TL_ERR_INVALID_ARGUMENT;
        CHECK(type >= TL_METADATA_INT && type <= TL_METADATA_STRING, "%s: type %d", key, (int)type);
        CHECK_STATUS(tl_model_get_metadata_int(f->model, key, &iv), want_int);
        CHECK_STATUS(tl_model_get_metadata_float(f->model, key, &fv), want_float);
        CHECK_STATUS(tl_model_get_metadata_string(f->model, key, &sv, &len), want_string);
        if (strcmp(key, "general.name") == 0)
            CHECK(type == TL_METADATA_STRING && len == strlen(f->info.name) && memcmp(sv, f->info.name, len) == 0,
                  "general.name is the info's name");
    }
    const char *key = NULL;
    CHECK_OK(tl_model_metadata_key(f->model, 0, &key, NULL));   /* the type is optional */
    CHECK_STATUS(tl_model_metadata_key(f->model, n, &key, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "out of range") != NULL, "index error: %s", tl_last_error());
    int64_t iv;
    CHECK_STATUS(tl_model_get_metadata_int(f->model, "no.such.key", &iv), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "no.such.key") != NULL, "the missing key is named: %s", tl_last_error());
    CHECK_STATUS(tl_model_get_metadata_int(f->model, "general.name", &iv), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "is a string, not an int") != NULL, "type error: %s", tl_last_error());
    CHECK_STATUS(tl_model_metadata_count(NULL, &n), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_model_metadata_count(f->model, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_model_metadata_key(f->model, 0, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_model_get_metadata_float(f->model, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
}

typedef struct log_record {
    int n;
    tl_log_level levels[32];
    char texts[32][64];
    pthread_mutex_t lock;
} log_record;

static void record_log(tl_log_level level, const char *message, void *user_data) {
    log_record *r = user_data;
    pthread_mutex_lock(&r->lock);
    if (r->n < 32) {
        r->levels[r->n] = level;
        snprintf(r->texts[r->n], sizeof r->texts[r->n], "%s", message);
    }
    r->n++;
    pthread_mutex_unlock(&r->lock);
}

static void *log_from_thread(void *arg) {
    for (int i = 0; i < 200; i++) tl_log(TL_LOG_DEBUG, "thread %d", i);
    return arg;
}

/* Messages reach the callback with their level; without one, the newest 16 warnings and
 * errors wait for the next callback and the rest are dropped; long messages are cut;
 * threads may log while the callback is replaced. */
static void test_log(void) {
    log_record r = {.n = 0};
    pthread_mutex_init(&r.lock, NULL);
    CHECK_OK(tl_log_set(NULL, NULL));
    for (int i = 0; i < 20; i++) tl_log(i % 2 ? TL_LOG_ERROR : TL_LOG_WARN, "kept %d", i);
    tl_log(TL_LOG_INFO, "dropped: info without a callback");
    CHECK_OK(tl_log_set(record_log, &r));
    CHECK(r.n == 16, "the backlog holds the last 16 warnings and errors, got %d", r.n);
    CHECK(strcmp(r.texts[0], "kept 4") == 0 && strcmp(r.texts[15], "kept 19") == 0 &&
              r.levels[0] == TL_LOG_WARN && r.levels[15] == TL_LOG_ERROR,
          "backlog oldest first: %s .. %s", r.texts[0], r.texts[15]);
    r.n = 0;
    CHECK_OK(tl_log_set(record_log, &r));
    CHECK(r.n == 0, "the backlog is delivered once, got %d more", r.n);
    tl_log(TL_LOG_DEBUG, "value %d of %s", 42, "x");
    CHECK(r.n == 1 && r.levels[0] == TL_LOG_DEBUG && strcmp(r.texts[0], "value 42 of x") == 0,
          "a debug message with its arguments: %d, %s", r.n, r.texts[0]);
    char *long_text = malloc(3 * TL_LOG_MESSAGE_MAX);
    memset(long_text, 'a', 3 * TL_LOG_MESSAGE_MAX - 1);
    long_text[3 * TL_LOG_MESSAGE_MAX - 1] = '\0';
    tl_log(TL_LOG_WARN, "%s", long_text);   /* cut, without overrunning anything (ASan) */
    free(long_text);
    CHECK(r.n == 2, "the long message arrived");

    pthread_t threads[2];
    r.n = 0;
    for (int t = 0; t < 2; t++) pthread_create(&threads[t], NULL, log_from_thread, NULL);
    for (int i = 0; i < 50; i++) CHECK_OK(tl_log_set(i % 2 ? NULL : record_log, &r));
    CHECK_OK(tl_log_set(record_log, &r));
    for (int t = 0; t < 2; t++) pthread_join(threads[t], NULL);
    CHECK(r.n <= 400, "no message twice: %d", r.n);
    CHECK_OK(tl_log_set(NULL, NULL));
    pthread_mutex_destroy(&r.lock);
}

/* The core refuses a backend library's ops table of another interface version or size,
 * with a message naming it, and takes its own CPU table; the shared check refuses a
 * host table of another build the same way. */
static void test_backend_handshake(void) {
    tl_backend *be = NULL;
    CHECK_OK(tl_backend_cpu_create(&be));
    if (!be) return;
    CHECK_OK(tl_backend_check_ops(be->ops, "cpu"));
    tl_backend_ops ops = *be->ops;
    tl_backend_close(be);
    ops.version = TL_BACKEND_INTERFACE_VERSION + 1;
    CHECK_STATUS(tl_backend_check_ops(&ops, "old/libtinyloop_cuda.so"), TL_ERR_UNSUPPORTED);
    CHECK(strstr(tl_last_error(), "old/libtinyloop_cuda.so has backend interface version") != NULL &&
              strstr(tl_last_error(), "different builds") != NULL,
          "version mismatch named: %s", tl_last_error());
    ops.version = TL_BACKEND_INTERFACE_VERSION;
    ops.struct_size -= 8;   /* a table one op short */
    CHECK_STATUS(tl_backend_check_ops(&ops, "short"), TL_ERR_UNSUPPORTED);
    CHECK_STATUS(tl_backend_check_ops(NULL, "none"), TL_ERR_UNSUPPORTED);

    char msg[512] = "";
    CHECK(tl_backend_interface_mismatch("a", "b", "tl_backend_host", TL_BACKEND_INTERFACE_VERSION,
                                        sizeof(tl_backend_host), sizeof(tl_backend_host), msg, sizeof msg) == 0 &&
              msg[0] == '\0',
          "a matching host passes");
    CHECK(tl_backend_interface_mismatch("libtinyloop.so", "libtinyloop_cuda.so", "tl_backend_host", 0,
                                        sizeof(tl_backend_host), sizeof(tl_backend_host), msg, sizeof msg) == 1 &&
              strstr(msg, "libtinyloop.so has backend interface version 0") != NULL,
          "an old host refused: %s", msg);
}

static void run_model(const char *path) {
    current_model = path;
    fixture f;
    if (!open_fixture(&f, path, 0)) return;

    test_score_equals_decode(&f);
    test_score_with_uncertainty(&f);
    test_logprobs(&f);
    test_logit_adjustments(&f);
    test_grammar(&f);
    test_consistency_escalation(&f);
    test_chunked_prefill(&f);
    test_truncate_and_fork(&f);
    test_append_batch(&f);
    test_deepen(&f);
    test_resume(&f);
    test_greedy_matches_argmax(&f);
    test_sampling_determinism(&f);
    test_stop_conditions(&f);
    test_stream_and_callback(&f);
    test_errors(&f, path);
    test_metadata(&f);
    test_speculative(&f);
    test_tree_speculative(&f);
    test_draft_vocab(&f, path);
    test_memory_report(&f);
    test_kv_policy(&f);
    test_body_dtype(&f, path);
    test_two_threads(&f);
    test_prefix_cache(&f);
    test_generate_with_pool(&f);
    test_prefix_pool_eviction(&f);
    test_prefix_pool_threads(&f);
    CHECK_OK(tl_free_model(f.model));
}

/* Paged KV (kv_page_size): the pool follows the sequences, forks share pages and copy
 * one on write, the cap refuses an append and leaves the sequence usable, and the whole
 * model's pages are back when every holder is freed (ASan: no page leaks or is used after
 * its last reference). */
static void test_paged_pool(fixture *f, const char *path) {
    int V = f->info.vocab_size;
    tl_memory_report r;
    tl_memory_report_default(&r);
    float *ref = malloc((size_t)V * sizeof *ref), *got = malloc((size_t)V * sizeof *got);
    tl_context *ctx = new_context(f->model, 0), *fork = NULL, *other = NULL;
    CHECK(ctx != NULL, "paged context");
    if (!ctx) goto done;
    CHECK_OK(tl_memory_report_get(f->model, &r));
    uint64_t base = r.kv_pages_in_use, base_bytes = r.kv_pool_bytes;   /* the model's own context's */
    CHECK_OK(tl_context_append(ctx, f->tokens, 10, 0, NULL));
    CHECK_OK(tl_memory_report_get(f->model, &r));
    uint64_t held = r.kv_pages_in_use, page = (r.kv_pool_bytes - base_bytes) / 3;
    CHECK(r.kv_page_size == 4 && held == base + 3, "10 tokens in pages of 4: %llu pages",
          (unsigned long long)(held - base));
    CHECK_OK(tl_context_fork(ctx, &fork));
    CHECK_OK(tl_memory_report_get(f->model, &r));
    CHECK(r.kv_pages_in_use == held, "a fork takes no page (%llu)", (unsigned long long)r.kv_pages_in_use);
    CHECK_OK(tl_context_append(ctx, f->tokens + 10, 1, 0, ref));
    CHECK_OK(tl_context_append(fork, f->tokens + 10, 1, 0, got));
    CHECK(memcmp(ref, got, (size_t)V * sizeof *ref) == 0, "a fork continues as the original");
    CHECK_OK(tl_memory_report_get(f->model, &r));
    CHECK(r.kv_pages_in_use == held + 1, "copy on write: one page more (%llu)", (unsigned long long)r.kv_pages_in_use);
    tl_context_free(fork);
    fork = NULL;
    CHECK_OK(tl_context_truncate(ctx, 4));
    CHECK_OK(tl_memory_report_get(f->model, &r));
    CHECK(r.kv_pages_in_use == base + 1, "truncate gives pages back (%llu)",
          (unsigned long long)(r.kv_pages_in_use - base));
    tl_context_free(ctx);
    ctx = NULL;
    CHECK_OK(tl_memory_report_get(f->model, &r));
    CHECK(r.kv_pages_in_use == base && r.kv_pool_bytes == base_bytes, "every page is back");

    /* a pool of two pages: the third is refused, the sequence kept */
    tl_model *capped = NULL;
    tl_load_options lo;
    tl_load_options_default(&lo);
    lo.max_seq_len = MAX_SEQ;
    lo.n_threads = 2;
    lo.kv_page_size = 4;
    lo.kv_pool_bytes = (int64_t)(2 * page);
    CHECK_OK(tl_load_model(path, &lo, &capped));
    if (!capped) goto done;
    ctx = new_context(capped, 0);
    if (ctx) {
        CHECK_OK(tl_context_append(ctx, f->tokens, 8, 0, NULL));
        CHECK_STATUS(tl_context_append(ctx, f->tokens + 8, 1, 0, got), TL_ERR_OUT_OF_MEMORY);
        CHECK(strstr(tl_last_error(), "kv_pool_bytes") != NULL, "the error names the cap: %s", tl_last_error());
        size_t n = 0;
        CHECK_OK(tl_context_length(ctx, &n));
        CHECK(n == 8, "the refused append left %zu tokens", n);
        other = new_context(capped, 0);
        if (other) CHECK_STATUS(tl_context_append(other, f->tokens, 1, 0, NULL), TL_ERR_OUT_OF_MEMORY);
        CHECK_OK(tl_context_truncate(ctx, 4));
        CHECK_OK(tl_context_append(ctx, f->tokens + 4, 4, 0, got));   /* the page given back */
    }
    tl_context_free(other);
    other = NULL;
    tl_context_free(ctx);
    ctx = NULL;
    CHECK_OK(tl_free_model(capped));

    /* bad values */
    lo.kv_pool_bytes = 0;
    int32_t bad[] = { 3, -4, 8192, TL_KV_PAGE_MAX + 1 };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        lo.kv_page_size = bad[i];
        CHECK_STATUS(tl_load_model(path, &lo, &capped), TL_ERR_INVALID_ARGUMENT);
        CHECK(strstr(tl_last_error(), "kv_page_size") != NULL, "names kv_page_size: %s", tl_last_error());
    }
    lo.kv_page_size = 0;
    lo.kv_pool_bytes = 1 << 20;
    CHECK_STATUS(tl_load_model(path, &lo, &capped), TL_ERR_INVALID_ARGUMENT);
    lo.kv_page_size = 4;
    lo.kv_pool_bytes = -1;
    CHECK_STATUS(tl_load_model(path, &lo, &capped), TL_ERR_INVALID_ARGUMENT);
done:
    tl_context_free(fork);
    tl_context_free(ctx);
    free(ref);
    free(got);
}

/* The tests that hold a model's sequences, forks, batches, speculation, deepening and
 * prefix caches to their contiguous results, again on a paged KV cache (pages of 4). */
static void run_paged(const char *path) {
    fixture f;
    if (!open_fixture(&f, path, 4)) return;
    test_score_equals_decode(&f);
    test_chunked_prefill(&f);
    test_truncate_and_fork(&f);
    test_append_batch(&f);
    test_deepen(&f);
    test_greedy_matches_argmax(&f);
    test_speculative(&f);
    test_tree_speculative(&f);
    test_kv_policy(&f);
    test_two_threads(&f);
    test_prefix_cache(&f);
    test_generate_with_pool(&f);
    test_paged_pool(&f, path);
    CHECK_OK(tl_free_model(f.model));
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.tinyloop [MODEL.tinyloop ...]\n", argv[0]);
        return 2;
    }
    current_model = "-";
    test_version();
    test_log();
    test_backend_handshake();
    for (int i = 1; i < argc; i++) {
        run_model(argv[i]);
        run_paged(argv[i]);
    }
    printf("test_api: %d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
