/* grammar_parse.c — GBNF text to the flat rules of grammar.h.
 *
 *   rule        ::= name "::=" alternatives      (ends at a newline outside parentheses,
 *                                                  unless the next line starts with "|")
 *   alternatives::= sequence ("|" sequence)*
 *   sequence    ::= (primary ("*" | "+" | "?")?)*
 *   primary     ::= "literal" | [class] | [^class] | . | name | "(" alternatives ")"
 *
 * Rules are built as lists of alternatives first (a group inside an alternative is a
 * rule of its own, built while its parent is), then flattened. */
#include "decode/grammar.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"

typedef struct { tl_gelem *e; size_t n, cap; } seq_t;

typedef struct {
    char *name;
    seq_t *alts;
    size_t n_alts, cap_alts;
    int defined;
    int ref_line, ref_col;   /* first reference, for "undefined rule" */
} prule_t;

typedef struct {
    const char *src, *p;
    prule_t *rules;
    size_t n_rules, cap_rules;
    tl_gclass *classes;
    size_t n_classes, cap_classes;
    uint32_t (*ranges)[2];
    size_t n_ranges, cap_ranges;
    tl_status st;
} parser_t;

static int grow(void **buf, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 1;
    size_t c = *cap ? *cap * 2 : 8;
    while (c < need) c *= 2;
    void *b = realloc(*buf, c * elem);
    if (!b) return 0;
    *buf = b;
    *cap = c;
    return 1;
}

static void position(const parser_t *P, const char *at, int *line, int *col) {
    *line = 1;
    *col = 1;
    for (const char *q = P->src; q < at; q++) {
        if (*q == '\n') {
            (*line)++;
            *col = 1;
        } else if ((*q & 0xC0) != 0x80) {   /* columns count characters, not bytes */
            (*col)++;
        }
    }
}

/* Record the first error (line:column of `at`) and return 0. */
static int error_at(parser_t *P, const char *at, const char *what) {
    if (P->st != TL_OK) return 0;
    int line, col;
    position(P, at, &line, &col);
    P->st = tl_fail(TL_ERR_INVALID_ARGUMENT, "grammar: line %d column %d: %s", line, col, what);
    return 0;
}

static int oom(parser_t *P) {
    if (P->st == TL_OK) P->st = tl_fail(TL_ERR_OUT_OF_MEMORY, "grammar: out of memory");
    return 0;
}

static int push_elem(parser_t *P, seq_t *s, uint32_t kind, uint32_t id) {
    if (!grow((void **)&s->e, &s->cap, s->n + 1, sizeof *s->e)) return oom(P);
    s->e[s->n++] = (tl_gelem){ kind, id };
    return 1;
}

/* The rule called name[0..len) (created on first use); -1 on failure. */
static long rule_named(parser_t *P, const char *name, size_t len) {
    for (size_t i = 0; i < P->n_rules; i++)
        if (strlen(P->rules[i].name) == len && memcmp(P->rules[i].name, name, len) == 0) return (long)i;
    if (!grow((void **)&P->rules, &P->cap_rules, P->n_rules + 1, sizeof *P->rules)) return oom(P) - 1;
    prule_t *r = &P->rules[P->n_rules];
    memset(r, 0, sizeof *r);
    r->name = malloc(len + 1);
    if (!r->name) return oom(P) - 1;
    memcpy(r->name, name, len);
    r->name[len] = 0;
    return (long)P->n_rules++;
}

/* A rule made by the parser for a group or a repetition, named after its parent. */
static long helper_rule(parser_t *P, long parent) {
    char name[160];
    snprintf(name, sizeof name, "%.120s (part %zu)", P->rules[parent].name, P->n_rules);
    long r = rule_named(P, name, strlen(name));
    if (r >= 0) P->rules[r].defined = 1;
    return r;
}

static seq_t *new_alt(parser_t *P, long rule) {
    prule_t *r = &P->rules[rule];
    if (!grow((void **)&r->alts, &r->cap_alts, r->n_alts + 1, sizeof *r->alts)) return oom(P), NULL;
    seq_t *s = &r->alts[r->n_alts++];
    memset(s, 0, sizeof *s);
    return s;
}

static int name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
}

