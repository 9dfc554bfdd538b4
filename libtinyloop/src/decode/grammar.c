/* grammar.c — see grammar.h: a grammar compiled against a vocabulary, the matcher of a
 * generation and its token mask.
 *
 * The tokens form a trie over their bytes. The mask walks it from the matcher's state (a
 * stack set and the character it is in the middle of, if any), decoding UTF-8 along the
 * path: a byte that completes a character advances the set by that code point, a byte
 * that leaves it incomplete narrows the interval of code points that can still complete
 * it, and a subtree is pruned as soon as the set is empty, the bytes cannot be UTF-8 or
 * no stack's next class meets the interval. So a step costs in proportion to the tokens
 * that stay possible (and their shared prefixes), not to the vocabulary times the token
 * lengths; while a character is pending only the tokens that begin with continuation
 * bytes are looked at. Empty tokens, and tokens that can never be UTF-8 wherever they
 * come, are left out of the trie. */
#include "decode/grammar.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model/model.h"

typedef struct trie_node {
    uint32_t byte;
    uint32_t first_child, next_sibling;   /* 0 = none (node 0 is the root) */
    int32_t first_token;                  /* tokens spelled by the path here, -1 = none */
} trie_node;

struct tl_grammar {
    int refs;               /* the caller's reference and one per matcher (atomic) */
    tl_grammar_rules rules;
    int32_t vocab;
    trie_node *nodes;
    size_t n_nodes;
    int32_t *next_token;    /* [vocab]: the next token at the same trie node, -1 = none */
    uint8_t *bytes;         /* the bytes of every token in the trie, concatenated */
    uint32_t *byte_start;   /* [vocab + 1]; a token left out has none */
    uint32_t max_bytes;     /* the longest token, in bytes */
};

/* ---- stack sets ---------------------------------------------------------------- */

typedef struct stack_set {
    uint32_t *data;           /* the stacks' elements, concatenated (bottom first) */
    size_t n_data, cap_data;
    uint32_t (*stacks)[2];    /* each stack's start in data and length */
    size_t n, cap;
} stack_set;

/* The mask is a function of the state alone (the stack set and the pending character),
 * and generations come back to the same states (every character inside a JSON string
 * leaves the same one): a few recent masks are kept with the state they were walked
 * from. */
#define MASK_CACHE 4

typedef struct mask_entry {
    stack_set from;           /* a copy of the set */
    tl_utf8_state pending;    /* and of the character it was in */
    uint8_t *allowed;         /* [vocab] */
    size_t n_allowed;
    int used;
} mask_entry;

struct tl_grammar_matcher {
    const tl_grammar *g;
    stack_set cur, next;
    tl_utf8_state pending;    /* the character the text ends inside of (have == 0: none);
                                 cur is the set before it */
    mask_entry cache[MASK_CACHE];
    unsigned cache_next;      /* the entry replaced next */
    stack_set *levels;        /* [max_bytes + 2]: the mask's trie walk, one set per depth */
    uint32_t *work;           /* expansion scratch: stacks being built, one after another */
    size_t cap_work;
    uint8_t *allowed;         /* [vocab] */
    int failed;               /* out of memory in a set: the mask then allows nothing */
};

static int ensure(void **buf, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 1;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *b = realloc(*buf, c * elem);
    if (!b) return 0;
    *buf = b;
    *cap = c;
    return 1;
}

static void set_clear(stack_set *s) {
    s->n = 0;
    s->n_data = 0;
}

static void set_free(stack_set *s) {
    free(s->data);
    free(s->stacks);
    memset(s, 0, sizeof *s);
}

/* Add a stack unless the set holds it already. */
static void set_add(tl_grammar_matcher *m, stack_set *s, const uint32_t *st, size_t len) {
    for (size_t i = 0; i < s->n; i++)
        if (s->stacks[i][1] == len && (len == 0 || memcmp(s->data + s->stacks[i][0], st, len * sizeof *st) == 0))
            return;
    if (!ensure((void **)&s->data, &s->cap_data, s->n_data + len, sizeof *s->data) ||
        !ensure((void **)&s->stacks, &s->cap, s->n + 1, sizeof *s->stacks)) {
        m->failed = 1;
        return;
    }
    if (len) memcpy(s->data + s->n_data, st, len * sizeof *st);
    s->stacks[s->n][0] = (uint32_t)s->n_data;
    s->stacks[s->n][1] = (uint32_t)len;
    s->n++;
    s->n_data += len;
}

