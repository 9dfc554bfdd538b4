/* grammar.h — GBNF grammars (docs/api.md, "Grammars"): the compiled rules
 * (grammar_parse.c), the matcher over code points and the per-step token mask
 * (grammar.c).
 *
 * A grammar is a set of rules; each rule a list of alternatives; each alternative a
 * sequence of elements (a character class or a rule reference) ended by GE_END, all in
 * one flat array. Repetitions and groups become rules of their own. The matcher keeps a
 * set of parser stacks: each stack holds element positions still to match, its top a
 * character class (rule references are expanded eagerly); an empty stack means the
 * root rule is complete. Left recursion is refused at compile time, which keeps the
 * expansion finite. Tokens are bytes and may end inside a character: the matcher's
 * state is its stack set and the character pending (the bytes of it seen so far); a
 * token fits when its bytes, after the pending ones, are complete characters the
 * grammar takes and at most one incomplete one that some code point the grammar takes
 * next can complete. */
#ifndef TL_GRAMMAR_H
#define TL_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "base/utf8.h"
#include "tinyloop/tinyloop.h"

enum { GE_END = 0, GE_CLASS = 1, GE_RULE = 2 };

typedef struct tl_gelem {
    uint32_t kind;   /* GE_* */
    uint32_t id;     /* GE_CLASS: class index; GE_RULE: rule index */
} tl_gelem;

typedef struct tl_gclass {
    uint32_t first, n;   /* ranges[first .. first + n), inclusive code point ranges */
    int negated;
} tl_gclass;

typedef struct tl_grammar_rules {
    tl_gelem *elems;
    size_t n_elems;
    tl_gclass *classes;
    size_t n_classes;
    uint32_t (*ranges)[2];
    size_t n_ranges;
    uint32_t *alts;          /* start positions in elems of every alternative, by rule */
    uint32_t *rule_alt0;     /* [n_rules + 1]: rule r's alternatives are
                                alts[rule_alt0[r] .. rule_alt0[r + 1]) */
    size_t n_rules;
    uint32_t root;
} tl_grammar_rules;

/* Parse GBNF text into rules. TL_ERR_INVALID_ARGUMENT names the line and column and what
 * was expected; undefined rules, a missing root and left recursion are refused. */
tl_status tl_grammar_parse(const char *text, tl_grammar_rules *out);
void tl_grammar_rules_free(tl_grammar_rules *r);

/* The matcher of one generation over a shared grammar. */
typedef struct tl_grammar_matcher tl_grammar_matcher;

tl_status tl_grammar_matcher_new(const tl_grammar *g, tl_grammar_matcher **out);
void tl_grammar_matcher_free(tl_grammar_matcher *m);
/* Set logits[t] = -inf for every token the grammar cannot take next; eos (-1 = none)
 * stays only where the grammar may end and no character is pending. *n_allowed = the
 * tokens left. */
tl_status tl_grammar_mask(tl_grammar_matcher *m, float *logits, int32_t eos, size_t *n_allowed);
/* Advance over token t (one the mask left). */
void tl_grammar_accept(tl_grammar_matcher *m, int32_t t);
/* 1 when the root rule is complete, no character is pending and nothing more can
 * follow. */
int tl_grammar_complete(const tl_grammar_matcher *m);
/* The vocabulary the grammar was compiled against. */
int32_t tl_grammar_vocab(const tl_grammar *g);

#endif