/* Skip spaces and comments; newlines too when `newlines`. */
static void skip_space(parser_t *P, int newlines) {
    for (;;) {
        char c = *P->p;
        if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
            P->p++;
        } else if (c == '#') {
            while (*P->p && *P->p != '\n') P->p++;
        } else {
            return;
        }
    }
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One character of a literal or class, escapes decoded, into *cp. */
static int read_char(parser_t *P, uint32_t *cp) {
    const char *at = P->p;
    if (*P->p == '\\') {
        P->p++;
        char c = *P->p++;
        int digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
        if (digits) {
            uint32_t v = 0;
            for (int i = 0; i < digits; i++) {
                int h = hex_value(*P->p);
                if (h < 0) return error_at(P, P->p, "expected a hexadecimal digit in an escape");
                v = v * 16 + (uint32_t)h;
                P->p++;
            }
            if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
                return error_at(P, at, "escape of a code point that is not a character (a surrogate, "
                                       "D800-DFFF, or past 10FFFF)");
            *cp = v;
            return 1;
        }
        switch (c) {
        case 'n': *cp = '\n'; return 1;
        case 't': *cp = '\t'; return 1;
        case 'r': *cp = '\r'; return 1;
        case '"': case '\\': case '[': case ']': case '-': case '^': case '\'':
            *cp = (uint32_t)(unsigned char)c;
            return 1;
        default:
            return error_at(P, at, "unknown escape (expected \\n \\t \\r \\\" \\\\ \\[ \\] \\- \\^ \\xHH "
                                   "\\uHHHH)");
        }
    }
    size_t len = tl_utf8_decode((const uint8_t *)P->p, strlen(P->p), cp);
    if (len == 0) return error_at(P, at, "invalid UTF-8");
    P->p += len;
    return 1;
}

static long add_class(parser_t *P, int negated) {
    if (!grow((void **)&P->classes, &P->cap_classes, P->n_classes + 1, sizeof *P->classes)) return oom(P) - 1;
    P->classes[P->n_classes] = (tl_gclass){ (uint32_t)P->n_ranges, 0, negated };
    return (long)P->n_classes++;
}

static int add_range(parser_t *P, long cls, uint32_t lo, uint32_t hi) {
    if (!grow((void **)&P->ranges, &P->cap_ranges, P->n_ranges + 1, sizeof *P->ranges)) return oom(P);
    P->ranges[P->n_ranges][0] = lo;
    P->ranges[P->n_ranges][1] = hi;
    P->n_ranges++;
    P->classes[cls].n++;
    return 1;
}

static int parse_alternatives(parser_t *P, long rule, int nested);

/* One primary, appended to s as its elements (a literal is one class per character). */
static int parse_primary(parser_t *P, long rule, seq_t *s, int nested) {
    const char *at = P->p;
    char c = *P->p;
    if (c == '"') {
        P->p++;
        while (*P->p != '"') {
            if (!*P->p || *P->p == '\n') return error_at(P, at, "unterminated string literal (expected '\"')");
            uint32_t cp;
            if (!read_char(P, &cp)) return 0;
            long k = add_class(P, 0);
            if (k < 0 || !add_range(P, k, cp, cp) || !push_elem(P, s, GE_CLASS, (uint32_t)k)) return 0;
        }
        P->p++;
        return 1;
    }
    if (c == '[') {
        P->p++;
        int negated = *P->p == '^';
        if (negated) P->p++;
        long k = add_class(P, negated);
        if (k < 0) return 0;
        while (*P->p != ']') {
            if (!*P->p || *P->p == '\n')
                return error_at(P, at, "unterminated character class (expected ']')");
            uint32_t lo, hi;
            if (!read_char(P, &lo)) return 0;
            hi = lo;
            if (P->p[0] == '-' && P->p[1] && P->p[1] != ']') {
                P->p++;
                if (!read_char(P, &hi)) return 0;
                if (hi < lo) return error_at(P, at, "character range with its end below its start");
            }
            if (!add_range(P, k, lo, hi)) return 0;
        }
        P->p++;
        return push_elem(P, s, GE_CLASS, (uint32_t)k);
    }
    if (c == '.') {
        P->p++;
        long k = add_class(P, 1);   /* nothing excluded: any code point */
        return k >= 0 && push_elem(P, s, GE_CLASS, (uint32_t)k);
    }
    if (c == '(') {
        P->p++;
        long group = helper_rule(P, rule);
        if (group < 0 || !parse_alternatives(P, group, 1)) return 0;
        skip_space(P, 1);
        if (*P->p != ')') return error_at(P, P->p, "expected ')' to close the group");
        P->p++;
        return push_elem(P, s, GE_RULE, (uint32_t)group);
    }
    if (name_char(c)) {
        const char *name = P->p;
        while (name_char(*P->p)) P->p++;
        long r = rule_named(P, name, (size_t)(P->p - name));
        if (r < 0) return 0;
        if (!P->rules[r].ref_line) position(P, name, &P->rules[r].ref_line, &P->rules[r].ref_col);
        return push_elem(P, s, GE_RULE, (uint32_t)r);
    }
    (void)nested;
    return error_at(P, at, "expected a string literal, a character class, a rule name or '('");
}