/* Expand the stack work[at .. at + len) until its top is a character class (or it is
 * empty) and add the results to out. A rule reference on top is replaced by what
 * follows it, then each of the rule's alternatives is pushed in a copy. */
static void expand(tl_grammar_matcher *m, stack_set *out, size_t at, size_t len) {
    const tl_grammar_rules *R = &m->g->rules;
    if (len == 0 || R->elems[m->work[at + len - 1]].kind == GE_CLASS) {
        set_add(m, out, m->work + at, len);
        return;
    }
    uint32_t pos = m->work[at + len - 1];
    uint32_t rule = R->elems[pos].id;
    if (R->elems[pos + 1].kind != GE_END) {
        m->work[at + len - 1] = pos + 1;
    } else {
        len--;
    }
    size_t copy = at + len + 1;   /* past this stack, its top slot included */
    for (uint32_t a = R->rule_alt0[rule]; a < R->rule_alt0[rule + 1]; a++) {
        if (!ensure((void **)&m->work, &m->cap_work, copy + len + 1, sizeof *m->work)) {
            m->failed = 1;
            return;
        }
        if (len) memmove(m->work + copy, m->work + at, len * sizeof *m->work);
        uint32_t first = R->alts[a];
        size_t n = len;
        if (R->elems[first].kind != GE_END) m->work[copy + n++] = first;
        expand(m, out, copy, n);
    }
}

/* Whether class cls takes some code point of [lo, hi]. */
static int class_meets(const tl_grammar_rules *R, uint32_t cls, uint32_t lo, uint32_t hi) {
    const tl_gclass *c = &R->classes[cls];
    const uint32_t (*r)[2] = R->ranges + c->first;
    if (!c->negated) {
        for (uint32_t i = 0; i < c->n; i++)
            if (r[i][0] <= hi && r[i][1] >= lo) return 1;
        return 0;
    }
    /* negated: unless the ranges cover all of [lo, hi]; x runs past the ranges that
     * cover it, in any order, until one is left uncovered or hi is passed */
    for (uint32_t x = lo;;) {
        int moved = 0;
        for (uint32_t i = 0; i < c->n; i++) {
            if (r[i][0] <= x && x <= r[i][1]) {
                if (r[i][1] >= hi) return 0;
                x = r[i][1] + 1;
                moved = 1;
            }
        }
        if (!moved) return 1;
    }
}

/* Whether some stack of s can take a code point of [lo, hi] next. */
static int set_meets(const tl_grammar_rules *R, const stack_set *s, uint32_t lo, uint32_t hi) {
    for (size_t i = 0; i < s->n; i++) {
        size_t len = s->stacks[i][1];
        if (len && class_meets(R, R->elems[s->data[s->stacks[i][0] + len - 1]].id, lo, hi)) return 1;
    }
    return 0;
}

/* out = the stacks of `in` after code point cp. */
static void advance(tl_grammar_matcher *m, const stack_set *in, uint32_t cp, stack_set *out) {
    const tl_grammar_rules *R = &m->g->rules;
    set_clear(out);
    for (size_t i = 0; i < in->n; i++) {
        size_t len = in->stacks[i][1];
        if (len == 0) continue;
        const uint32_t *st = in->data + in->stacks[i][0];
        uint32_t pos = st[len - 1];
        if (!class_meets(R, R->elems[pos].id, cp, cp)) continue;
        if (!ensure((void **)&m->work, &m->cap_work, len + 1, sizeof *m->work)) {
            m->failed = 1;
            return;
        }
        memcpy(m->work, st, len * sizeof *st);   /* len >= 1 here */
        if (R->elems[pos + 1].kind != GE_END) {
            m->work[len - 1] = pos + 1;
        } else {
            len--;
        }
        expand(m, out, 0, len);
    }
}

static int set_accepts_end(const stack_set *s) {
    for (size_t i = 0; i < s->n; i++)
        if (s->stacks[i][1] == 0) return 1;
    return 0;
}

/* ---- the matcher ------------------------------------------------------------------ */

tl_status tl_grammar_matcher_new(const tl_grammar *g, tl_grammar_matcher **out) {
    *out = NULL;
    tl_grammar_matcher *m = calloc(1, sizeof *m);
    if (!m) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a grammar matcher");
    m->g = g;
    __atomic_add_fetch(&((tl_grammar *)g)->refs, 1, __ATOMIC_RELAXED);   /* released with m */
    m->levels = calloc((size_t)g->max_bytes + 2, sizeof *m->levels);
    m->allowed = malloc((size_t)g->vocab + 1);
    m->cap_work = 0;
    if (!m->levels || !m->allowed || !ensure((void **)&m->work, &m->cap_work, 64, sizeof *m->work)) {
        tl_grammar_matcher_free(m);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a grammar matcher");
    }
    const tl_grammar_rules *R = &g->rules;
    m->work[0] = 0;
    for (uint32_t a = R->rule_alt0[R->root]; a < R->rule_alt0[R->root + 1]; a++) {
        size_t n = 0;
        if (R->elems[R->alts[a]].kind != GE_END) m->work[n++] = R->alts[a];
        expand(m, &m->cur, 0, n);
    }
    if (m->failed) {
        tl_grammar_matcher_free(m);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a grammar matcher");
    }
    *out = m;
    return TL_OK;
}

void tl_grammar_matcher_free(tl_grammar_matcher *m) {
    if (!m) return;
    set_free(&m->cur);
    set_free(&m->next);
    if (m->levels)
        for (uint32_t i = 0; i <= m->g->max_bytes + 1; i++) set_free(&m->levels[i]);
    for (int i = 0; i < MASK_CACHE; i++) {
        set_free(&m->cache[i].from);
        free(m->cache[i].allowed);
    }
    free(m->levels);
    free(m->work);
    free(m->allowed);
    tl_grammar *g = (tl_grammar *)m->g;
    free(m);
    tl_grammar_free(g);
}

/* Mark the tokens below trie node `node` at `depth` bytes, whose path leaves the stacks
 * `here` (cur or a level above depth + 1) and the character u pending. */
static void walk(tl_grammar_matcher *m, uint32_t node, const stack_set *here, tl_utf8_state u, uint32_t depth,
                 size_t *n_allowed) {
    const tl_grammar *g = m->g;
    for (uint32_t c = g->nodes[node].first_child; c; c = g->nodes[c].next_sibling) {
        tl_utf8_state v = u;
        uint32_t lo = g->nodes[c].byte, hi;
        int r = u.have == 0 && lo < 0x80 ? TL_UTF8_DONE : tl_utf8_feed(&v, (uint8_t)lo, &lo, &hi);   /* ASCII first */
        const stack_set *next = here;
        if (r == TL_UTF8_INVALID) continue;
        if (r == TL_UTF8_DONE) {
            next = &m->levels[depth + 1];
            advance(m, here, lo, &m->levels[depth + 1]);
            if (next->n == 0) continue;
        } else if (!set_meets(&g->rules, here, lo, hi)) {
            continue;
        }
        for (int32_t t = g->nodes[c].first_token; t >= 0; t = g->next_token[t]) {
            m->allowed[t] = 1;
            (*n_allowed)++;
        }
        walk(m, c, next, v, depth + 1, n_allowed);
    }
}

static int pending_equal(tl_utf8_state a, tl_utf8_state b) {
    return a.have == b.have && (a.have == 0 || (a.len == b.len && a.value == b.value));
}

static int sets_equal(const stack_set *a, const stack_set *b) {
    return a->n == b->n && a->n_data == b->n_data &&
           (a->n == 0 || memcmp(a->stacks, b->stacks, a->n * sizeof *a->stacks) == 0) &&
           (a->n_data == 0 || memcmp(a->data, b->data, a->n_data * sizeof *a->data) == 0);
}

/* Keep m->allowed (n tokens) as the mask of the current set; best effort. */
static void cache_store(tl_grammar_matcher *m, size_t n) {
    mask_entry *e = &m->cache[m->cache_next];
    size_t V = (size_t)m->g->vocab;
    if (!e->allowed && !(e->allowed = malloc(V))) return;
    e->used = 0;
    if (!ensure((void **)&e->from.data, &e->from.cap_data, m->cur.n_data, sizeof *e->from.data) ||
        !ensure((void **)&e->from.stacks, &e->from.cap, m->cur.n, sizeof *e->from.stacks))
        return;
    if (m->cur.n_data) memcpy(e->from.data, m->cur.data, m->cur.n_data * sizeof *m->cur.data);
    if (m->cur.n) memcpy(e->from.stacks, m->cur.stacks, m->cur.n * sizeof *m->cur.stacks);
    e->from.n = m->cur.n;
    e->from.n_data = m->cur.n_data;
    e->pending = m->pending;
    memcpy(e->allowed, m->allowed, V);
    e->n_allowed = n;
    e->used = 1;
    m->cache_next = (m->cache_next + 1) % MASK_CACHE;
}