/* Wrap the elements s[from..) that a repetition applies to and replace them by it. */
static int apply_repetition(parser_t *P, long rule, seq_t *s, size_t from, char op) {
    tl_gelem item;
    if (s->n - from == 1) {
        item = s->e[from];
    } else {
        long g = helper_rule(P, rule);
        seq_t *body = g >= 0 ? new_alt(P, g) : NULL;
        if (!body) return 0;
        for (size_t i = from; i < s->n; i++)
            if (!push_elem(P, body, s->e[i].kind, s->e[i].id)) return 0;
        item = (tl_gelem){ GE_RULE, (uint32_t)g };
    }
    s->n = from;
    long rep = helper_rule(P, rule);
    if (rep < 0) return 0;
    /* x* : rep ::= x rep | ""     x+ : x rep     x? : rep ::= x | "" */
    seq_t *a = new_alt(P, rep);
    if (!a || !push_elem(P, a, item.kind, item.id)) return 0;
    if (op != '?' && !push_elem(P, a, GE_RULE, (uint32_t)rep)) return 0;
    if (!new_alt(P, rep)) return 0;
    if (op == '+' && !push_elem(P, s, item.kind, item.id)) return 0;
    return push_elem(P, s, GE_RULE, (uint32_t)rep);
}

static int parse_sequence(parser_t *P, long rule, int nested) {
    seq_t *s = new_alt(P, rule);
    if (!s) return 0;
    size_t alt = P->rules[rule].n_alts - 1;   /* s moves when the rules array grows */
    for (;;) {
        skip_space(P, nested);
        char c = *P->p;
        if (!c || c == '|' || c == ')' || c == '\n') return 1;
        seq_t *cur = &P->rules[rule].alts[alt];
        size_t from = cur->n;
        if (!parse_primary(P, rule, cur, nested)) return 0;
        c = *P->p;
        if (c == '*' || c == '+' || c == '?') {
            P->p++;
            if (!apply_repetition(P, rule, &P->rules[rule].alts[alt], from, c)) return 0;
        }
    }
}

/* At a newline ending a top-level sequence: whether the next line goes on with "|". */
static int continues_with_bar(parser_t *P) {
    const char *save = P->p;
    skip_space(P, 1);
    if (*P->p == '|') return 1;
    P->p = save;
    return 0;
}

static int parse_alternatives(parser_t *P, long rule, int nested) {
    for (;;) {
        if (!parse_sequence(P, rule, nested)) return 0;
        if (*P->p == '\n' && !nested && !continues_with_bar(P)) return 1;
        if (*P->p != '|') return 1;
        P->p++;
    }
}

static int parse_rule(parser_t *P) {
    const char *at = P->p;
    if (!name_char(*P->p)) return error_at(P, at, "expected a rule name");
    while (name_char(*P->p)) P->p++;
    long r = rule_named(P, at, (size_t)(P->p - at));
    if (r < 0) return 0;
    if (P->rules[r].defined) return error_at(P, at, "rule defined twice");
    P->rules[r].defined = 1;
    skip_space(P, 0);
    if (strncmp(P->p, "::=", 3) != 0) return error_at(P, P->p, "expected '::='");
    P->p += 3;
    skip_space(P, 1);
    if (!parse_alternatives(P, r, 0)) return 0;
    if (*P->p == ')') return error_at(P, P->p, "unexpected ')'");
    if (*P->p && *P->p != '\n') return error_at(P, P->p, "expected the end of the line");
    return 1;
}

/* nullable[r]: rule r can match the empty string (a fixpoint over the rules). */
static void find_nullable(const tl_grammar_rules *g, uint8_t *nullable) {
    memset(nullable, 0, g->n_rules);
    for (int changed = 1; changed;) {
        changed = 0;
        for (size_t r = 0; r < g->n_rules; r++) {
            if (nullable[r]) continue;
            for (uint32_t a = g->rule_alt0[r]; a < g->rule_alt0[r + 1] && !nullable[r]; a++) {
                const tl_gelem *e = &g->elems[g->alts[a]];
                while (e->kind == GE_RULE && nullable[e->id]) e++;
                if (e->kind == GE_END) nullable[r] = changed = 1;
            }
        }
    }
}