/* The tokens the current state allows, in m->allowed (EOS not yet decided). */
static size_t allowed_tokens(tl_grammar_matcher *m) {
    size_t V = (size_t)m->g->vocab;
    for (int i = 0; i < MASK_CACHE; i++) {
        if (m->cache[i].used && pending_equal(m->cache[i].pending, m->pending) &&
            sets_equal(&m->cache[i].from, &m->cur)) {
            memcpy(m->allowed, m->cache[i].allowed, V);
            return m->cache[i].n_allowed;
        }
    }
    memset(m->allowed, 0, V);
    size_t n = 0;
    walk(m, 0, &m->cur, m->pending, 0, &n);
    if (!m->failed) cache_store(m, n);
    return n;
}

tl_status tl_grammar_mask(tl_grammar_matcher *m, float *logits, int32_t eos, size_t *n_allowed) {
    const tl_grammar *g = m->g;
    size_t n = allowed_tokens(m);
    if (eos >= 0 && eos < g->vocab) {
        n -= m->allowed[eos];
        m->allowed[eos] = (uint8_t)(m->pending.have == 0 && set_accepts_end(&m->cur));
        n += m->allowed[eos];
    }
    *n_allowed = n;
    if (m->failed)   /* a stack set could not grow: the mask would be wrong */
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "grammar matcher: out of memory");
    for (int32_t t = 0; t < g->vocab; t++)
        if (!m->allowed[t]) logits[t] = -INFINITY;
    return TL_OK;
}

/* Advance the state over byte b; 0 (and an empty set: nothing can follow) when the
 * text cannot go on with it. */
static int feed(tl_grammar_matcher *m, uint8_t b) {
    uint32_t lo, hi;
    int r = tl_utf8_feed(&m->pending, b, &lo, &hi);
    if (r == TL_UTF8_DONE) {
        advance(m, &m->cur, lo, &m->next);
        stack_set tmp = m->cur;
        m->cur = m->next;
        m->next = tmp;
    } else if (r == TL_UTF8_INVALID || !set_meets(&m->g->rules, &m->cur, lo, hi)) {
        set_clear(&m->cur);
        m->pending = (tl_utf8_state){ 0, 0, 0 };
        return 0;
    }
    return m->cur.n > 0;
}

void tl_grammar_accept(tl_grammar_matcher *m, int32_t t) {
    const tl_grammar *g = m->g;
    if (t < 0 || t >= g->vocab) return;
    for (uint32_t i = g->byte_start[t]; i < g->byte_start[t + 1]; i++)
        if (!feed(m, g->bytes[i])) return;
}

int tl_grammar_complete(const tl_grammar_matcher *m) {
    return m->pending.have == 0 && m->cur.n == 1 && m->cur.stacks[0][1] == 0;
}

/* ---- compiling against a vocabulary ---------------------------------------------- */

static uint32_t trie_child(tl_grammar *g, uint32_t node, uint8_t b) {
    uint32_t *link = &g->nodes[node].first_child;
    while (*link && g->nodes[*link].byte < b) link = &g->nodes[*link].next_sibling;
    if (*link && g->nodes[*link].byte == b) return *link;
    uint32_t c = (uint32_t)g->n_nodes++;   /* room was reserved: one node per byte */
    g->nodes[c] = (trie_node){ b, 0, *link, -1 };
    *link = c;
    return c;
}

/* Whether s[0..n) can be the bytes of some stretch of UTF-8 text: at most 3 continuation
 * bytes (the end of a character begun before), then valid UTF-8 that may end inside a
 * character. Where it actually fits is the mask's business. */
static int may_be_utf8(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n && i < 3 && (s[i] & 0xC0) == 0x80) i++;
    tl_utf8_state u = { 0, 0, 0 };
    uint32_t lo, hi;
    for (; i < n; i++)
        if (tl_utf8_feed(&u, s[i], &lo, &hi) == TL_UTF8_INVALID) return 0;
    return 1;
}