/* Depth-first search for a rule that reaches itself without consuming a character. */
static int left_recursive(const tl_grammar_rules *g, const uint8_t *nullable, uint8_t *state, uint32_t r,
                          uint32_t *found) {
    if (state[r] == 2) return 0;
    if (state[r] == 1) {
        *found = r;
        return 1;
    }
    state[r] = 1;
    for (uint32_t a = g->rule_alt0[r]; a < g->rule_alt0[r + 1]; a++) {
        for (const tl_gelem *e = &g->elems[g->alts[a]]; e->kind == GE_RULE; e++) {
            if (left_recursive(g, nullable, state, e->id, found)) return 1;
            if (!nullable[e->id]) break;
        }
    }
    state[r] = 2;
    return 0;
}

static tl_status flatten(parser_t *P, tl_grammar_rules *g) {
    size_t n_elems = 0, n_alts = 0;
    for (size_t r = 0; r < P->n_rules; r++) {
        n_alts += P->rules[r].n_alts;
        for (size_t a = 0; a < P->rules[r].n_alts; a++) n_elems += P->rules[r].alts[a].n + 1;
    }
    g->elems = malloc((n_elems + 1) * sizeof *g->elems);
    g->alts = malloc((n_alts + 1) * sizeof *g->alts);
    g->rule_alt0 = malloc((P->n_rules + 1) * sizeof *g->rule_alt0);
    if (!g->elems || !g->alts || !g->rule_alt0) return tl_fail(TL_ERR_OUT_OF_MEMORY, "grammar: out of memory");
    size_t e = 0, k = 0;
    for (size_t r = 0; r < P->n_rules; r++) {
        g->rule_alt0[r] = (uint32_t)k;
        for (size_t a = 0; a < P->rules[r].n_alts; a++) {
            const seq_t *s = &P->rules[r].alts[a];
            g->alts[k++] = (uint32_t)e;
            if (s->n) memcpy(g->elems + e, s->e, s->n * sizeof *s->e);
            e += s->n;
            g->elems[e++] = (tl_gelem){ GE_END, 0 };
        }
    }
    g->rule_alt0[P->n_rules] = (uint32_t)k;
    g->n_elems = e;
    g->n_rules = P->n_rules;
    g->classes = P->classes;
    g->n_classes = P->n_classes;
    g->ranges = P->ranges;
    g->n_ranges = P->n_ranges;
    P->classes = NULL;
    P->ranges = NULL;
    return TL_OK;
}

static tl_status check_rules(parser_t *P, tl_grammar_rules *g) {
    long root = -1;
    for (size_t r = 0; r < P->n_rules; r++) {
        if (!P->rules[r].defined)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "grammar: line %d column %d: rule '%s' is used but not "
                           "defined", P->rules[r].ref_line, P->rules[r].ref_col, P->rules[r].name);
        if (strcmp(P->rules[r].name, "root") == 0) root = (long)r;
    }
    if (root < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "grammar: no rule 'root' (the start rule)");
    g->root = (uint32_t)root;
    uint8_t *nullable = malloc(g->n_rules + 1), *state = calloc(g->n_rules + 1, 1);
    tl_status st = TL_OK;
    if (!nullable || !state) st = tl_fail(TL_ERR_OUT_OF_MEMORY, "grammar: out of memory");
    if (st == TL_OK) {
        find_nullable(g, nullable);
        uint32_t found = 0;
        for (uint32_t r = 0; r < g->n_rules && st == TL_OK; r++)
            if (left_recursive(g, nullable, state, r, &found))
                st = tl_fail(TL_ERR_INVALID_ARGUMENT, "grammar: rule '%s' is left-recursive (it can reach "
                             "itself before matching a character), which is not supported", P->rules[found].name);
    }
    free(nullable);
    free(state);
    return st;
}

static void parser_free(parser_t *P) {
    for (size_t r = 0; r < P->n_rules; r++) {
        for (size_t a = 0; a < P->rules[r].n_alts; a++) free(P->rules[r].alts[a].e);
        free(P->rules[r].alts);
        free(P->rules[r].name);
    }
    free(P->rules);
    free(P->classes);
    free(P->ranges);
}

tl_status tl_grammar_parse(const char *text, tl_grammar_rules *g) {
    memset(g, 0, sizeof *g);
    parser_t P = { .src = text, .p = text, .st = TL_OK };
    for (;;) {
        skip_space(&P, 1);
        if (!*P.p) break;
        if (!parse_rule(&P)) break;
    }
    tl_status st = P.st;
    if (st == TL_OK) st = flatten(&P, g);
    if (st == TL_OK) st = check_rules(&P, g);
    parser_free(&P);
    if (st != TL_OK) tl_grammar_rules_free(g);
    return st;
}

void tl_grammar_rules_free(tl_grammar_rules *g) {
    free(g->elems);
    free(g->classes);
    free(g->ranges);
    free(g->alts);
    free(g->rule_alt0);
    memset(g, 0, sizeof *g);
}