static tl_status build_vocabulary(tl_grammar *g, const uint8_t *const *bytes, const size_t *lengths) {
    size_t total = 0;
    for (int32_t t = 0; t < g->vocab; t++) total += bytes[t] ? lengths[t] : 0;
    if (total >= UINT32_MAX) return tl_fail(TL_ERR_INVALID_ARGUMENT, "the vocabulary's bytes (%zu) exceed 4 GiB", total);
    g->bytes = malloc(total + 1);
    g->byte_start = malloc(((size_t)g->vocab + 1) * sizeof *g->byte_start);
    g->next_token = malloc((size_t)g->vocab * sizeof *g->next_token);
    g->nodes = malloc((total + 1) * sizeof *g->nodes);
    if (!g->bytes || !g->byte_start || !g->next_token || !g->nodes)
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate the grammar's vocabulary of %d tokens", g->vocab);
    g->nodes[0] = (trie_node){ 0, 0, 0, -1 };
    g->n_nodes = 1;
    size_t k = 0;
    for (int32_t t = 0; t < g->vocab; t++) {
        g->byte_start[t] = (uint32_t)k;
        g->next_token[t] = -1;
        size_t n = bytes[t] ? lengths[t] : 0;
        if (n == 0 || !may_be_utf8(bytes[t], n)) continue;   /* never allowed */
        memcpy(g->bytes + k, bytes[t], n);
        uint32_t node = 0;
        for (size_t i = 0; i < n; i++) node = trie_child(g, node, bytes[t][i]);
        g->next_token[t] = g->nodes[node].first_token;
        g->nodes[node].first_token = t;
        if (n > g->max_bytes) g->max_bytes = (uint32_t)n;
        k += n;
    }
    g->byte_start[g->vocab] = (uint32_t)k;
    return TL_OK;
}

tl_status tl_grammar_create(tl_model *model, const char *gbnf, const uint8_t *const *token_bytes,
                            const size_t *token_lengths, tl_grammar **out) {
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    if (!model) return tl_fail(TL_ERR_INVALID_ARGUMENT, "model is NULL");
    if (!gbnf) return tl_fail(TL_ERR_INVALID_ARGUMENT, "gbnf is NULL");
    if (!token_bytes || !token_lengths)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "token_bytes or token_lengths is NULL (one entry per "
                                                "vocabulary id is needed)");
    tl_grammar *g = calloc(1, sizeof *g);
    if (!g) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a grammar");
    g->vocab = model->hp.vocab;
    g->refs = 1;
    tl_status st = tl_grammar_parse(gbnf, &g->rules);
    if (st == TL_OK) st = build_vocabulary(g, token_bytes, token_lengths);
    if (st != TL_OK) {
        tl_grammar_free(g);
        return st;
    }
    *out = g;
    return TL_OK;
}

/* Drops a reference: the caller's, or a matcher's (a generation may outlive the
 * caller's tl_grammar_free). */
tl_status tl_grammar_free(tl_grammar *g) {
    if (!g) return TL_OK;
    if (__atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) > 0) return TL_OK;
    tl_grammar_rules_free(&g->rules);
    free(g->nodes);
    free(g->next_token);
    free(g->bytes);
    free(g->byte_start);
    free(g);
    return TL_OK;
}

int32_t tl_grammar_vocab(const tl_grammar *g) { return g->vocab; }

tl_status tl_grammar_accepts(const tl_grammar *g, const char *text, size_t n, int *accepted) {
    if (!g || !accepted || (!text && n))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "grammar, accepted or text is NULL");
    *accepted = 0;
    tl_grammar_matcher *m;
    tl_status st = tl_grammar_matcher_new(g, &m);
    if (st != TL_OK) return st;
    size_t used = 0, start = 0;   /* start: where the character being read begins */
    tl_utf8_state u = { 0, 0, 0 };
    uint32_t lo, hi;
    for (; used < n; used++) {   /* UTF-8 first, whatever the grammar says */
        if (u.have == 0) start = used;
        if (tl_utf8_feed(&u, (uint8_t)text[used], &lo, &hi) == TL_UTF8_INVALID) break;
    }
    if (used < n || u.have) {
        tl_grammar_matcher_free(m);
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "text is not UTF-8 at byte %zu", start);
    }
    for (used = 0; used < n && feed(m, (uint8_t)text[used]); used++) {}
    int failed = m->failed;
    *accepted = used == n && m->pending.have == 0 && set_accepts_end(&m->cur);
    tl_grammar_matcher_free(m);
    return failed ? tl_fail(TL_ERR_OUT_OF_MEMORY, "grammar matcher: out of memory") : TL_OK;
}
